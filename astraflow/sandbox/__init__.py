"""Running generated code: a separate process in its own namespaces, unprivileged, limited.

Every run is `unshare --net --mount --pid --ipc --fork --kill-child --mount-proc` around
`astraflow.sandbox.inner`, which (still root, but in the new namespaces) mounts a size-capped
tmpfs over /run (root's only), /tmp, /var/tmp and /dev/shm and an empty read-only tmpfs over
every hidden path (the run directory: the secret is not there to read), sets rlimits on CPU
time, address space, file size, processes and open files, empties the capability bounding
set, drops to an unprivileged uid with no groups, sets no_new_privs, loads a seccomp filter
(`seccomp.py`) and execs `python -I -S -c SOURCE` in `/tmp/work`. So:
- no network: a new network namespace has only a loopback interface, and it is down;
- no writes that outlive it: the uid owns nothing on the host, and the host's world-writable
  directories (/tmp, /var/tmp, /dev/shm, /run/lock) are covered by tmpfs mounts that
  disappear with the mount namespace, whatever the code did;
- no IPC that outlives it: SysV shared memory, semaphores and message queues and POSIX
  message queues live in its own IPC namespace, destroyed with it;
- no privileges to regain: no capabilities, none in the bounding set, execve of a setuid or
  file-capability binary grants nothing (no_new_privs), and the filter refuses new
  namespaces, mounts, ptrace, bpf, io_uring, keyrings and the like;
- no process outlives it: it is PID 1 of its own PID namespace; when it exits or the wall
  clock runs out, every process in the namespace is killed;
- output is capped: past `output_bytes` the run is killed and marked truncated.

Needs root (to create the namespaces and switch uid) and libseccomp; `Sandbox.check()` says
why it cannot run.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import signal
import sys
from dataclasses import asdict, dataclass, field

from astraflow.sandbox.seccomp import load_library


@dataclass(frozen=True)
class Limits:
    cpu_s: int = 2
    wall_s: float = 5.0
    memory_mb: int = 256
    file_mb: int = 1
    processes: int = 16
    open_files: int = 64
    output_bytes: int = 4096
    tmpfs_mb: int = 16


@dataclass
class Result:
    stdout: str
    stderr: str
    returncode: int
    timed_out: bool = False
    truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out and not self.truncated


def world_executable(path: str) -> bool:
    """Whether a uid that owns nothing can execute `path` (every directory on the way o+x)."""
    real = os.path.realpath(path)
    parts = [real] + [p for p in (os.path.dirname(real),) for p in _parents(p)]
    return all(os.path.exists(p) and os.stat(p).st_mode & 0o001 for p in parts)


def _parents(path: str) -> list[str]:
    out = [path]
    while path != "/":
        path = os.path.dirname(path)
        out.append(path)
    return out


def sandbox_python() -> str | None:
    """An interpreter the sandbox uid can run: this one if it can, else the system's."""
    for candidate in (sys.executable, "/usr/local/bin/python3", "/usr/bin/python3"):
        if os.path.exists(candidate) and world_executable(candidate):
            return os.path.realpath(candidate)
    return None


UID_BASE = 200_000  # sandbox uids: no passwd entry, owning no file on the host
_slots = itertools.count()
_hidden_everywhere: set[str] = set()


def hide_in_every_sandbox(path: str) -> None:
    """Make `path` invisible inside every sandbox this process runs from now on, whoever builds
    it: a rollout worker hides its run directory (the run secret) once at start, and then a
    reward function or workflow that builds its own `Sandbox()` cannot forget to."""
    _hidden_everywhere.add(os.path.realpath(path))


@dataclass
class Sandbox:
    limits: Limits = field(default_factory=Limits)
    hide: tuple[str, ...] = ()  # paths made invisible inside, besides those hidden in every sandbox

    @staticmethod
    def check() -> str | None:
        """None when sandboxes can run here, else why not."""
        if os.geteuid() != 0:
            return "the sandbox needs root to create namespaces and switch to an unprivileged uid"
        if shutil.which("unshare") is None:
            return "the sandbox needs util-linux `unshare`"
        lib = load_library()
        if isinstance(lib, str):
            return lib
        if sandbox_python() is None:
            return ("no Python interpreter that an unprivileged uid may execute (this one lives under a "
                    "private directory); install the system python3")
        return None

    def _uid(self) -> int:
        # one uid per run, so that RLIMIT_NPROC (counted per uid) is this run's alone
        return UID_BASE + (os.getpid() * 4096 + next(_slots)) % 1_000_000

    async def run_python(self, source: str) -> Result:
        spec = {"limits": asdict(self.limits), "hide": sorted(_hidden_everywhere.union(self.hide)), "uid": self._uid(), "python": sandbox_python()}
        proc = await asyncio.create_subprocess_exec(
            "unshare", "--net", "--mount", "--pid", "--ipc", "--fork", "--kill-child", "--mount-proc",
            # not -I: it ignores PYTHONPATH, and the setup must come from this very package
            # (a checkout run with PYTHONPATH, or a second checkout beside an installed one);
            # the environment is this one, built here, and -s -P keep out user site and cwd
            sys.executable, "-s", "-P", "-m", "astraflow.sandbox.inner", json.dumps(spec),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            start_new_session=True, env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                                         "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})
        cap = self.limits.output_bytes
        out, err = bytearray(), bytearray()
        truncated = timed_out = False

        async def pump(stream: asyncio.StreamReader, buf: bytearray) -> None:
            # read to EOF even past the cap (discarding): a pipe left unread keeps its
            # transport open past the event loop, which then warns "Event loop is closed"
            nonlocal truncated
            while chunk := await stream.read(4096):
                if truncated:
                    continue
                buf += chunk
                if len(buf) > cap:
                    truncated = True
                    del buf[cap:]
                    self._kill(proc)

        proc.stdin.write(source.encode())
        proc.stdin.close()
        pumps = asyncio.gather(pump(proc.stdout, out), pump(proc.stderr, err))
        try:
            await asyncio.wait_for(proc.wait(), self.limits.wall_s)
        except asyncio.TimeoutError:
            timed_out = True
            self._kill(proc)
        try:  # the namespace's processes are all dead once PID 1 is, so EOF follows at once
            await asyncio.wait_for(pumps, 2.0)
        except asyncio.TimeoutError:
            pass
        code = await proc.wait()
        return Result(out.decode(errors="replace"), err.decode(errors="replace"), code, timed_out, truncated)

    @staticmethod
    def _kill(proc: asyncio.subprocess.Process) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # unshare and its child: the PID namespace dies with it
        except ProcessLookupError:
            pass
