"""harness/run.py flags are pinned, and bad input stops it with exit 2 before any rank or process group exists."""
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.train import run_args
from harness.errors import UsageError
from harness.config.recipes import load_recipe

REPO = Path(__file__).resolve().parents[1]
RUN_PY = REPO / "harness" / "run.py"
RECIPES = ("3d, ddp, long_context, lora_zero2, lora_zero3, moe_ep, moe_zero3, pipeline, tp, zero1, zero2, "
           "zero2_bf16_sr, zero2_bf16_states, zero2_muon, zero2_offload, zero3, zero3_nvme, zero3_offload")


def test_flags_are_pinned():
    """Adding a flag is a decision: prefer --set KEY=VALUE (style: one generic typed override)."""
    flags = {s for action in run_args.parser()._actions for s in action.option_strings}
    assert flags == {"-h", "--help", "--recipe", "--ds-config", "--model", "--dataset", "--output-dir", "--resume",
                     "--overwrite", "--set", "--profile-steps", "--local_rank", "--local-rank"}


def test_defaults():
    args = run_args.parse([])
    assert (args.recipe, args.ds_config, args.output_dir, args.resume, args.overwrite, args.overrides,
            args.local_rank) == (None, None, None, None, False, [], None)


def test_sugar_flags_become_overrides_before_explicit_sets():
    args = run_args.parse(["--model", "tiny-gpt2", "--dataset", "data.jsonl", "--profile-steps", "5-8",
                           "--set", "train.steps=3"])
    assert args.overrides == ["train.model=tiny-gpt2", "train.dataset=data.jsonl", "profile.steps=5-8",
                              "train.steps=3"]
    recipe, _ = load_recipe("zero1", args.overrides)
    assert recipe["train"]["model"] == "tiny-gpt2" and recipe["train"]["steps"] == 3
    assert recipe["profile"]["steps"] == "5-8"


def test_launcher_local_rank_is_accepted_in_both_spellings():
    assert run_args.parse(["--local_rank=3"]).local_rank == 3
    assert run_args.parse(["--local-rank", "1"]).local_rank == 1


def test_resume_defaults_to_latest_when_given_bare():
    assert run_args.parse(["--resume"]).resume == "latest"
    assert run_args.parse(["--resume", "runs/x/checkpoints/global_step5"]).resume == "runs/x/checkpoints/global_step5"


def test_set_with_an_unknown_key_is_a_usage_error_with_a_suggestion():
    args = run_args.parse(["--set", "zero.stag=3"])
    with pytest.raises(UsageError, match=r"--set zero\.stag: not a recipe key \(did you mean 'zero\.stage'\?\)"):
        load_recipe("zero1", args.overrides)


def test_set_into_something_that_is_not_a_block_is_a_usage_error():
    with pytest.raises(UsageError, match=r"--set zero\.stage: zero is 1, not a block of keys"):
        load_recipe("zero1", ["zero=1", "zero.stage=2"])
    with pytest.raises(UsageError, match=r"deepspeed\.steps_per_print is 1, not a block of keys"):
        load_recipe("zero1", ["deepspeed.steps_per_print=1", "deepspeed.steps_per_print.x=2"])


def test_set_values_are_typed_and_checked():
    recipe, _ = load_recipe("zero1", ["train.steps=20", "zero.overlap_comm=false", "precision=fp32"])
    assert (recipe["train"]["steps"], recipe["zero"]["overlap_comm"], recipe["precision"]) == (20, False, "fp32")
    with pytest.raises(UsageError, match="expected KEY=VALUE"):
        load_recipe("zero1", ["train.steps"])
    from harness.errors import ConfigError

    with pytest.raises(ConfigError, match=r"train\.steps: got \"twenty\", expected integer >= 1 \(after --set"):
        load_recipe("zero1", ["train.steps=twenty"])


# --- the real entry point, as a process (no launcher, so world size 1 and no process group) ---

def run_py(*argv: str, timeout_s: float = 60) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "DSHARNESS_ROOT")}
    start = time.monotonic()
    proc = subprocess.run([sys.executable, str(RUN_PY), *argv], capture_output=True, text=True, env=env,
                          timeout=timeout_s, cwd=REPO)
    return proc, time.monotonic() - start


def assert_clean_exit_2(proc):
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert "error" not in proc.stdout  # stdout may hold DeepSpeed's "Setting accelerator to CPU" line only
    assert "Initializing TorchBackend" not in proc.stderr, "no process group may be started for bad input"


def test_unknown_recipe_exits_2_listing_valid_recipes_in_seconds():
    proc, elapsed_s = run_py("--recipe", "nope")
    assert_clean_exit_2(proc)
    assert proc.stderr.startswith("error: unknown recipe 'nope'")
    assert f"valid recipes: {RECIPES}" in proc.stderr
    assert elapsed_s < 20, "bad input must fail before torch/deepspeed start anything"


def test_unknown_set_key_exits_2():
    proc, _ = run_py("--recipe", "zero1", "--set", "zero.stag=3")
    assert_clean_exit_2(proc)
    assert "did you mean 'zero.stage'?" in proc.stderr


def test_fp16_on_a_machine_without_fp16_exits_2():
    """The run-time rule: this CPU machine (DeepSpeed's CPU accelerator) cannot train in fp16."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().is_fp16_supported():
        pytest.skip("this machine supports fp16")
    proc, _ = run_py("--set", "precision=fp16")
    assert_clean_exit_2(proc)
    assert "precision (-> fp16.enabled): fp16 is not supported on this device" in proc.stderr
    assert "--set precision=bf16" in proc.stderr


def tree(root: Path) -> dict[str, tuple]:
    return {str(p.relative_to(root)): (p.is_dir(), p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
            for p in sorted(root.rglob("*"))}


def test_output_dir_with_checkpoints_is_not_overwritten_without_resume(tmp_path):
    run_dir = tmp_path / "run"
    step = run_dir / "checkpoints" / "global_step5"
    step.mkdir(parents=True)
    (step / "mp_rank_00_model_states.pt").write_bytes(b"weights")
    (run_dir / "checkpoints" / "latest").write_text("global_step5")
    before = tree(tmp_path)
    proc, _ = run_py("--recipe", "zero1", "--output-dir", str(run_dir))
    assert_clean_exit_2(proc)
    assert f"{run_dir} already holds an earlier run (global_step5)" in proc.stderr
    assert "--resume latest" in proc.stderr and "--overwrite" in proc.stderr
    assert tree(tmp_path) == before, "the earlier run's folder must be left exactly as it was"
