"""DeepSpeed's C++ ops: which ones a config needs, whether this machine can load them, and compiling them ahead
of time (`python -m harness.ops`), so runs and tests don't pay for it.

"Can load" is decided as ds_report decides it (op builder `is_compatible()`, pre-built `installed_ops`), plus
what a JIT build needs that `is_compatible()` does not ask: ninja, and a C++ compiler unless the torch
extensions cache already holds the built op. First compile takes minutes per op; the cache keeps the result.
"""

from __future__ import annotations

import os
import shutil
import sys
import time

OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder")
# The CPU optimizer DeepSpeed builds when optimizer state is offloaded (runtime/engine.py), by optimizer type.
CPU_OPTIMIZER_OPS = {"adam": "cpu_adam", "adamw": "cpu_adam", "adagrad": "cpu_adagrad", "lion": "cpu_lion"}
NVME_OPS = ("async_io", "pin_memory")  # AsyncIOBuilder.load() loads pin_memory first
INSTALL_LIBAIO = ("install libaio: apt-get install libaio-dev (yum install libaio-devel), "
                  "then `make ops` to compile async_io once")
INSTALL_COMPILER = "install a C++ compiler: apt-get install build-essential (or set CXX to one)"
INSTALL_NINJA = "pip install ninja (DeepSpeed JIT-compiles its ops with it)"
STALE_LOCK_S = 20 * 60  # a JIT build takes minutes; a build lock this old was left by a compile that was killed
# The packages behind the accelerators DeepSpeed 0.19.8 probes before it settles on the CPU (real_accelerator.py)
OTHER_ACCELERATOR_PACKAGES = ("torch_npu", "torch_sdaa", "habana_frameworks", "torch_mlu", "torch_supa", "torch_xmlir")


def pin_cpu_accelerator(env=os.environ) -> None:
    """DS_ACCELERATOR=cpu in `env` where DeepSpeed could find nothing but the CPU: a CPU-only torch and none of
    the other accelerators it probes. Otherwise each process (the runner, the node's launcher, every rank) detects
    it again and warns "Setting accelerator to CPU. If you have GPU or other accelerator, we were unable to detect
    it" (five times in `make demo`). A DS_ACCELERATOR already set is kept; a CUDA build of torch that sees no GPU
    keeps DeepSpeed's detection and its warning, which is news there."""
    import importlib.util

    if "DS_ACCELERATOR" in env:
        return
    import torch

    if torch.version.cuda or torch.version.hip or (hasattr(torch, "xpu") and torch.xpu.is_available()):
        return
    if torch.backends.mps.is_available() or any(importlib.util.find_spec(m) for m in OTHER_ACCELERATOR_PACKAGES):
        return
    env["DS_ACCELERATOR"] = "cpu"


def quick_start() -> None:
    """Two costs DeepSpeed pays in every rank at start-up, cut (call before DeepSpeed is imported; together ~2.5 s
    of CPU per rank, measured on the 2-core test machine):
      - its CPU op builders ask py-cpuinfo twice per op they load (cpu_arch, simd_width: the shm all-reduce at
        process-group init, then the optimizer's op), and each ask runs a fresh Python process: asked once here,
        kept for the process (the machine does not change under it; the flags, so the cached op build, are the same);
      - `import deepspeed` imports mlflow (~1.4 s) for its autotuner's optional logging, which a training rank
        never runs: that one import is answered "not installed"; mlflow imports as usual for anyone else
        (monitor.mlflow)."""
    import functools

    try:
        import cpuinfo
    except ImportError:
        pass
    else:
        if not hasattr(cpuinfo.get_cpu_info, "cache_info"):
            cpuinfo.get_cpu_info = functools.cache(cpuinfo.get_cpu_info)
    if "mlflow" not in sys.modules and not any(isinstance(f, _NoMlflowForTheAutotuner) for f in sys.meta_path):
        sys.meta_path.insert(0, _NoMlflowForTheAutotuner())


class _NoMlflowForTheAutotuner:
    """An import finder that refuses mlflow to deepspeed/autotuning/autotuner.py while that module is being
    imported (its `try: import mlflow` then sets has_mlflow = False), then steps aside for good."""

    def find_spec(self, name, path=None, target=None):
        if name != "mlflow":
            return None
        tuner = sys.modules.get("deepspeed.autotuning.autotuner")
        if tuner is not None and getattr(tuner.__spec__, "_initializing", False):
            sys.meta_path.remove(self)
            raise ModuleNotFoundError("mlflow is not imported for DeepSpeed's autotuner (harness.ops.quick_start)",
                                      name=name)
        return None


