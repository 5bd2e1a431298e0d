"""This process's memory as the kernel counts it (/proc/self/status), and resetting its high-water mark.

VmHWM is the peak resident set (anonymous + file-backed pages mapped, e.g. a memory-mapped safetensors file);
RssAnon is private anonymous memory now. Writing 5 to /proc/self/clear_refs resets VmHWM to the current RSS.
"""

from __future__ import annotations

import re
from pathlib import Path

_FIELD_RE = {name: re.compile(rf"{name}:\s+(\d+) kB") for name in ("VmHWM", "VmRSS", "RssAnon", "RssFile")}


def status_bytes(name: str) -> int | None:
    """One field of /proc/self/status in bytes (None off Linux)."""
    try:
        match = _FIELD_RE[name].search(Path("/proc/self/status").read_text())
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


def reset_vm_hwm() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False
