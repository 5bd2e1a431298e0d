"""Resume on another layout (issue 33 part 2) on real DeepSpeed ranks (CPU, fp32, tiny-llama): a run saved at
step 2 on one layout continues on another, converted once into DeepSpeed's universal form with the harness's
tensor-parallel slicing and pipeline names (harness/checkpoint/relayout.py), and its losses from step 3 on equal
those of the run that never moved (same global batch 4, so the same rows in the same order) within 1e-6.

Cases: tp2 -> tp1, pp2 -> pp1 -> pp2, sp2 on ZeRO-3 -> sp1 on ZeRO-2, ep2 -> ep1 on ZeRO-3 (tiny-qwen3-moe),
LoRA tp2 -> tp1, pipeline -> ddp (ZeRO-0) -> pipeline and ZeRO-2 -> ddp (checkpoint/zero0.py; one 2-rank launch), and
3D (pp2 x tp2) -> ZeRO-2 -> 3D on 4 ranks (one 4-rank launch). Each save case runs before its resume case in the same
process group (tests/drivers/jobs.py). Measured on the 2-core machine: ~35 s and ~36 s.
"""

from __future__ import annotations

import json

import pytest

from helpers.launch import launch_jobs, losses

pytestmark = pytest.mark.multirank

RTOL = 1e-6  # the bound; measured <= 2.3e-7 (LoRA tp2 -> tp1), 0 for the pipeline chain
COMMON = ["--set", "precision=fp32", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
          "--set", "scheduler.type=none", "--set", "train.log_every=1", "--profile-steps", "",
          "--set", "batch.train_batch_size=\"auto\"", "--set", "train.model=tiny-llama"]
LORA = ["--set", "adapter.type=lora"]
MOE = ["--set", "train.model=tiny-qwen3-moe"]  # after COMMON's tiny-llama: the later --set wins


def case(recipe: str, out, micro: int, accum: int, steps: int = 4, every: int = 2, *extra: str) -> list[str]:
    return ["--recipe", recipe, *COMMON, "--set", f"batch.micro_batch_per_gpu={micro}",
            "--set", f"batch.grad_accum_steps={accum}", "--set", f"train.steps={steps}",
            "--set", f"train.save_every={every}", "--output-dir", str(out), *extra]


def from_step(run, step: int) -> list[str]:
    return ["--resume", str(run / "checkpoints" / f"global_step{step}")]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("relayout2")
    r = {name: root / name for name in ("tp2", "tp1", "pp2", "pp1", "pp2_again", "sp2", "sp1", "ep2", "ep1",
                                         "lora_tp2", "lora_tp1", "pp2_ddp", "ddp_pp2", "z2", "z2_ddp")}
    launch_jobs([case("tp", r["tp2"], 4, 1),
                 case("zero1", r["tp1"], 2, 1, 4, 2, *from_step(r["tp2"], 2)),
                 case("pipeline", r["pp2"], 2, 2),
                 case("zero1", r["pp1"], 2, 1, 3, 1, *from_step(r["pp2"], 2)),  # saves step 3 on pp1
                 case("pipeline", r["pp2_again"], 2, 2, 4, 2, *from_step(r["pp1"], 3)),
                 case("zero3", r["sp2"], 4, 1, 4, 2, "--set", "parallel.sequence=2"),
                 case("zero2", r["sp1"], 2, 1, 4, 2, *from_step(r["sp2"], 2)),
                 case("zero3", r["ep2"], 2, 1, 4, 2, *MOE, "--set", "parallel.expert=2"),
                 case("zero3", r["ep1"], 2, 1, 4, 2, *MOE, *from_step(r["ep2"], 2)),
                 case("tp", r["lora_tp2"], 4, 1, 4, 2, *LORA),
                 case("lora_zero2", r["lora_tp1"], 2, 1, 4, 2, *LORA, *from_step(r["lora_tp2"], 2)),
                 case("ddp", r["pp2_ddp"], 2, 1, 3, 1, *from_step(r["pp2"], 2)),  # saves step 3 on ZeRO-0
                 case("pipeline", r["ddp_pp2"], 2, 2, 4, 2, *from_step(r["pp2_ddp"], 3)),
                 case("zero2", r["z2"], 2, 1),
                 case("ddp", r["z2_ddp"], 2, 1, 4, 2, *from_step(r["z2"], 2))], root)
    return r


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("relayout4")
    r = {"3d": root / "3d", "zero2": root / "zero2", "3d_again": root / "3d_again"}
    launch_jobs([case("3d", r["3d"], 2, 2), case("zero2", r["zero2"], 1, 1, 3, 1, *from_step(r["3d"], 2)),
                 case("3d", r["3d_again"], 2, 2, 4, 2, *from_step(r["zero2"], 3))], root, ranks=4)
    return r


