"""Grading generated code against hidden unit tests in the sandbox: one sandboxed process per
solution, all of its tests inside it.

The process runs a harness (`HARNESS`): it executes the solution, then each test (an assert
statement) in the solution's namespace, each under its own time limit (an interval timer;
the sandbox's CPU, wall-clock, memory and process limits hold for the whole run), and writes
one result line tagged with a fresh random marker: per test, None (passed) or why it failed.
So:
- one process start (~0.12 s of CPU here) per solution, not one per test;
- a solution that fails to run (syntax error, an exception at import, a refused syscall)
  fails every test with that reason; a test that raises, fails or runs past its limit fails
  alone, and the others still run;
- a solution cannot pass by exiting early: after `os._exit(0)` there is no result line, so
  no test passed and the run's end is the reason (`sys.exit()` is a SystemExit, caught like
  any exception); its processes' own copies of the harness (a fork) never write results
  (they exit where the harness resumes);
- what the solution prints goes to /dev/null, not into the result;
- a run the sandbox stops (wall clock, output cap, a signal such as SIGXCPU or SIGKILL) fails
  every test with that limit's name.
The marker is in the harness's source, which the solution could read (/proc/self/cmdline)
to forge a result: grading guards the host against hostile code, not the reward against a
policy that learns to attack this harness.

`Grade.reason` names the first failure, e.g. "assert f(0) == 3: AssertionError" or "solution:
MemoryError", the text a multi-turn episode feeds back. Identical solutions to the same
tests are graded once (`Grader`, a bounded memo): a group's members often agree. A run a
limit stopped is not remembered (the wall clock counts a busy host), and a sandbox that
cannot start is the episode's `EpisodeError` (kind `tool`), not the worker's.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import signal
from collections import OrderedDict
from dataclasses import dataclass

from astraflow.sandbox import Limits, Result, Sandbox
from astraflow.workflows.api import EpisodeError

TEST_S = 1.0  # each test's (and the solution's own) time limit inside the harness
LIMITS = Limits(cpu_s=4, wall_s=8.0, memory_mb=256, output_bytes=16384)
REASON_CHARS = 160  # a failure's reason is cut to this (it goes back into a prompt)
MEMO = 4096  # graded (solution, tests) pairs remembered

HARNESS = r'''
import json, os, signal, sys
_pid, _out = os.getpid(), os.fdopen(os.dup(1), "w")
sys.stdout = sys.stderr = open(os.devnull, "w")
class _TimeLimit(BaseException):
    pass
def _alarm(signum, frame):
    raise _TimeLimit()
signal.signal(signal.SIGALRM, _alarm)
def _run(source, ns):
    signal.setitimer(signal.ITIMER_REAL, {test_s})
    try:
        exec(compile(source, "<solution>", "exec"), ns)
        return None
    except _TimeLimit:
        return "time limit ({test_s:g} s)"
    except BaseException as e:
        return (type(e).__name__ + ": " + str(e))[:{reason_chars}].rstrip(": ")
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if os.getpid() != _pid:
            os._exit(0)
_ns = {{"__name__": "__solution__"}}
_failed = _run({code!r}, _ns)
_results = [("solution: " + _failed) if _failed else _run(t, _ns) for t in {tests!r}]
_out.write({marker!r} + json.dumps(_results) + "\n")
_out.flush()
'''


@dataclass(frozen=True)
class Grade:
    results: tuple[str | None, ...]  # per test: None (passed) or why it failed
    tests: tuple[str, ...]

    @property
    def passed(self) -> int:
        return sum(r is None for r in self.results)

    @property
    def fraction(self) -> float:
        return self.passed / len(self.results) if self.results else 0.0

    @property
    def reason(self) -> str | None:
        """The first failure, with its test, or None when every test passed."""
        for test, why in zip(self.tests, self.results):
            if why is not None:
                text = why if why.startswith("solution:") or why.startswith("sandbox:") else f"{test}: {why}"
                return text[:REASON_CHARS]
        return None


def solution_code(completion: str, prefix: str = "") -> str:
    """The code a completion stands for: its last ```python block, else the prefix (the
    problem's signature) followed by the completion."""
    blocks = re.findall(r"```(?:python)?\n(.*?)```", completion, re.S)
    return blocks[-1] if blocks else prefix + completion


def stopped_because(result: Result) -> str:
    """Why a sandboxed run wrote no result line: the limit that stopped it, or how it ended."""
    if result.timed_out:
        return f"wall-clock limit ({LIMITS.wall_s:g} s)"
    if result.truncated:
        return f"output limit ({LIMITS.output_bytes} bytes)"
    if result.returncode == 125 and "sandbox setup failed" in result.stderr:
        return "sandbox setup failed: " + result.stderr.strip().splitlines()[-1][:REASON_CHARS]
    code = result.returncode
    sig = -code if code < 0 else code - 128 if code > 128 else 0
    # unshare passes its child's death by a signal on as its own; where it cannot (util-linux
    # 2.38 here), it says so on stderr and exits 1. The code cannot signal itself to death (it
    # is PID 1 of its namespace): the signal came from a limit, the CPU time's in practice.
    if sig or "unshare: sigprocmask" in result.stderr:
        name = signal.Signals(sig).name if sig in signal.Signals._value2member_map_ else "a signal"
        return {"SIGXCPU": f"cpu time limit ({LIMITS.cpu_s} s)", "SIGXFSZ": "file size limit"}.get(
            name, f"killed by {name} (the cpu time limit, {LIMITS.cpu_s} s, or the kernel)")
    return f"exited with status {code} before the tests finished"


async def grade(sandbox: Sandbox, code: str, tests: list[str]) -> Grade:
    """Run `code` and then each of `tests` in one sandboxed process (see the module docstring)."""
    if not tests:
        return Grade((), ())
    marker = f"@@grade-{secrets.token_hex(8)}@@"
    result = await sandbox.run_python(HARNESS.format(test_s=TEST_S, code=code, tests=list(tests), marker=marker,
                                                     reason_chars=REASON_CHARS))
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(marker):
            try:
                results = json.loads(line[len(marker):])
            except ValueError:
                break
            if isinstance(results, list) and len(results) == len(tests):
                return Grade(tuple(None if r is None else str(r)[:REASON_CHARS] for r in results), tuple(tests))
            break
    why = "sandbox: " + stopped_because(result)
    return Grade((why,) * len(tests), tuple(tests))


class Grader:
    """`grade` with a memo of recent (code, tests) pairs and the sandbox it runs in; grades of
    the same pair in flight at once share one run; at most `parallel` runs at once."""

    def __init__(self, sandbox: Sandbox, parallel: int = 0) -> None:
        self.sandbox = sandbox
        self.memo: OrderedDict[tuple[str, tuple[str, ...]], asyncio.Future] = OrderedDict()
        # sandboxed runs at once: one per core. Unbounded, a worker with 128 episodes in
        # flight started ~128 at a time (load average 45 on 2 cores): the engine and trainer
        # starved, and the runs' wall clocks, not their code, could fail them.
        self.slots = asyncio.Semaphore(parallel or os.cpu_count() or 2)

    async def _grade(self, code: str, tests: list[str]) -> Grade:
        async with self.slots:
            return await grade(self.sandbox, code, tests)

    async def __call__(self, code: str, tests: list[str]) -> Grade:
        key = (code, tuple(tests))
        future = self.memo.get(key)
        if future is None:
            future = self.memo[key] = asyncio.ensure_future(self._grade(code, tests))
            if len(self.memo) > MEMO:
                self.memo.popitem(last=False)
        else:
            self.memo.move_to_end(key)
        try:
            result = await asyncio.shield(future)
        except OSError as e:  # the sandbox could not start (no processes left, ...): the episode's loss
            self.memo.pop(key, None)  # a failure to run is not remembered
            raise EpisodeError(f"grading sandbox: {e}", kind="tool") from None
        if any(r is not None and r.startswith("sandbox:") for r in result.results):
            self.memo.pop(key, None)  # nor a run a limit stopped (the wall clock counts a busy host)
        return result
