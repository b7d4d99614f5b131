"""The submission's process at the ``process`` level, sealed as far as a process can seal itself
without namespaces, before its command starts (the review of issue 46, C17 and C18).

Without bubblewrap the submission's process ran as the grader's user, so code that got past the
rules could kill the grader (its parent: the whole batch lost), stop a neighbour's processes,
or write into their pipes and the grader's through ``/proc/PID/fd`` (a neighbour's grade
changed). Here, in the child, before its command is executed:

- whoever runs it, a seccomp filter refuses (EPERM) every signal, ``prlimit`` and ptrace-like
  call aimed at a process but itself or its own process group;
- run by root (a CI container, say), it keeps the user but loses every capability, for good
  (none left to it or to what it executes): an undumpable process (the grader at this level,
  the judge, every submission's process) is then out of its reach through ``/proc`` (their
  descriptors and memory), as from any other process of the same user, and it cannot raise its
  limits again. (Another user would do more, but the interpreter may live where only root can
  read, ``/root/.pyenv``.)

What it does not do: it runs as the grader's user, so that user's files are open to it (the
grader compares digests of its own after a batch); it can open the ``/proc`` files of that user's
dumpable processes, a neighbour's processes too in their first milliseconds, before they make
themselves undumpable; the filter is written for x86-64 and arm64 Linux, and elsewhere is not
installed (``apply`` says so on stderr). Under bubblewrap none of this is needed: the sandbox has
its own process ids.
"""

from __future__ import annotations

import ctypes
import os
import platform
import struct
import sys

PR_SET_DUMPABLE, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 4, 38, 22, 2
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, CAPABILITY_VERSION_3 = 24, 47, 4, 0x20080522
ALLOW, DENY = 0x7FFF0000, 0x00050000 | 1  # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
LOAD, JEQ, JGE, RET = 0x20, 0x15, 0x35, 0x06  # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_JMP|JGE|K, BPF_RET|K
X32 = 0x40000000  # x86-64's x32 system calls: the same architecture, other numbers

# Calls whose first argument names a process: allowed on this process or its own group only.
AIMED = ("kill", "tkill", "tgkill", "rt_sigqueueinfo", "rt_tgsigqueueinfo", "prlimit64")
# Calls that reach into another process's memory or descriptors: refused outright.
REFUSED = ("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_open", "pidfd_getfd", "pidfd_send_signal")
SYSCALLS = {  # machine: (AUDIT_ARCH_*, numbers)
    "x86_64": (0xC000003E, {"kill": 62, "tkill": 200, "tgkill": 234, "rt_sigqueueinfo": 129,
                            "rt_tgsigqueueinfo": 297, "prlimit64": 302, "ptrace": 101, "process_vm_readv": 310,
                            "process_vm_writev": 311, "pidfd_open": 434, "pidfd_getfd": 438,
                            "pidfd_send_signal": 424}),
    "aarch64": (0xC00000B7, {"kill": 129, "tkill": 130, "tgkill": 131, "rt_sigqueueinfo": 138,
                             "rt_tgsigqueueinfo": 240, "prlimit64": 261, "ptrace": 117, "process_vm_readv": 270,
                             "process_vm_writev": 271, "pidfd_open": 434, "pidfd_getfd": 438,
                             "pidfd_send_signal": 424}),
}


def _op(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k & 0xFFFFFFFF)


def program(machine: str, pid: int) -> list[bytes]:
    """The filter's instructions: every call but those above allowed; those aimed at ``pid``
    itself (0, ``pid``, ``-pid``: its own group) allowed; the others refused with EPERM, and any
    call of another architecture (32-bit calls on a 64-bit kernel) refused."""
    arch, numbers = SYSCALLS[machine]
    ops = [_op(LOAD, 4), _op(JEQ, arch, 1, 0), _op(RET, DENY), _op(LOAD, 0)]
    if machine == "x86_64":
        ops += [_op(JGE, X32, 0, 1), _op(RET, DENY)]
    for name in AIMED:
        ops += [_op(JEQ, numbers[name], 0, 6), _op(LOAD, 16),  # the first argument's low 32 bits (a pid_t)
                _op(JEQ, 0, 3, 0), _op(JEQ, pid, 2, 0), _op(JEQ, -pid, 1, 0), _op(RET, DENY), _op(RET, ALLOW)]
    for name in REFUSED:
        ops += [_op(JEQ, numbers[name], 0, 1), _op(RET, DENY)]
    return ops + [_op(RET, ALLOW)]


class _Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def apply() -> None:
    """Seal this process before it executes its command (see the module's docstring)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
    if os.geteuid() == 0:
        with open("/proc/sys/kernel/cap_last_cap") as f:
            last = int(f.read())
        for cap in range(last + 1):
            libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)  # nothing executed from here on gets one back
        libc.prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        header, data = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0), (ctypes.c_uint32 * 6)()
        if libc.capset(header, data):  # none effective, permitted or inheritable
            raise OSError(ctypes.get_errno(), "capset")
    machine = platform.machine()
    ops = program(machine, os.getpid()) if machine in SYSCALLS else []
    code = ctypes.create_string_buffer(b"".join(ops))
    prog = _Program(len(ops), ctypes.addressof(code))
    if not ops or libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) or \
            libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(prog), 0, 0):
        print(f"pagedlab grader: no seccomp filter on {machine} ({os.strerror(ctypes.get_errno())})", file=sys.stderr)


def undumpable() -> None:
    """Make this process undumpable: a process of the same user (not root) may then neither
    read its memory nor open its descriptors through /proc. Reset by every exec."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, ctypes.c_ulong(0), ctypes.c_ulong(0),
                                            ctypes.c_ulong(0), ctypes.c_ulong(0))
