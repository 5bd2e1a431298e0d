"""The run's spec is built once per launch: frozen, its degrees read from spec.run, the model config read once, the
launch's world passed in (never read from the environment past the entry point)."""
from __future__ import annotations

import dataclasses

import pytest

from harness.dist import Launch, launched
from harness.train import checks, run_args, session


def test_spec_is_frozen_and_reads_its_degrees_and_batch_from_the_run(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # the world comes from the Launch passed in
    loads = []
    real = checks.model_config
    monkeypatch.setattr(checks, "model_config", lambda name: loads.append(name) or real(name))
    args = run_args.parse(["--recipe", "zero2", "--output-dir", str(tmp_path / "run"), "--set", "train.seq_len=64"])
    spec = session.prepare(args, Launch(world_size=2, local_size=2))
    assert loads == ["tiny-llama"]  # once, by checks.inputs; the checks and the MoE blocks reuse it
    run = spec.run
    assert (spec.world_size, spec.tp, spec.pp, spec.sp, spec.dp, spec.zero_stage) == (2, 1, 1, 1, 2, 2)
    assert (run.degrees.dp, run.zero.stage, run.model_config["hidden_size"]) == (2, 2, 64)
    ds = spec.ds_config
    assert (run.batch.micro_batch, run.batch.grad_accum, run.batch.global_batch) == (
        ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.ds_config = {}


def test_the_launchers_environment_is_read_in_one_place(monkeypatch):
    for name in ("WORLD_SIZE", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launched() is None  # no launcher: harness/run.py runs a world of one
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert launched() == Launch(world_size=4, local_size=4)  # no ranks-per-node variable: one node
    monkeypatch.setenv("LOCAL_SIZE", "2")  # DeepSpeed's launch.py
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched() == Launch(world_size=4, local_size=2, rank=3, local_rank=1)
