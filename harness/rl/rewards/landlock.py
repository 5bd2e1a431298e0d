"""Landlock (Linux 5.13+, unprivileged): after `restrict(writable)`, this process and its children may write only
beneath the given folders, and (ABI 4+, Linux 6.7) may neither connect nor bind a TCP socket; ABI 6+ also stops
signals and abstract unix sockets leaving the sandbox. Reading and executing stay allowed everywhere.

Through the raw syscalls (x86_64 and aarch64 numbers; ctypes), so no package is needed. Returns the ABI used, 0 when
the kernel has no Landlock (the caller says so)."""

from __future__ import annotations

import ctypes
import os
import platform

SYSCALLS = {"x86_64": (444, 445, 446), "aarch64": (444, 445, 446)}  # create_ruleset, add_rule, restrict_self
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH, RULE_NET_PORT = 1, 2
PR_SET_NO_NEW_PRIVS = 38
# filesystem rights (ABI 1), then REFER (2), TRUNCATE (3), IOCTL_DEV (5)
EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
WRITE_ABI1 = sum(1 << b for b in (1, 4, 5, 6, 7, 8, 9, 10, 11, 12))  # write, remove dir/file, make char/dir/
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15  # reg/sock/fifo/block/sym
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def abi() -> int:
    numbers = SYSCALLS.get(platform.machine())
    if numbers is None:
        return 0
    version = _libc().syscall(numbers[0], None, ctypes.c_size_t(0), ctypes.c_uint32(CREATE_RULESET_VERSION))
    return max(int(version), 0)


def _fs_rights(version: int) -> int:
    rights = WRITE_ABI1
    rights |= REFER if version >= 2 else 0
    rights |= TRUNCATE if version >= 3 else 0
    rights |= IOCTL_DEV if version >= 5 else 0
    return rights


def restrict(writable: list[str]) -> int:
    """Confine this process (and what it starts) to writing beneath `writable`, with no TCP; the ABI, 0 if none."""
    version = abi()
    if not version:
        return 0
    libc, (create, add, restrict_self) = _libc(), SYSCALLS[platform.machine()]
    fs = _fs_rights(version)
    attr = _RulesetAttr(fs, NET_BIND_TCP | NET_CONNECT_TCP if version >= 4 else 0,
                        SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if version >= 6 else 0)
    size = ctypes.sizeof(_RulesetAttr) if version >= 6 else (16 if version >= 4 else 8)
    ruleset = libc.syscall(create, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for folder in writable:
            fd = os.open(folder, os.O_PATH | os.O_CLOEXEC)
            try:
                rule = _PathBeneath(fs, fd)
                if libc.syscall(add, ruleset, RULE_PATH_BENEATH, ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule {folder} failed")
            finally:
                os.close(fd)
        if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(restrict_self, ruleset, ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return version
