"""Supervised child processes: the local launcher's executor.

A `Component` is a named command with a log file. The supervisor starts it, notices when it
exits, restarts it with exponential backoff (a group — the ranks of one trainer — is
restarted as a whole, because a torch.distributed group that lost a rank cannot continue),
and gives up after `max_restarts`, naming the component and its log. `stop()` sends SIGTERM,
waits, then SIGKILLs what is left.

Each component process leads its own session and process group, and once it has exited
whatever is left in its group is killed: a child it started is not adopted by init and left
running (vLLM's engine-core process outlived a SIGKILLed rollout worker indefinitely,
holding its memory, while the restarted worker started another).

A group whose ranks live under different supervisors (a trainer spread over the nodes of a
Slurm job) shares a `GroupGeneration` in the run directory instead: the first supervisor to
see a rank fail advances it, every supervisor restarts its rank when it moves, and the ranks
rendezvous afresh under the new generation (`ASTRAFLOW_START`).
"""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)


# Exit status of a component that stopped on a signal (SIGTERM, Slurm's SIGUSR1 warning)
# after saving its state: not finished, not failed (EX_TEMPFAIL).
EXIT_STOPPED = 75


PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """In the child before exec: SIGTERM when the supervisor dies, even by SIGKILL. Without it
    a killed launcher left its dataflow rank and workers running (found by a chaos test that
    timed out: two workers and a rank ate a core and a half for an hour)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class ComponentFailed(RuntimeError):
    pass


START_MARK = "--- start "  # the line the supervisor writes into a log before each start
TAIL_LINES = 8


def last_error(log: Path, lines: int = TAIL_LINES) -> str:
    """The component's own last error, to quote in a message: up to `lines` lines of its log's
    last start, ending at the last line that looks like an error (a traceback ends with one),
    else the last lines; "" when the log is empty or unreadable."""
    try:
        text = log.read_text(errors="replace").splitlines()[-500:]
    except OSError:
        return ""
    starts = [i for i, line in enumerate(text) if line.startswith(START_MARK)]
    text = [line for line in text[starts[-1] + 1 if starts else 0:] if line.strip()]
    errors = [i for i, line in enumerate(text) if "Error" in line or "ERROR" in line or "error:" in line]
    end = errors[-1] + 1 if errors else len(text)
    return "\n".join("    " + line.rstrip()[-300:] for line in text[max(0, end - lines):end])


def log_ending(log: Path) -> str:
    """`last_error` as the end of a message: "; its log ends:" and the lines, or ""."""
    cause = last_error(log)
    return f"; its log ends:\n{cause}" if cause else ""


class GroupGeneration:
    """A restart counter shared through a directory: files `<name>.gen<N>`, created exclusively."""

    def __init__(self, directory: Path, name: str) -> None:
        self.directory, self.name = directory, name

    def current(self) -> int:
        gens = [int(p.name.rsplit(".gen", 1)[1]) for p in self.directory.glob(f"{self.name}.gen*")]
        return max(gens, default=0)

    def advance(self, seen: int) -> int:
        """Move past generation `seen` (once, whoever asks first); returns the current one."""
        try:
            os.close(os.open(self.directory / f"{self.name}.gen{seen + 1}", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            pass
        return self.current()


@dataclass
class Component:
    name: str
    commands: list[list[str]]  # one per process of the group (e.g. trainer ranks)
    log_dir: Path
    env: list[dict[str, str]] = field(default_factory=list)
    generation: GroupGeneration | None = None  # shared with ranks under other supervisors
    restarts: int = 0
    started_gen: int = 0
    procs: list[subprocess.Popen] = field(default_factory=list)
    next_start: float = 0.0
    done: bool = False  # exited 0 on its own: finished its work

    @property
    def log_path(self) -> Path:
        return self.log_dir / f"{self.name}.log"


class Supervisor:
    def __init__(self, max_restarts: int, backoff_s: float) -> None:
        self.max_restarts = max_restarts
        self.backoff_s = backoff_s
        self.components: dict[str, Component] = {}

    def add(self, comp: Component) -> Component:
        self.components[comp.name] = comp
        self._start(comp)
        return comp

    def _start(self, comp: Component) -> None:
        try:
            log_file = open(comp.log_path, "a")
            log_file.write(f"{START_MARK}{comp.name} (restart {comp.restarts}) at {time.ctime()}\n")
            log_file.flush()
        except OSError as e:  # a full or failing disk: say so instead of dying with a traceback
            raise ComponentFailed(f"cannot start {comp.name}: writing its log {comp.log_path} failed ({e})"
                                  f"{log_ending(comp.log_path)}") from None
        comp.procs = []
        comp.started_gen = comp.generation.current() if comp.generation else comp.restarts
        for i, cmd in enumerate(comp.commands):
            # ASTRAFLOW_START numbers the group's starts: a restarted group rendezvouses afresh
            env = {**os.environ, **(comp.env[i] if i < len(comp.env) else {}), "ASTRAFLOW_START": str(comp.started_gen)}
            comp.procs.append(subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env,
                                               start_new_session=True, preexec_fn=die_with_parent))
        log_file.close()

    def poll(self) -> list[str]:
        """Check every component; restart the crashed ones. Returns names that finished (exit 0)."""
        finished = []
        now = time.monotonic()
        for comp in self.components.values():
            if comp.done:
                continue
            if not comp.procs:  # waiting out its backoff
                if now >= comp.next_start:
                    self._start(comp)
                continue
            codes = [p.poll() for p in comp.procs]
            if all(c == 0 for c in codes):
                for p in comp.procs:
                    kill_leftovers(p)
                comp.done = True
                finished.append(comp.name)
                continue
            moved = comp.generation is not None and comp.generation.current() > comp.started_gen
            if moved or any(c not in (None, 0) for c in codes):
                if comp.generation is not None:
                    comp.generation.advance(comp.started_gen)
                self._terminate(comp.procs)
                comp.procs = []
                comp.restarts += 1
                if comp.restarts > self.max_restarts:
                    raise ComponentFailed(f"{comp.name} failed {comp.restarts} times (exit codes {codes}), "
                                          f"see {comp.log_path}{log_ending(comp.log_path)}")
                delay = self.backoff_s * 2 ** (comp.restarts - 1)
                comp.next_start = now + delay
                log.warning("%s exited with %s; restart %d/%d in %.1fs (log: %s)", comp.name, codes,
                            comp.restarts, self.max_restarts, delay, comp.log_path)
        return finished

    def check_starting(self, name: str) -> None:
        """Raise `ComponentFailed` quoting its log if `name` has exited while the launcher waits
        for it to come up (the dataflow rank's address): a component that cannot start (a bad
        input, a port in use) is reported at once with its own error, not after a timeout."""
        comp = self.components[name]
        codes = [p.poll() for p in comp.procs]
        if any(c is not None for c in codes):
            raise ComponentFailed(f"{name} exited while starting (exit codes {codes}), see {comp.log_path}"
                                  f"{log_ending(comp.log_path)}")

    def stop(self, names: list[str] | None = None, timeout_s: float = 10.0) -> None:
        """Stop the named components (an empty list: none), or all of them."""
        comps = [self.components[n] for n in names] if names is not None else list(self.components.values())
        # the components not done: running, or exited unnoticed (their leftovers must go too)
        procs = [p for c in comps if not c.done for p in c.procs]
        self._terminate(procs, timeout_s)
        for c in comps:
            c.done = True

    @staticmethod
    def _terminate(procs: list[subprocess.Popen], timeout_s: float = 10.0) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            kill_leftovers(p)


def kill_leftovers(p: subprocess.Popen) -> None:
    """SIGKILL what remains of an exited component's process group (its pgid is its pid: a
    group id is not reused while the group has members)."""
    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass  # nothing left
