"""Reward functions `(completion_text, reference_answer) -> float`. Registry: `REWARDS`."""
from __future__ import annotations

from typing import Callable


def exact_match(completion: str, answer: str) -> float:
    return float(completion.strip() == answer.strip())


def math_verify(completion: str, answer: str) -> float:
    """Mathematical equivalence via the `math-verify` package (e.g. "0.5" == "1/2")."""
    from math_verify import parse, verify

    gold, pred = parse(answer), parse(completion)
    return float(bool(gold) and bool(pred) and verify(gold, pred))


REWARDS: dict[str, Callable[[str, str], float]] = {"exact_match": exact_match, "math_verify": math_verify}