def check_continues(straight, resumed, first: int, want_from: dict, want_to: dict) -> dict | None:
    """Losses from `first` on equal the straight run's; one conversion recorded with both layouts (none when
    `want_from` is None: the checkpoint's universal form was made by an earlier resume and reused)."""
    got, want = losses(resumed), losses(straight)
    assert got and sorted(got) == list(range(first, max(got) + 1)), f"{resumed.name} logged steps {sorted(got)}"
    worst = max(abs(got[s] - want[s]) / abs(want[s]) for s in got)
    assert worst <= RTOL, f"{resumed.name}: {worst:.3g} > {RTOL}: {got} vs {want}"
    assert json.loads((resumed / "summary.json").read_text())["start_step"] == first - 1
    if want_from is None:
        assert not (resumed / "conversions.jsonl").exists()
        print(f"{straight.name} -> {resumed.name}: worst {worst:.2e}, universal form reused")
        return None
    (line,) = [json.loads(x) for x in (resumed / "conversions.jsonl").read_text().splitlines()]
    assert {k: line["from"][k] for k in want_from} == want_from and {k: line["to"][k] for k in want_to} == want_to
    assert line["seconds"] > 0 and line["peak_rss_anon_bytes"] >= line["rss_anon_before_bytes"] > 0
    print(f"{straight.name} -> {resumed.name}: worst {worst:.2e}, conversion {line['seconds']:.2f} s, +"
          f"{(line['peak_rss_anon_bytes'] - line['rss_anon_before_bytes']) / 2**20:.1f} MiB private")
    return line


def test_tp2_to_tp1(two_ranks):
    check_continues(two_ranks["tp2"], two_ranks["tp1"], 3, {"tp": 2, "dp": 1}, {"tp": 1, "dp": 2})
    from harness.report.compare import headline, load_run, render

    run = load_run(two_ranks["tp1"])  # harness report lists the conversion
    assert "- layout changes: 1 checkpoint conversion on resume (" in "\n".join(headline(run))
    text = render(run, {"states": [], "comm": [], "peak": []}, [], {})
    assert "## Layout changes (checkpoints converted on resume)" in text
    assert "| global_step2 | world 2, tp 2, ZeRO-1 | world 2, dp 2, ZeRO-1 |" in text, text


def test_pp2_to_pp1_to_pp2(two_ranks):
    r = two_ranks
    line = check_continues(r["pp2"], r["pp1"], 3, {"pp": 2, "dp": 1}, {"pp": 1, "dp": 2})
    universal = r["pp2"] / "checkpoints" / "universal" / line["tag"] / "zero"
    assert (universal / "model.layers.1.mlp.down_proj.weight").is_dir()  # pipeline names -> HF names
    assert not (universal / "2.layer.mlp.down_proj.weight").exists()
    check_continues(r["pp2"], r["pp2_again"], 4, {"pp": 1, "dp": 2}, {"pp": 2, "dp": 1})


def test_sp2_zero3_to_sp1_zero2(two_ranks):
    check_continues(two_ranks["sp2"], two_ranks["sp1"], 3, {"sp": 2, "zero_stage": 3}, {"sp": 1, "zero_stage": 2})


def test_ep2_to_ep1_on_zero3(two_ranks):
    check_continues(two_ranks["ep2"], two_ranks["ep1"], 3, {"ep": 2, "zero_stage": 3}, {"ep": 1, "zero_stage": 3})
    marker = json.loads((two_ranks["ep2"] / "checkpoints" / "universal" / "global_step2" / "converted.json").read_text())
    assert marker["experts"] == "transformers"  # AutoEP's w1/w2/w3 rewritten to the fused experts ep 1 trains


def test_lora_tp2_to_tp1(two_ranks):
    check_continues(two_ranks["lora_tp2"], two_ranks["lora_tp1"], 3, {"tp": 2}, {"tp": 1, "zero_stage": 2})


def test_pipeline_to_ddp_to_pipeline_and_zero2_to_ddp(two_ranks):
    """ZeRO-0 on either side: the harness writes (from a ZeRO-0 save) and reads (into a ZeRO-0 engine) the universal
    form's fp32 weights and Adam moments itself (checkpoint/zero0.py); measured exact (0 difference)."""
    r = two_ranks
    check_continues(r["pp2"], r["pp2_ddp"], 3, None, None)  # pp1 converted pp2's global_step2 already
    check_continues(r["pp2"], r["ddp_pp2"], 4, {"pp": 1, "zero_stage": 0}, {"pp": 2, "zero_stage": 1})
    check_continues(r["z2"], r["z2_ddp"], 3, {"zero_stage": 2}, {"zero_stage": 0})
    universal = r["pp2_ddp"] / "checkpoints" / "universal" / "global_step3" / "zero"
    assert (universal / "model.layers.1.mlp.down_proj.weight" / "exp_avg.pt").is_file()  # written from ZeRO-0


def test_3d_to_zero2_to_3d(four_ranks):
    """Back to 3D: the whole tensors sliced again for 2 tensor ranks (row-parallel ones along dim 1) on 2 stages."""
    r = four_ranks
    check_continues(r["3d"], r["zero2"], 3, {"pp": 2, "tp": 2, "zero_stage": 1},
                    {"pp": 1, "tp": 1, "dp": 4, "zero_stage": 2})
    check_continues(r["3d"], r["3d_again"], 4, {"tp": 1, "dp": 4, "zero_stage": 2}, {"pp": 2, "tp": 2, "dp": 1})


def test_sgd_momentum_is_refused_before_a_relayout_and_plain_sgd_is_not():
    """checkpoint/moments.refusal: a DeepSpeed dict with SGD momentum (a raw --ds-config; recipes build momentum 0)
    names the momentum_buffer the universal form drops; plain SGD and AdamW resume through it."""
    from harness.checkpoint.moments import refusal

    why = refusal({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}})
    assert why and "momentum 0.9" in why and "momentum_buffer" in why and "exp_avg" in why, why
    assert refusal({"optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.0}}}) is None
    assert refusal({"optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}) is None
    assert refusal({}) is None
