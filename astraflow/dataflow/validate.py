"""What a commit may contain: checked before anything of it is stored, so that one bad commit
(a buggy or hostile worker holding the run secret) never poisons a run.

A stored trajectory is served to a trainer, and a trainer raises on a token id outside its
embedding table — on every restart, for as long as the sample is in the buffer — and trains
on a NaN reward or logprob as if it were data. So a commit is refused, whole, with an error
naming the field, unless:
- it holds at most `records_per_commit(cfg)` trajectories, each of at most
  `dataflow.max_trajectory_tokens` tokens;
- every token id is in [0, vocabulary size) — the size is the model directory's
  `config.json` `vocab_size` (`Vocabulary`; while the model is not there yet, ids are only
  checked to be >= 0);
- `loss_mask` is 0 or 1; `token_policy` is -1 or a policy index;
- rewards and logprobs are finite, and logprobs are <= 0 on trained tokens;
- every weight version (per token, and the commit's `versions`) is in [-1, ceiling], the
  ceiling of a policy being its newest published version (0, the starting weights, before
  any is published).
Every check is a whole-array numpy operation over the commit's concatenated columns (this is
the rank's hot path); locating the first offender is done only when there is one.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

from astraflow.config.schema import Config
from astraflow.protocol.messages import TrajectoryBatch

log = logging.getLogger(__name__)

LOOK_EVERY_S = 1.0  # while the model is not there yet, its config.json is looked for this often


class InvalidField(ValueError):
    """Content is refused; `field` names the offending part of the request."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def records_per_commit(cfg: Config) -> int:
    """The most trajectories one commit may hold: twice what this run's workflow makes for a
    task (astraflow/workflows/: a record per sampled answer and policy of the task, two
    attempts each with `workflow.retry`, plus one guided record — a reference answer or a
    verifier's contrast judgment)."""
    attempts = 2 if cfg.workflow.retry else 1
    return 2 * (cfg.tasks.group_size * len(cfg.task_policies) * attempts + 1)


class Vocabulary:
    """The policy's vocabulary size, from `MODEL_DIR/config.json`, read when first needed.

    The rank starts while the launcher may still be preparing the model (a finished model
    directory is renamed into place, so a config.json there is complete): until it exists,
    `size` is None and is looked for again at most every `LOOK_EVERY_S`; once read it is kept.
    Only JSON is read here, never the model (the rank does not import torch/transformers)."""

    def __init__(self, model_dir: Path) -> None:
        self.path = Path(model_dir) / "config.json"
        self.size: int | None = None
        self._next_look = float("-inf")
        self._complained = False

    def get(self, now: float) -> int | None:
        if self.size is None and now >= self._next_look:
            self._next_look = now + LOOK_EVERY_S
            self.size = self._read()
        return self.size

    def _read(self) -> int | None:
        try:
            cfg = json.loads(self.path.read_text())
        except FileNotFoundError:
            return None  # not prepared yet
        except (OSError, ValueError) as e:
            problem = f"unreadable ({e})"
        else:
            size = _vocab_size(cfg)
            if size is not None:
                return size
            problem = "no positive integer vocab_size"
        if not self._complained:  # it is looked at again every second: say it once
            self._complained = True
            log.error("%s: %s; until it is readable, token ids are only checked to be >= 0", self.path, problem)
        return None


def _vocab_size(cfg: object) -> int | None:
    """`vocab_size` of a transformers config (top level, or a multimodal one's `text_config`)."""
    if not isinstance(cfg, dict):
        return None
    text = cfg.get("text_config")
    size = cfg.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    return size if type(size) is int and size > 0 else None


