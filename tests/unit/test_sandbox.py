"""The tool sandbox: limits on time, memory, processes, output; no network; no writes outside
its directory; the run directory invisible. Real namespaces (root needed: without it they
skip, and under CI=true fail, `tests/ci_skips.py`)."""
from __future__ import annotations

import asyncio
import ctypes
import os
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from astraflow.sandbox import Limits, Result, Sandbox

why_not = Sandbox.check()
if why_not:
    pytest.skip(why_not, allow_module_level=True)


LIBC = ctypes.CDLL(None, use_errno=True)


def host_shm_keys() -> set[int]:
    """The keys of the host's SysV shared-memory segments."""
    return {int(line.split()[0]) for line in Path("/proc/sysvipc/shm").read_text().splitlines()[1:]}


def run(source: str, hide: tuple[str, ...] = (), **limits) -> Result:
    return asyncio.run(Sandbox(Limits(**{"wall_s": 10.0, **limits}), hide=hide).run_python(source))


def test_runs_code_as_an_unprivileged_uid_in_a_temporary_directory():
    r = run("import os; print(os.getuid(), os.getcwd()); open('scratch', 'w').write('x')")
    uid, cwd = r.stdout.split()
    assert r.ok and int(uid) >= 200_000 and cwd == "/tmp/work"


def test_cpu_time_limit_stops_an_infinite_loop():
    t0 = time.monotonic()
    r = run("while True: pass", cpu_s=1)
    assert not r.ok and time.monotonic() - t0 < 5


def test_wall_clock_limit_stops_a_sleeper():
    r = run("import time; time.sleep(60)", wall_s=1.0)
    assert r.timed_out


def test_memory_limit():
    r = run("x = bytearray(1 << 30)", memory_mb=128)
    assert not r.ok and "MemoryError" in r.stderr


def test_process_limit_stops_a_fork_bomb():
    t0 = time.monotonic()
    r = run("import os\nwhile True:\n    os.fork()", processes=8)
    assert not r.ok and time.monotonic() - t0 < 10


def test_output_is_capped():
    r = run("print('x' * 1_000_000)", output_bytes=1000)
    assert r.truncated and len(r.stdout) == 1000


def test_no_network_not_even_loopback():
    for host in ("1.1.1.1", "127.0.0.1"):
        r = run(f"import socket; socket.create_connection(('{host}', 80), timeout=2)")
        assert not r.ok and "Network is unreachable" in r.stderr, r.stderr


def test_no_writes_outside_its_directory(tmp_path):
    os.chmod(tmp_path, 0o777)  # even a world-writable directory outside: /tmp is its own tmpfs
    r = run(f"open('{tmp_path}/escaped', 'w').write('x')")
    assert not r.ok and not (tmp_path / "escaped").exists()
    r = run("open('/tmp/left-behind', 'w').write('x')")
    assert r.ok and not os.path.exists("/tmp/left-behind")


@pytest.fixture
def run_dir():
    """A run directory with its secret, outside /tmp (the sandbox has its own; a checkout may
    live there) and readable by anyone on the host: only hiding keeps the secret out of reach."""
    path = Path(tempfile.mkdtemp(prefix="astraflow-sandbox-test-", dir="/var/lib"))
    os.chmod(path, 0o755)
    (path / "secret").write_text("s3cret")
    os.chmod(path / "secret", 0o644)
    yield path
    shutil.rmtree(path)


def test_hidden_run_directory_and_its_secret_are_not_there(run_dir):
    read = f"print(open('{run_dir}/secret').read())"
    assert run(read).stdout.strip() == "s3cret"  # the control: visible when not hidden
    r = run(read, hide=(str(run_dir),))
    assert not r.ok and "s3cret" not in r.stdout and "FileNotFoundError" in r.stderr


def test_a_reward_functions_own_sandbox_hides_what_the_worker_hides(run_dir, monkeypatch):
    """`code_tests` builds its own `Sandbox(LIMITS)`: it used to see the run directory a worker's
    tool sandbox hid, secret included. A worker now hides its run directory in every sandbox."""
    from astraflow import sandbox
    from astraflow.workflows.rewards import code_tests

    monkeypatch.setattr(sandbox, "_hidden_everywhere", set())
    completion = f"```python\ndef leak():\n    return open('{run_dir}/secret').read()\n```"
    row = {"tests": ["assert leak() == 's3cret'"]}
    assert asyncio.run(code_tests(completion, "", row)) == 1.0  # the control: readable when not hidden
    sandbox.hide_in_every_sandbox(str(run_dir))
    assert asyncio.run(code_tests(completion, "", row)) == 0.0


def test_nothing_written_to_world_writable_host_directories_persists():
    """/run/lock was not covered: a file written there stayed on the host."""
    name = f"astraflow-sandbox-test-{uuid.uuid4().hex}"
    dirs = ("/run/lock", "/run", "/tmp", "/var/tmp", "/dev/shm")
    try:
        r = run(f"for d in {dirs!r}:\n"
                f"    try:\n        open(d + '/{name}', 'w').write('x'); print('wrote', d)\n"
                f"    except OSError as e:\n        print('refused', d, e.strerror)")
        assert r.ok and "wrote /tmp" in r.stdout, r.stdout + r.stderr
        assert [d for d in dirs if os.path.exists(f"{d}/{name}")] == []
    finally:
        for d in dirs:
            Path(f"{d}/{name}").unlink(missing_ok=True)


def test_sysv_shared_memory_does_not_outlive_the_sandbox():
    key = random.randrange(1 << 20, 1 << 30)
    try:
        r = run(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                f"print(libc.shmget({key}, 4096, 0o1666))")  # IPC_CREAT | 0666
        assert r.ok and int(r.stdout) >= 0, r.stdout + r.stderr  # created inside
        assert key not in host_shm_keys()
    finally:
        shmid = LIBC.shmget(key, 0, 0)
        if shmid >= 0:
            LIBC.shmctl(shmid, 0, None)  # IPC_RMID: what the sandbox left on the host


def test_no_new_privileges_no_capabilities_and_a_seccomp_filter():
    r = run("print(open('/proc/self/status').read())")
    status = dict(line.split(":\t", 1) for line in r.stdout.splitlines() if ":\t" in line)
    assert status["NoNewPrivs"].strip() == "1", status
    for caps in ("CapBnd", "CapEff", "CapPrm", "CapInh", "CapAmb"):
        assert int(status[caps], 16) == 0, (caps, status[caps])
    assert status["Seccomp"].strip() == "2", status  # filter mode


def test_the_filter_refuses_new_namespaces_and_ptrace_but_not_processes_and_threads():
    r = run("import ctypes, subprocess, threading\n"
            "libc = ctypes.CDLL(None, use_errno=True)\n"
            "for name, call in (('unshare', lambda: libc.unshare(0x10000000)),"  # CLONE_NEWUSER
            " ('ptrace', lambda: libc.ptrace(0, 0, None, None))):\n"  # PTRACE_TRACEME
            "    print(name, call(), ctypes.get_errno())\n"
            "t = threading.Thread(target=print, args=('thread',)); t.start(); t.join()\n"
            "print(subprocess.run(['/bin/echo', 'child'], capture_output=True, text=True).stdout.strip())")
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:4] == ["unshare -1 1", "ptrace -1 1", "thread", "child"], r.stdout  # 1: EPERM
