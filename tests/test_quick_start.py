"""harness.ops.quick_start, which every rank runs before DeepSpeed is imported (harness/run.py, tests/drivers/):
py-cpuinfo asked once per process, mlflow not imported by DeepSpeed's autotuner but as usual by anyone else."""

from __future__ import annotations

import subprocess
import sys

from helpers.launch import ROOT, env

SCRIPT = """
import sys
from harness.ops import quick_start
quick_start()
import cpuinfo
import deepspeed
from deepspeed.accelerator import get_accelerator
import deepspeed.autotuning.autotuner as tuner
print("mlflow loaded by deepspeed:", "mlflow" in sys.modules, tuner.has_mlflow)
builder = get_accelerator().create_op_builder("CPUAdamBuilder")
first = builder.cxx_args()
assert builder.cxx_args() == first  # the same flags, so the cached build of the op still matches
print("cpuinfo asked:", cpuinfo.get_cpu_info.cache_info().misses, "of", cpuinfo.get_cpu_info.cache_info().hits
      + cpuinfo.get_cpu_info.cache_info().misses)
from mlflow.entities import Param
import mlflow
from harness import ops
print("mlflow works:", mlflow.__version__ != "", mlflow.entities.Param is Param, Param("a", "1").key,
      any(isinstance(f, ops._NoMlflowForTheAutotuner) for f in sys.meta_path))
"""


def test_ranks_ask_cpuinfo_once_and_deepspeed_imports_no_mlflow():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env={**env(), "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=300)
    out = proc.stdout
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "mlflow loaded by deepspeed: False False" in out, out
    assert "cpuinfo asked: 1 of 4" in out, out  # cpu_arch and simd_width, twice
    assert "mlflow works: True True a False" in out, out  # one copy of mlflow, the finder gone