def needed_ops(ds: dict) -> dict[str, str]:
    """{op name: DeepSpeed JSON path that needs it} for a resolved DeepSpeed config."""
    zo = ds.get("zero_optimization") if isinstance(ds.get("zero_optimization"), dict) else {}
    stage = zo.get("stage", 0)
    out: dict[str, str] = {}
    for block in ("offload_optimizer", "offload_param"):
        device = (zo.get(block) or {}).get("device", "none") if isinstance(zo.get(block), dict) else "none"
        if device == "nvme" and stage == 3:  # below stage 3 DeepSpeed treats nvme as cpu (rules.py says so)
            for op in NVME_OPS:
                out.setdefault(op, f"zero_optimization.{block}.device")
        if block == "offload_optimizer" and device in ("cpu", "nvme") and stage >= 1:
            opt_type = str((ds.get("optimizer") or {}).get("type", "adam")).lower()
            if opt_type in CPU_OPTIMIZER_OPS:
                out.setdefault(CPU_OPTIMIZER_OPS[opt_type], f"zero_optimization.{block}.device")
    return out


def init_ops() -> dict[str, str]:
    """{op: who needs it} for ops DeepSpeed builds at process-group init whatever the config: on its CPU
    accelerator the shared-memory all-reduce, when compatible (the test of deepspeed/comm/torch.py build_shm_op)."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    builder = accel.create_op_builder("ShareMemCommBuilder")
    if builder is None or not deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        return {}
    return {builder.NAME: f"accelerator ({accel.device_name()})"}


def _builders() -> dict:
    from deepspeed.ops.op_builder.all_ops import ALL_OPS  # this accelerator's builders, as ds_report lists them

    return ALL_OPS


def is_prebuilt(name: str) -> bool:
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import accelerator_name, installed_ops

    return bool(installed_ops.get(name)) and accelerator_name == get_accelerator()._name


def is_cached(name: str) -> bool:
    """Whether a JIT build of the op sits in the torch extensions cache (TORCH_EXTENSIONS_DIR)."""
    from torch.utils.cpp_extension import _get_build_directory

    folder = _get_build_directory(name, False)
    return os.path.isdir(folder) and any(f.endswith(".so") for f in os.listdir(folder))


def stale_lock(name: str) -> tuple[str, float] | None:
    """(path, age in s) of a build lock in the op's torch extensions folder older than STALE_LOCK_S. torch
    takes that lock on EVERY load of a JIT op (built or not) and waits, without a timeout, while it exists."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory(name, False), "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return None
    return (lock, age) if age > STALE_LOCK_S else None


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX") or "c++")


def op_problem(name: str) -> tuple[str, str] | None:
    """(why op `name` cannot be loaded here, the fix), or None when it can."""
    from deepspeed.ops.op_builder.builder import probe_is_compatible
    from torch.utils.cpp_extension import is_ninja_available

    builder = _builders().get(name)
    if builder is None:
        return f"DeepSpeed has no {name} op for this accelerator", "run on a machine whose accelerator has it"
    if is_prebuilt(name):
        return None
    if not probe_is_compatible(builder, verbose=False):  # what ds_report prints as compatible [NO]
        if name == "async_io":
            return "the async_io op is not compatible here: libaio (headers + .so) not found", INSTALL_LIBAIO
        return f"the {name} op is not compatible here (ds_report shows it [NO])", "run ds_report to see what it lacks"
    if not is_ninja_available():
        return f"the {name} op must be JIT-compiled and ninja is not installed", INSTALL_NINJA
    if stale := stale_lock(name):
        return (f"the {name} op's build lock {stale[0]} is {stale[1] / 60:.0f} min old, left by a compile that was "
                f"killed: every process that loads the op would wait on it forever",
                f"rm {stale[0]} (if no other process on this machine is compiling {name})")
    if not is_cached(name) and compiler() is None:
        return (f"the {name} op is not built yet (not in the torch extensions cache) and no C++ compiler "
                f"({os.environ.get('CXX') or 'c++'}) is on PATH to build it", INSTALL_COMPILER)
    return None


def main() -> int:
    pin_cpu_accelerator()
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    for name in OPS:
        builder = accel.create_op_builder(name)
        if builder is None:
            print(f"[ops] {name}: not used on {accel.device_name()}")
            continue
        problem = op_problem(builder.name)
        if problem is not None:
            print(f"[ops] {name}: {problem[0]} ({problem[1]})")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"[ops] {name}: ready ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
