"""`harness doctor`: what a user checks on a machine before a long job; exit 1 when the recipe cannot run here."""
from __future__ import annotations

import os

import pytest

from harness.cli import main
from harness.commands.doctor import parse_hostfile
from harness.ops import op_problem

SECRET = "hf_doctorSecretValue0123456789"


def doctor(capsys, *argv) -> tuple[int, str]:
    code = main(["doctor", *argv])
    out, err = capsys.readouterr()
    return code, out + err


def test_a_runnable_recipe_exits_0_and_the_report_lists_what_to_check(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", SECRET)
    code, out = doctor(capsys, "--recipe", "ddp", "--output-dir", str(tmp_path / "run"))
    assert code == 0, out
    for label in ("torch ", "CUDA ", "NCCL ", "deepspeed ", "visible GPUs ", "ninja ", "op cpu_adam ", "op async_io ",
                  "libaio (NVMe offload) ", "/dev/shm ", "hostfile "):
        assert f"\n{label}" in "\n" + out, f"{label!r} missing:\n{out}"
    assert f"{tmp_path / 'run'}: writable, " in out and " GiB free" in out
    assert "recipe ddp: can run here (world size 1)" in out
    assert "HF_TOKEN set (value not shown)" in out and SECRET not in out


def test_nvme_recipe_without_libaio_exits_1_naming_what_to_install(capsys, tmp_path):
    code, out = doctor(capsys, "--recipe", "zero3_nvme", "--output-dir", str(tmp_path / "run"))
    if op_problem("async_io") is None:
        assert code == 0, out  # CI installs libaio-dev
        return
    assert code == 1, out
    assert "recipe zero3_nvme cannot run here" in out
    assert "zero.offload_optimizer (-> zero_optimization.offload_optimizer.device)" in out
    assert "apt-get install libaio-dev" in out
    assert "op async_io ..." in out and "nvme path ." in out


def test_doctor_leaves_the_environment_as_it_found_it(capsys, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    code, out = doctor(capsys, "--recipe", "ddp")
    assert code == 0 and "WORLD_SIZE" not in os.environ


def test_unwritable_output_dir_and_a_broken_hostfile_exit_1(capsys, tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("node-a slots=8\nnode-b slots=eight\nnode-a slots=8\n")
    code, out = doctor(capsys, "--recipe", "ddp", "--output-dir", "/proc/nope", "--hostfile", str(hostfile))
    assert code == 1, out
    assert "--output-dir: cannot create anything in /proc" in out
    assert f"{hostfile}: 1 hosts, 8 slots" in out
    assert "line 2: 'node-b slots=eight' is not 'HOST slots=N'" in out
    assert "line 3: host node-a listed twice" in out


def test_unknown_recipe_is_a_usage_error(capsys):
    code, out = doctor(capsys, "--recipe", "nope")
    assert code == 2 and "unknown recipe 'nope'" in out


@pytest.mark.parametrize("text, hosts, problems", [
    ("# two nodes\nworker-0 slots=8\n\nworker-1 slots=8  # second\n", {"worker-0": 8, "worker-1": 8}, []),
    ("worker-0 slots=0\n", {}, ["line 1: worker-0 has slots=0; needs at least 1"]),
    ("worker-0\n", {}, ["line 1: 'worker-0' is not 'HOST slots=N'"]),
    ("\n# nothing\n", {}, ["no hosts listed"]),
])
def test_parse_hostfile(text, hosts, problems):
    assert parse_hostfile(text) == (hosts, problems)
