"""A process's memory as the kernel counts it (/proc/PID/status), its high-water mark, and a private-memory peak.

VmHWM is the peak resident set (anonymous + file-backed pages mapped, e.g. a memory-mapped safetensors file);
RssAnon is private anonymous memory now. Writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS.
RssAnon also counts memory the program has freed but glibc's malloc keeps in its arenas for reuse (tensors under
its mmap threshold, up to 32 MB, come from there); `malloc_free_bytes` reads that (mallinfo2), so RssAnon less it
is the memory in use: on CPU what CUDA's allocated bytes are beside its reserved ones.
"""

from __future__ import annotations

import ctypes
import re
import threading
from pathlib import Path

_FIELD_RE = {name: re.compile(rf"{name}:\s+(\d+) kB") for name in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def status_bytes(name: str, pid: int | str = "self") -> int | None:
    """One field of /proc/PID/status in bytes (None off Linux, or when the process is gone)."""
    try:
        match = _FIELD_RE[name].search(Path(f"/proc/{pid}/status").read_text())
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def _mallinfo2():
    try:
        fn = ctypes.CDLL(None).mallinfo2  # glibc 2.33+
    except (OSError, AttributeError):
        return None
    fn.restype, fn.argtypes = _MallInfo2, []
    return fn


_MALLINFO2 = _mallinfo2()


def malloc_free_bytes() -> int | None:
    """Bytes glibc's malloc holds free in its arenas (mallinfo2's fordblks): freed by the program, still resident
    and counted in RssAnon, and reused by the next allocations. None without glibc 2.33+ (musl, macOS). About a
    microsecond a call."""
    return None if _MALLINFO2 is None else int(_MALLINFO2().fordblks)


def reset_vm_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssAnonPeak(threading.Thread):
    """Peaks of this process's RssAnon and of the memory in use (RssAnon less malloc's free bytes, sampled
    together), polled every `interval_s` from start() to stop(): the kernel keeps no high-water mark of private
    memory alone."""

    def __init__(self, interval_s: float = 0.005):
        super().__init__(daemon=True)
        self.interval_s, self.halt = interval_s, threading.Event()
        self.peak = self.in_use_peak = 0
        self.sample()

    def sample(self) -> None:
        anon = status_bytes("RssAnon") or 0
        self.peak = max(self.peak, anon)
        self.in_use_peak = max(self.in_use_peak, anon - (malloc_free_bytes() or 0))

    def reset(self) -> None:
        """Peaks from now on (the sampler keeps running)."""
        self.peak = self.in_use_peak = 0
        self.sample()

    def run(self) -> None:
        while not self.halt.wait(self.interval_s):
            self.sample()

    def stop(self) -> int:
        """Stop sampling; the RssAnon peak, including the value now (in_use_peak likewise)."""
        self.halt.set()
        self.join()
        self.sample()
        return self.peak
