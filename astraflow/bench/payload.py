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


class PayloadPool:
    """Fresh random trajectories at a fraction of the cost of generating each from scratch.

    A few base trajectories are drawn once; each new one XORs the base tokens with a random
    32-bit word and shifts the logprobs by a random offset, so every payload is different
    and stays incompressible, and its CRC is recomputed from the bytes actually sent.
    """

    def __init__(self, rng: np.random.Generator, policy: str, n_tokens: int, size: int = 16) -> None:
        self.rng = rng
        self.base = [random_trajectory(rng, policy, n_tokens) for _ in range(size)]

    def draw(self, group_id: int) -> Trajectory:
        b = self.base[int(self.rng.integers(len(self.base)))]
        tokens = b.tokens ^ np.int32(self.rng.integers(1, 1 << 31))
        logprobs = b.logprobs - np.float32(self.rng.random())
        return Trajectory(policy=b.policy, tokens=tokens, logprobs=logprobs, loss_mask=b.loss_mask,
                          versions=b.versions, token_policy=b.token_policy, reward=float(self.rng.random()),
                          episode_id=int(self.rng.integers(1 << 62)), group_id=group_id, gen_s=0.0,
                          meta={"crc": payload_crc(tokens, logprobs)})
