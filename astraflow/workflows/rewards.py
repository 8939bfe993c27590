"""Rewards: a completion's score against its task. Registry: `REWARDS`; or a user's callable.

A reward is `f(completion, answer) -> float` or `f(completion, answer, row) -> float`
(`row`: the data set row's other fields, e.g. a problem's unit tests), sync or async.
`tasks.reward` names a registered one or a user's `package.module:function`; `load_reward`
resolves and checks it before any component starts.

`Scorer` is how workflows call it: built-in rewards run inline (they are fast, and
`math-verify` guards its parser with SIGALRM, which works only on the main thread, where the
worker's event loop runs); a user's runs in a thread (sync) or as a coroutine (async) under
`tasks.reward_timeout_s`. One that raises, returns something that is not a finite number, or
times out scores 0; it is counted (`Scorer.failures`) and logged (the first few of each kind
with their error), and never reaches the worker's loop. A sync reward that hangs keeps its
thread: the pool (`USER_THREADS`) bounds how many can.
"""
from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import math
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable

from astraflow.config.loader import ConfigError

log = logging.getLogger(__name__)

USER_THREADS = 8
LOGGED_PER_KIND = 3  # failures logged in full per kind; the rest are only counted

RewardFn = Callable[..., "float | Awaitable[float]"]


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = re.compile(r"[^\w\s]")


def answer_words(text: str) -> list[str]:
    """Lower case, without punctuation and articles (SQuAD's normalisation)."""
    return _ARTICLES.sub(" ", _PUNCTUATION.sub(" ", text.lower())).split()


def token_f1(completion: str, answer: str) -> float:
    """The F1 of the words the completion and the answer share (SQuAD's), after normalising
    both: "the river Elm" against "Elm" scores 2/3."""
    pred, gold = answer_words(completion), answer_words(answer)
    common = sum((Counter(pred) & Counter(gold)).values())
    if not pred or not gold or not common:
        return float(pred == gold)
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


def math_verify(completion: str, answer: str) -> float:
    """Mathematical equivalence via the `math-verify` package (e.g. "0.5" == "1/2")."""
    from math_verify import parse, verify

    gold, pred = parse(answer), parse(completion)
    return float(bool(gold) and bool(pred) and verify(gold, pred))


_BOXED = re.compile(r"\\boxed\s*\{")


def last_boxed(text: str) -> str | None:
    """The content of the last `\\boxed{...}` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, start = 1, starts[-1]
    for i in range(start, len(text)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").strip())
    except ValueError:
        return None


def boxed_math(completion: str, answer: str) -> float:
    """The last `\\boxed{}` of the completion, equivalent to the answer; 0 without one: the
    format is part of what is rewarded. Plain numbers are compared as numbers; anything else
    goes to math-verify (tens of milliseconds a call: a worker scoring every wrong answer
    with it did a tenth of the episodes it could)."""
    boxed = last_boxed(completion)
    if boxed is None:
        return 0.0
    if boxed.strip() == answer.strip():
        return 1.0
    a, b = _number(boxed), _number(answer)
    if a is not None and b is not None:
        return float(abs(a - b) <= 1e-9 * max(1.0, abs(b)))
    return math_verify(f"${boxed}$", f"${answer}$")


async def code_tests(completion: str, answer: str, row: dict) -> float:
    """The fraction of the row's unit tests (`row["tests"]`: Python assert statements) that
    pass against the completion's code (its last ```python block, else `row["prefix"]` and
    the completion), all in one sandboxed run under its limits (`grading.py`)."""
    from astraflow.sandbox import Sandbox
    from astraflow.workflows.grading import LIMITS, grade, solution_code

    tests = row.get("tests") or []
    if not tests:
        return 0.0
    return (await grade(Sandbox(LIMITS), solution_code(completion, str(row.get("prefix", ""))), list(tests))).fraction


REWARDS: dict[str, RewardFn] = {"exact_match": exact_match, "token_f1": token_f1, "math_verify": math_verify,
                                "boxed_math": boxed_math, "code_tests": code_tests}


def load_reward(name: str) -> RewardFn:
    """A registered reward, or `module:function` imported and checked; ConfigError otherwise."""
    if name in REWARDS:
        return REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"tasks.reward: {name!r} is not a registered reward {sorted(REWARDS)} nor a "
                          f"'package.module:function'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except ImportError as e:
        raise ConfigError(f"tasks.reward: cannot import {module!r} ({e})") from None
    except AttributeError:
        raise ConfigError(f"tasks.reward: module {module!r} has no {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"tasks.reward: {name} is not callable")
    _arity(fn, name)
    return fn


def _arity(fn: RewardFn, name: str) -> int:
    try:
        params = [p for p in inspect.signature(fn).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):
        return 2
    if len(params) not in (2, 3):
        raise ConfigError(f"tasks.reward: {name} takes {len(params)} required arguments; expected "
                          f"(completion, answer) or (completion, answer, row)")
    return len(params)


class Scorer:
    """Scores completions with one reward; never raises (see the module docstring)."""

    def __init__(self, name: str, timeout_s: float) -> None:
        self.name, self.fn, self.timeout_s = name, load_reward(name), timeout_s
        self.builtin = name in REWARDS
        self.wants_row = _arity(self.fn, name) == 3
        self.failures: Counter[str] = Counter()
        self._pool: ThreadPoolExecutor | None = None

    async def __call__(self, completion: str, answer: str, row: dict[str, Any] | None = None) -> float:
        args = (completion, answer, row or {}) if self.wants_row else (completion, answer)
        try:
            if self.builtin and not inspect.iscoroutinefunction(self.fn):
                value = self.fn(*args)
            elif inspect.iscoroutinefunction(self.fn):
                value = await asyncio.wait_for(self.fn(*args), self.timeout_s)
            else:
                self._pool = self._pool or ThreadPoolExecutor(USER_THREADS, thread_name_prefix="reward")
                future = asyncio.get_running_loop().run_in_executor(self._pool, self.fn, *args)
                value = await asyncio.wait_for(future, self.timeout_s)
            value = float(value)
            if not math.isfinite(value):
                raise ValueError(f"returned {value}")
            return value
        except TimeoutError:
            return self._failed("timeout", f"took longer than tasks.reward_timeout_s={self.timeout_s:g}")
        except Exception as e:  # noqa: BLE001 - a user's reward must not take the worker down
            return self._failed("error", f"{type(e).__name__}: {e}")

    def _failed(self, kind: str, why: str) -> float:
        self.failures[kind] += 1
        if self.failures[kind] <= LOGGED_PER_KIND:
            log.warning("reward %s: %s; scored 0 (%d such so far)", self.name, why, self.failures[kind])
        return 0.0
