"""Synthetic trajectories for benchmarks and protocol tests: random, incompressible, checkable.

Each trajectory's `meta["crc"]` is the CRC32 of its token and logprob bytes, so whoever is
served it can verify it arrived intact.
"""
from __future__ import annotations

import zlib

import numpy as np

from astraflow.protocol.messages import Trajectory


def payload_crc(tokens: np.ndarray, logprobs: np.ndarray) -> int:
    return zlib.crc32(logprobs.tobytes(), zlib.crc32(tokens.tobytes()))


def random_trajectory(rng: np.random.Generator, policy: str, n_tokens: int, prompt_tokens: int = 16,
                      version: int = 0, policy_index: int = 0, reward: float | None = None,
                      group_id: int = 0) -> Trajectory:
    tokens = rng.integers(0, 1 << 31, n_tokens, dtype=np.int32)
    logprobs = -rng.random(n_tokens, dtype=np.float32) * 5
    mask = np.ones(n_tokens, np.uint8)
    mask[:prompt_tokens] = 0
    versions = np.full(n_tokens, version, np.int32)
    versions[:prompt_tokens] = -1
    token_policy = np.full(n_tokens, policy_index, np.int8)
    token_policy[:prompt_tokens] = -1
    return Trajectory(policy=policy, tokens=tokens, logprobs=logprobs, loss_mask=mask, versions=versions,
                      token_policy=token_policy, reward=float(rng.random() if reward is None else reward),
                      episode_id=int(rng.integers(1 << 62)), group_id=group_id, gen_s=0.0,
                      meta={"crc": payload_crc(tokens, logprobs)})
