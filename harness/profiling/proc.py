"""A process's memory as the kernel counts it (/proc/PID/status), its high-water mark, and a private-memory peak.

VmHWM is the peak resident set (anonymous + file-backed pages mapped, e.g. a memory-mapped safetensors file);
RssAnon is private anonymous memory now. Writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS.
"""

from __future__ import annotations

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


def reset_vm_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


class RssAnonPeak(threading.Thread):
    """Peak of this process's RssAnon, polled every `interval_s` from start() to stop(): the kernel keeps no
    high-water mark of private memory alone."""

    def __init__(self, interval_s: float = 0.005):
        super().__init__(daemon=True)
        self.interval_s, self.halt = interval_s, threading.Event()
        self.peak = status_bytes("RssAnon") or 0

    def run(self) -> None:
        while not self.halt.wait(self.interval_s):
            self.peak = max(self.peak, status_bytes("RssAnon") or 0)

    def stop(self) -> int:
        """Stop sampling; the peak, including the value now."""
        self.halt.set()
        self.join()
        self.peak = max(self.peak, status_bytes("RssAnon") or 0)
        return self.peak
