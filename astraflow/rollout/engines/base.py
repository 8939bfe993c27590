"""The engine contract: generate with per-token logprobs, load weights of a given version.

Engines batch internally: many episodes call `generate` concurrently and the engine runs
them together (that is how one worker runs many episodes at once). New weights come as a
Hugging Face directory (`load_weights`: a model's starting weights) or as an in-memory state
dict with Hugging Face names (`load_state`: what the weight channel delivers, already read
and verified; a tied lm_head may be absent), with the names of the tensors that differ from
what the engine holds (`changed`; None: all) so that an engine copies only those. Either
happens between batches, never inside one, so every token of one `generate` call has one
version — except in partial rollouts (the `vllm` engine with `partial`): there a new version
pauses the generations in flight, goes in, and they resume under it, so one completion's
tokens carry the versions that produced them (`Completion.versions`). An episode that spans a
reload carries both versions in its per-token record either way.

`logprobs[i]` is the log-probability of `tokens[i]` under the distribution the token was
sampled from (softmax of logits / temperature) — the behaviour policy the trainer corrects for.
A request with `forced` tokens is scored, not sampled: the completion is exactly those
tokens, with the logprobs the same distribution gives them (a reference answer offered to
the trainer as one more group member carries the probability the policy gave it).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    # Generation ends at any of these ids (the model's eos ids, the chat turn end:
    # `ModelTokenizer.stop_ids`), kept as the completion's last token.
    stop: tuple[int, ...] = ()
    # Decode `max_tokens` tokens whatever is sampled, then cut the completion at its first
    # stop token: the cost of a long generation, the tokens of the unchanged distribution.
    ignore_eos: bool = False
    forced: tuple[int, ...] = ()  # score these tokens instead of sampling (ends with a stop token)


@dataclass(frozen=True)
class Completion:
    tokens: np.ndarray  # int32, ends with a stop token unless cut at max_tokens
    logprobs: np.ndarray  # float32, same length
    version: int  # weight version of its last token (of every token, unless `versions` says otherwise)
    finished: bool  # ended with a stop token
    decoded: int = 0  # tokens the engine decoded for it (more than len(tokens) with ignore_eos)
    aborted: bool = False  # stopped by `abort` (the vllm engine): the tokens generated until then
    # int32, same length: the version of each token, where they differ (a partial rollout
    # resumed under a newer version); None: every token is `version`'s
    versions: np.ndarray | None = None

    def token_versions(self) -> np.ndarray:
        """The weight version of each token."""
        return np.full(len(self.tokens), self.version, np.int32) if self.versions is None else self.versions


class Engine(Protocol):
    version: int

    async def generate(self, prompt: list[int], params: SamplingParams) -> Completion: ...

    async def load_weights(self, path: Path, version: int) -> None: ...

    async def load_state(self, state: dict, version: int, changed: frozenset[str] | None = None) -> None: ...

    def close(self) -> None: ...


def stop_cut(tokens: np.ndarray, stop: tuple[int, ...]) -> tuple[int, bool]:
    """(length up to and including the first stop token, whether there was one)."""
    ends = np.flatnonzero(np.isin(tokens, stop)) if stop else ()
    return (int(ends[0]) + 1, True) if len(ends) else (len(tokens), False)


def read_state(path: Path) -> dict:
    """A model directory's state dict (what an engine loads in place of its weights)."""
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))
