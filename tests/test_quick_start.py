"""harness.startup.quick_start, which every rank runs before DeepSpeed is imported (harness/run.py, tests/drivers/):
py-cpuinfo asked once per process, mlflow not imported by DeepSpeed's autotuner but as usual by anyone else."""

from __future__ import annotations

import subprocess
import sys

from helpers.launch import ROOT, env

SCRIPT = """
import sys
from harness.startup import quick_start
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


ASK_NOT = """
import cpuinfo
def asked():
    raise AssertionError("py-cpuinfo asked although its answer is kept")
cpuinfo.get_cpu_info = asked
from harness.startup import quick_start
quick_start()
print("kept:", cpuinfo.get_cpu_info()["arch"])
"""


def test_cpuinfo_answer_kept_for_the_next_process(tmp_path):
    """The first process on this CPU asks py-cpuinfo (its own process, ~1.5 s with a 1 s sleep) and keeps the
    answer in the torch extensions folder; the next one reads it and never asks (its ask raises here)."""
    run_env = {**env(), "PYTHONPATH": str(ROOT), "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", "from harness.startup import quick_start; quick_start();"
                            "import cpuinfo; print('asked:', cpuinfo.get_cpu_info()['arch'])"], cwd=ROOT, env=run_env,
                           capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr[-3000:]
    kept = list(tmp_path.glob("dsharness-cpuinfo-*.json"))
    assert len(kept) == 1, kept
    second = subprocess.run([sys.executable, "-c", ASK_NOT], cwd=ROOT, env=run_env, capture_output=True, text=True,
                            timeout=120)
    assert second.returncode == 0, second.stderr[-3000:]
    arch = first.stdout.split("asked: ")[1].split()[0]
    assert f"kept: {arch}" in second.stdout, (first.stdout, second.stdout)


def test_cpuinfo_file_named_by_the_cpu_not_its_clock(tmp_path, monkeypatch):
    from harness.startup import cpu_info_file

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    cpu = ("processor\t: {n}\nvendor_id\t: GenuineIntel\nmodel name\t: Xeon\ncpu MHz\t\t: {mhz}\n"
           "flags\t\t: fpu sse avx2{more}\nbogomips\t: {mhz}\n\n")
    paths = {}
    for name, mhz, more in (("a", 2000.1, ""), ("a_later", 2999.7, ""), ("avx512", 2000.1, " avx512f")):
        (tmp_path / name).write_text(cpu.format(n=0, mhz=mhz, more=more) + cpu.format(n=1, mhz=mhz + 1, more=more))
        paths[name] = cpu_info_file(str(tmp_path / name))
    assert paths["a"] == paths["a_later"] and paths["a"] != paths["avx512"], paths
    assert paths["a"].startswith(str(tmp_path))
    assert cpu_info_file(str(tmp_path / "missing")) is None


def test_runner_starts_its_launcher_through_quick_start():
    from harness.commands.deepspeed_runner import MODULE, through_here

    local = [sys.executable, "-u", "-m", "deepspeed.launcher.launch", "--world_info=x", "script.py", "--a"]
    assert through_here(local) == [sys.executable, "-u", "-m", MODULE, *local[3:]]
    pdsh = ["pdsh", "-S", "-f", "1024", "-w", "a,b", "cd /x; python -u -m deepspeed.launcher.launch --node_rank=%n"]
    assert through_here(pdsh) == pdsh


RANK = """
import os, sys
print("launcher:", open(f"/proc/{os.getppid()}/cmdline").read().split("\\0")[1:5])
sys.exit(int(os.environ["LOCAL_RANK"]) * 3)
"""


def test_runner_and_launcher_import_no_mlflow_and_pass_the_exit_code(tmp_path):
    """A 2-rank launch through harness/commands/deepspeed_runner.py (as `harness launch` and the tests start
    DeepSpeed): both DeepSpeed processes import its autotuner, whose `import mlflow` (~1.4 s each) is refused;
    rank 1's exit code 3 comes back as the runner's (DeepSpeed's own behaviour, kept through exit_now)."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    proc = subprocess.run([sys.executable, "-m", "harness.commands.deepspeed_runner", "--num_gpus", "2",
                           str(script)], cwd=ROOT, env={**env(), "PYTHONPROFILEIMPORTTIME": "1"},
                          capture_output=True, text=True, timeout=300)
    imported = [line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")]
    assert imported.count("deepspeed.autotuning.autotuner") == 2, proc.stderr[-3000:]
    # a refused import is one line `mlflow`; mlflow imported has hundreds of its modules (mlflow.tracking, ...)
    assert not [m for m in imported if m.startswith("mlflow.")], "mlflow imported"
    assert "launcher: ['-u', '-m', 'harness.commands.deepspeed_runner', 'deepspeed.launcher.launch']" in proc.stdout, \
        proc.stdout[-3000:]
    assert proc.returncode == 3, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
