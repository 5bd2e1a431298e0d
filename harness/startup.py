"""Start-up of every process that imports DeepSpeed (ranks, DeepSpeed's runner and launcher, the harness CLI,
calibration workers): harness.ops.quick_start, plus py-cpuinfo's answer kept on disk per CPU.

DeepSpeed's CPU op builders ask py-cpuinfo for the CPU's arch and flags; `get_cpu_info()` runs a fresh Python
process that sleeps 1 s to time the clock (~1.5 s of wall per rank on the 2-core test machine). The answer is
kept in a file named by what identifies this CPU (cpu_info_file), so only the first process on a CPU asks.
(In a module of its own, not harness/ops.py: docker/Dockerfile compiles the ops from ops.py alone, and a change
to that file would rebuild the image's op and dependency layers.)
"""

from __future__ import annotations

import os

# /proc/cpuinfo lines that change from one boot, core or moment to the next: not part of the CPU's identity
CPU_INFO_CHANGING = ("processor", "cpu mhz", "bogomips", "core id", "apicid", "initial apicid", "physical id",
                     "siblings", "cpu cores")


def quick_start() -> None:
    """harness.ops.quick_start (call before DeepSpeed is imported), with py-cpuinfo's one ask per process
    answered from the file another process on this CPU wrote, when there is one."""
    import functools

    from harness import ops

    try:
        import cpuinfo
    except ImportError:
        pass
    else:
        if not hasattr(cpuinfo.get_cpu_info, "cache_info"):  # ops.quick_start then keeps this one
            cpuinfo.get_cpu_info = functools.cache(functools.partial(cpu_info, cpuinfo.get_cpu_info))
    ops.quick_start()


def cpu_info(ask) -> dict:
    """py-cpuinfo's answer (`ask()`), kept in a file named by what identifies this CPU (cpu_info_file): read from
    there when another process on the same CPU asked before; asked and written (atomically) otherwise."""
    import json

    path = cpu_info_file()
    if path is not None:
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, ValueError):
            pass
    info = ask()
    if path is not None and info:  # py-cpuinfo answers {} when its process failed: nothing to keep
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(f"{path}.{os.getpid()}", "w") as f:
                json.dump(info, f)
            os.replace(f"{path}.{os.getpid()}", path)
        except OSError:
            pass
    return info


def cpu_info_file(proc_cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The file that keeps py-cpuinfo's answer for this CPU: named by a hash of /proc/cpuinfo's lasting lines
    (vendor, model, flags: what DeepSpeed's op builders read; not clock speeds or core numbering), the machine
    and py-cpuinfo's version, so another CPU or another py-cpuinfo misses it. It sits in the torch extensions
    folder (TORCH_EXTENSIONS_DIR, or torch's default), beside the op builds its flags decided. None where
    /proc/cpuinfo cannot be read (not Linux): then each process asks."""
    import hashlib
    import platform

    import cpuinfo

    try:
        with open(proc_cpuinfo) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    lasting = sorted({line.strip() for line in lines if ":" in line
                      and line.split(":")[0].strip().lower() not in CPU_INFO_CHANGING})
    key = "\n".join([platform.machine(), str(cpuinfo.CPUINFO_VERSION), *lasting])
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if not root:
        from torch.utils.cpp_extension import get_default_build_root

        root = get_default_build_root()
    return os.path.join(root, f"dsharness-cpuinfo-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json")
