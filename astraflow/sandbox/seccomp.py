"""The sandbox's seccomp filter, built with libseccomp through ctypes (no Python binding needed:
`libseccomp.so.2` ships with every systemd or apt based system).

A deny list on top of the other confinements (no capabilities, no_new_privs, namespaces): what
an unprivileged process may still do that a tool's code never needs and that is the usual
road to a kernel exploit or out of the namespaces. Refused with EPERM: creating or entering
namespaces (`unshare`, `setns`, `clone` with a CLONE_NEW* flag), mounting (old and new mount
API), `ptrace` and cross-process memory access, `bpf`, `perf_event_open`, `userfaultfd`,
`io_uring`, the kernel keyring, handle-based opens, module loading, kexec, reboot, swap,
`acct`, `quotactl`, `syslog`. `clone3` answers ENOSYS: its flags sit in a struct a filter
cannot read, and libc then falls back to `clone`, whose flags are checked. A syscall of
another architecture (i386 or x32 entry points) kills the process (libseccomp's default).
Loading needs no_new_privs (or CAP_SYS_ADMIN) first.
"""
from __future__ import annotations

import ctypes
import errno

LIBRARY = "libseccomp.so.2"
ACT_ALLOW = 0x7FFF0000
CMP_MASKED_EQ = 7
# CLONE_NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWCGROUP (NEWTIME exists only for
# unshare and clone3: in clone's flags its bit is part of the exit signal)
NAMESPACE_FLAGS = (0x00020000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x02000000)
DENIED = ("unshare", "setns", "mount", "umount", "umount2", "pivot_root", "chroot", "fsopen", "fsconfig", "fsmount",
          "fspick", "move_mount", "open_tree", "mount_setattr", "ptrace", "process_vm_readv", "process_vm_writev",
          "kcmp", "pidfd_getfd", "bpf", "perf_event_open", "userfaultfd", "io_uring_setup", "io_uring_enter",
          "io_uring_register", "keyctl", "add_key", "request_key", "open_by_handle_at", "name_to_handle_at",
          "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load", "reboot", "swapon",
          "swapoff", "acct", "quotactl", "quotactl_fd", "syslog", "lookup_dcookie", "uselib", "vhangup")


class ArgCmp(ctypes.Structure):
    """`struct scmp_arg_cmp`."""
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def load_library() -> ctypes.CDLL | str:
    """libseccomp, or why it cannot be used."""
    try:
        lib = ctypes.CDLL(LIBRARY, use_errno=True)
    except OSError as e:
        return f"the sandbox needs libseccomp ({LIBRARY}; Debian/Ubuntu: libseccomp2): {e}"
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    return lib


def act_errno(code: int) -> int:
    return 0x00050000 | code


def install_filter() -> None:
    """Load the filter into this process (inherited by everything it execs and forks)."""
    lib = load_library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    ctx = lib.seccomp_init(ACT_ALLOW)
    if not ctx:
        raise RuntimeError("seccomp_init failed")
    try:
        def rule(action: int, name: str, *cmps: ArgCmp) -> None:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr < 0:  # not a syscall of this architecture or kernel headers (umount on x86_64)
                return
            array = (ArgCmp * max(1, len(cmps)))(*cmps)
            rc = lib.seccomp_rule_add_array(ctx, action, nr, len(cmps), array)
            if rc < 0:
                raise RuntimeError(f"seccomp rule for {name}: {errno.errorcode.get(-rc, rc)}")

        for name in DENIED:
            rule(act_errno(errno.EPERM), name)
        for flag in NAMESPACE_FLAGS:  # rules on one syscall are alternatives: any such flag set
            rule(act_errno(errno.EPERM), "clone", ArgCmp(0, CMP_MASKED_EQ, flag, flag))
        rule(act_errno(errno.ENOSYS), "clone3")
        rc = lib.seccomp_load(ctx)
        if rc < 0:
            raise RuntimeError(f"seccomp_load: {errno.errorcode.get(-rc, rc)}")
    finally:
        lib.seccomp_release(ctx)
