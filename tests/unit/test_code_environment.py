"""The code environment: generated problems whose reference bodies pass their hidden tests;
grading in the real sandbox (a right solution scores 1, a partly right one the fraction it
passes, hostile ones 0 with a named reason and within the limits, never an exception); the
`code` workflow end to end is in tests/integration/test_code_run.py. Real namespaces: without root
the sandbox tests skip (and fail under CI=true, `tests/ci_skips.py`)."""
from __future__ import annotations

import asyncio
import time

import pytest

from astraflow.config.loader import load_config
from astraflow.config.schema import TaskSourceConfig
from astraflow.launch.inputs import check_inputs
from astraflow.sandbox import Sandbox
from astraflow.tasks.code_problems import TEMPLATES, code_problems, problem
from astraflow.workflows.grading import LIMITS, Grader, grade, solution_code
from astraflow.workflows.rewards import Scorer

needs_sandbox = pytest.mark.skipif(Sandbox.check() is not None, reason=str(Sandbox.check()))
PLUS3 = problem(0, 3)  # "Return x plus 3."
TESTS = PLUS3.row["tests"]


def test_every_reference_solution_passes_its_tests_and_prompts_are_distinct():
    items = list(code_problems(TaskSourceConfig(kind="code_problems", max_operand=20)))
    assert len(items) == len(TEMPLATES) * 20 and len({i.prompt for i in items}) == len(items)
    for item in items:  # our own reference code, run here: the sandboxed path is tested below
        ns: dict = {}
        exec(item.row["prefix"] + item.answer, ns)
        for test in item.row["tests"]:
            exec(test, ns)
        assert len(item.row["tests"]) >= 4


HOSTILE = {
    "fork bomb": ("import os\nwhile True:\n    os.fork()\n", "BlockingIOError"),
    "infinite loop at import": ("while True:\n    pass\n", "time limit"),
    "infinite loop in the function": (PLUS3.prompt + "while True: pass", "time limit"),
    "huge allocation": ("x = bytearray(1 << 34)\n", "MemoryError"),
    "write outside its directory": ("open('/var/lib/astraflow-escape', 'w').write('x')\n", "PermissionError"),
    "network": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=2)\n", "Network is unreachable"),
    "exit before the tests": ("import os\nos._exit(0)\n", "exited with status 0"),
    "flood the output": ("import os\nwhile True:\n    os.write(1, b'x' * 65536)\n", "output limit"),
    # the sandbox's CPU limit, or its wall clock first when other runs hold the cores
    "ignore the time limit": ("import signal\nsignal.signal(signal.SIGALRM, signal.SIG_IGN)\nwhile True:\n    pass\n",
                              ("cpu time limit", "wall-clock limit")),
}


@needs_sandbox
def test_hostile_solutions_score_zero_with_a_named_reason_within_the_limits():
    async def all_of_them() -> list[tuple[float, object]]:
        sandbox = Sandbox(LIMITS)

        async def timed(source: str) -> tuple[float, object]:
            t0 = time.monotonic()
            return (await grade(sandbox, source, TESTS)), time.monotonic() - t0

        return await asyncio.gather(*(timed(source) for source, _ in HOSTILE.values()))

    results = asyncio.run(all_of_them())
    for (name, (_, reason)), (result, took) in zip(HOSTILE.items(), results):
        named = reason if isinstance(reason, tuple) else (reason,)
        assert result.fraction == 0.0 and any(n in (result.reason or "") for n in named), (name, result.reason)
        assert took < LIMITS.wall_s + 4, (name, took)


@needs_sandbox
@pytest.mark.parametrize("body, fraction", [("return x + 3", 1.0),
                                            ("return x + 3 if x < 3 else 2 * x", 3 / 4),  # wrong only for f(10)
                                            ("return x + 2", 0.0),
                                            # exits 0 at import: one sandboxed run per test, judged
                                            # by its exit status, scored this 1.0
                                            ("import os\nos._exit(0)", 0.0),
                                            ("return x +", 0.0)])
def test_the_reward_is_the_fraction_of_tests_that_pass(body, fraction):
    assert TESTS == ["assert f(0) == 3", "assert f(1) == 4", "assert f(3) == 6", "assert f(10) == 13"]
    scorer = Scorer("code_tests", 30.0)
    assert asyncio.run(scorer(body, PLUS3.answer, PLUS3.row)) == pytest.approx(fraction)
    assert not scorer.failures


@needs_sandbox
def test_a_failure_names_its_test_and_the_grader_grades_a_repeat_once():
    async def run() -> tuple:
        grader = Grader(Sandbox(LIMITS))
        code_text = solution_code("return x + 2", PLUS3.row["prefix"])
        first, again = await asyncio.gather(grader(code_text, TESTS), grader(code_text, TESTS))
        return first, again, len(grader.memo)

    first, again, remembered = asyncio.run(run())
    assert first is again and remembered == 1
    assert first.reason == "assert f(0) == 3: AssertionError" and first.passed == 0


def test_a_fenced_block_is_the_solution_and_a_bare_body_follows_the_prefix():
    assert solution_code("Here:\n```python\ndef f(x):\n    return 1\n```\n", "PREFIX") == "def f(x):\n    return 1\n"
    assert solution_code("return 1", "def f(x):\n    ") == "def f(x):\n    return 1"


@needs_sandbox
def test_the_code_config_checks_out():
    cfg = load_config("configs/code.yaml")
    check_inputs(cfg)
    assert cfg.tasks.workflow == "code" and cfg.tasks.reward == "code_tests"


@needs_sandbox
def test_the_grader_runs_at_most_parallel_sandboxes_at_once():
    """Eight solutions that each sleep 0.5 s, two at a time: four rounds, at least 2 s (all at
    once: 1.3 s here)."""
    async def run() -> float:
        grader = Grader(Sandbox(LIMITS), parallel=2)
        t0 = time.monotonic()
        await asyncio.gather(*(grader(f"import time\ntime.sleep(0.5)\nn = {i}\n", ["assert True"]) for i in range(8)))
        return time.monotonic() - t0

    assert asyncio.run(run()) >= 2.0
