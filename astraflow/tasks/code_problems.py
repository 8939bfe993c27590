"""`code_problems`: small Python problems with hidden unit tests, generated from templates.

Each problem is a one-argument function `f(x)` whose docstring states what it returns in
terms of x and a constant k in [1, max_operand] ("Return x plus 7."). The prompt is the
signature and the docstring, ending where the body starts (`PROMPT`), so a completion is the
body alone ("return x + 7"); the worked solution is that body. The row carries the hidden
tests (`tests`: assert statements over fixed inputs, among them the edge values 0 and k)
and the code a completion is appended to before it is tested (`prefix`: the prompt), which
the `code_tests` reward and the `code` workflow read. Every template's reference body passes
all of its tests (checked by tests/unit/test_code_environment.py); a near miss (the wrong
constant, the wrong operator) passes some of them, so partial credit exists.

Seeded and finite: TEMPLATES x max_operand problems (11 x 20 = 220 by default).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from astraflow.config.schema import TaskSourceConfig
from astraflow.tasks.generators import ItemRows

if TYPE_CHECKING:
    from astraflow.tasks.sources import Item

PROMPT = 'def f(x):\n    """{doc}"""\n    '
INPUTS = (0, 1, 3, 10)  # with k itself: the hidden tests' arguments

# (docstring, reference body, the function it computes); {k} is the constant
TEMPLATES: tuple[tuple[str, str, Callable[[int, int], object]], ...] = (
    ("Return x plus {k}.", "return x + {k}", lambda x, k: x + k),
    ("Return x minus {k}.", "return x - {k}", lambda x, k: x - k),
    ("Return x times {k}.", "return x * {k}", lambda x, k: x * k),
    ("Return {k} minus x.", "return {k} - x", lambda x, k: k - x),
    ("Return the remainder of x divided by {k}.", "return x % {k}", lambda x, k: x % k),
    ("Return x divided by {k}, rounded down.", "return x // {k}", lambda x, k: x // k),
    ("Return the larger of x and {k}.", "return max(x, {k})", lambda x, k: max(x, k)),
    ("Return the smaller of x and {k}.", "return min(x, {k})", lambda x, k: min(x, k)),
    ("Return True if x is greater than {k}.", "return x > {k}", lambda x, k: x > k),
    ("Return True if x equals {k}.", "return x == {k}", lambda x, k: x == k),
    ("Return a list of x copies of {k}.", "return [{k}] * x", lambda x, k: [k] * x),
)


def problem(template: int, k: int) -> "Item":
    from astraflow.tasks.sources import Item

    doc, body, fn = TEMPLATES[template]
    prompt = PROMPT.format(doc=doc.format(k=k))
    tests = [f"assert f({x}) == {fn(x, k)!r}" for x in sorted({*INPUTS, k})]
    return Item(prompt, body.format(k=k), row={"tests": tests, "prefix": prompt})


def code_problems(cfg: TaskSourceConfig) -> ItemRows:
    return ItemRows([problem(t, k) for t in range(len(TEMPLATES)) for k in range(1, max(1, cfg.max_operand) + 1)])
