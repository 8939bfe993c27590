"""Inside the sandbox's namespaces, as root: mounts, limits, drop privileges, exec the code.

In this order, each step needing what the next one takes away: tmpfs mounts (the `mount`
binary needs its capabilities), rlimits, the capability bounding set emptied (needs
CAP_SETPCAP), the switch to the sandbox uid, no_new_privs, the seccomp filter (refuses
`mount` among others), exec.

Run only by `astraflow.sandbox.Sandbox` as the child of `unshare` (argv[1]: JSON spec, stdin:
the source). Anything that fails here exits 125 before the code runs.
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys

from astraflow.sandbox.confine import drop_bounding_set, no_new_privs
from astraflow.sandbox.seccomp import install_filter

MB = 1 << 20
# /run first: /dev/shm may be a link into it. /run is the sandbox's own and empty, writable by
# root only (the host's /run/lock is world-writable and kept what was written there).
PRIVATE = (("/run", "0755"), ("/tmp", "1777"), ("/var/tmp", "1777"), ("/dev/shm", "1777"))


def mount_tmpfs(path: str, size_mb: float, mode: str = "1777", readonly: bool = False) -> None:
    opts = f"size={max(1, int(size_mb * 1024))}k,mode={mode},nosuid,nodev" + (",ro" if readonly else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], check=True)


def main() -> None:
    spec = json.loads(sys.argv[1])
    limits, uid = spec["limits"], spec["uid"]
    source = sys.stdin.read()
    for path, mode in PRIVATE:
        if os.path.isdir(path):
            mount_tmpfs(path, limits["tmpfs_mb"], mode)
    for path in spec["hide"]:
        if os.path.isdir(path):
            mount_tmpfs(path, 0.004, mode="0755", readonly=True)
    work = "/tmp/work"
    os.mkdir(work, 0o700)
    os.chown(work, uid, uid)
    for res, value in ((resource.RLIMIT_CPU, limits["cpu_s"]), (resource.RLIMIT_AS, limits["memory_mb"] * MB),
                       (resource.RLIMIT_FSIZE, limits["file_mb"] * MB), (resource.RLIMIT_NPROC, limits["processes"]),
                       (resource.RLIMIT_NOFILE, limits["open_files"]), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(res, (value, value))
    drop_bounding_set()
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)
    no_new_privs()
    install_filter()
    os.chdir(work)
    os.execve(spec["python"], [spec["python"], "-I", "-S", "-c", source],
              {"PATH": "/usr/bin:/bin", "HOME": work, "LANG": "C.UTF-8"})


if __name__ == "__main__":
    try:
        main()
    except Exception as e:  # noqa: BLE001 - report and exit: the code never ran
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        sys.exit(125)