def check_commit(trajs: TrajectoryBatch, versions: dict[str, int], policy_index: dict[str, int],
                 ceilings: np.ndarray, vocab: int | None, max_tokens: int, max_records: int,
                 vocab_source: Path) -> None:
    """Raise InvalidField for the first rule the commit breaks (see the module docstring).

    `ceilings[i]` is the newest version policy i may have generated with; its last element
    (indexed by token_policy -1: prompt, tool and environment tokens) is the largest of them."""
    n = len(trajs)
    if n > max_records:
        raise InvalidField("trajectories", f"{n} trajectories in one commit; at most {max_records} "
                                            f"(twice what this run's workflow makes for one task)")
    longest = int(trajs.lengths.max())
    if longest > max_tokens:
        i = int(trajs.lengths.argmax())
        raise InvalidField("trajectories.lengths", f"trajectory {i} has {longest} tokens; at most "
                                                    f"dataflow.max_trajectory_tokens={max_tokens}")
    _in_range(trajs, "loss_mask", trajs.loss_mask, 0, 1, "0 or 1")
    _in_range(trajs, "token_policy", trajs.token_policy, -1, len(ceilings) - 2,
              f"-1 or a policy index below {len(ceilings) - 1}")
    if vocab is None:
        _in_range(trajs, "tokens", trajs.tokens, 0, None, "a token id >= 0")
    else:
        _in_range(trajs, "tokens", trajs.tokens, 0, vocab - 1,
                  f"a token id in the vocabulary [0, {vocab}) of {vocab_source}")
    _finite(trajs, "reward", trajs.reward, per_token=False)
    lp = trajs.logprobs
    if lp.size and not (np.isfinite(lp.min()) and lp.max() <= 0):  # the usual case costs two reductions
        _finite(trajs, "logprobs", lp, per_token=True)
        trained_positive = (lp > 0) & (trajs.loss_mask == 1)
        if trained_positive.any():
            at = int(trained_positive.argmax())
            raise InvalidField("trajectories.logprobs", f"{_where(trajs, at)}: logprob {float(lp[at])} > 0 "
                                                         f"on a trained token (a log-probability is <= 0)")
    v = trajs.versions
    if v.size and not (int(v.min()) >= -1 and int(v.max()) <= int(ceilings.min())):  # likewise
        too_new = v > ceilings[trajs.token_policy]  # token_policy -1 indexes the last element
        if too_new.any() or int(v.min()) < -1:
            at = int(too_new.argmax()) if too_new.any() else int(v.argmin())
            tp = int(trajs.token_policy[at])
            raise InvalidField("trajectories.versions", f"{_where(trajs, at)}: version {int(v[at])}; expected "
                                                         f"-1 .. {int(ceilings[tp])}, the newest published version "
                                                         f"of the token's policy")
    check_versions(versions, policy_index, ceilings)


def check_versions(versions: dict[str, int], policy_index: dict[str, int], ceilings: np.ndarray) -> None:
    """A {policy: weight version} map (a commit's, a lease's, a heartbeat's): known policies,
    versions in [-1, the policy's ceiling]."""
    for policy, version in versions.items():
        if policy not in policy_index:
            raise InvalidField("versions", f"unknown policy {policy!r}")
        ceiling = int(ceilings[policy_index[policy]])
        if not -1 <= version <= ceiling:
            raise InvalidField(f"versions.{policy}", f"version {version}; expected -1 .. {ceiling}, "
                                                     f"the newest published version")


def _in_range(trajs: TrajectoryBatch, name: str, values: np.ndarray, lo: int, hi: int | None, expected: str) -> None:
    if not values.size:
        return
    vmin = lo if values.dtype.kind == "u" and lo == 0 else int(values.min())
    vmax = int(values.max()) if hi is not None else vmin
    if vmin >= lo and (hi is None or vmax <= hi):
        return
    at = int(values.argmin()) if vmin < lo else int(values.argmax())
    raise InvalidField(f"trajectories.{name}", f"{_where(trajs, at)}: {int(values[at])}; expected {expected}")


def _finite(trajs: TrajectoryBatch, name: str, values: np.ndarray, per_token: bool) -> None:
    ok = np.isfinite(values)
    if ok.all():
        return
    at = int((~ok).argmax())
    where = _where(trajs, at) if per_token else f"trajectory {at}"
    raise InvalidField(f"trajectories.{name}", f"{where}: {float(values[at])}; expected a finite number")


def _where(trajs: TrajectoryBatch, token: int) -> str:
    """'trajectory i, token j' for an index into the concatenated per-token columns."""
    i = int(np.searchsorted(trajs.offsets, token, side="right")) - 1
    return f"trajectory {i}, token {token - int(trajs.offsets[i])}"
