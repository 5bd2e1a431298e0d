"""The planner with a preference objective (train.objective dpo, ipo, simpo, orpo): the reference's bytes per mode
written out from the model's shape, two sequences per pair in the activations and the step time, the recommendation
rule, `harness plan --objective`, the run's RunModel.preference, and lm plans left as they were."""

from __future__ import annotations

import json
import math

import pytest

from harness.model_shapes import KNOWN
from harness.planner import layouts, memory, reference, steptime
from harness.planner.inputs import Cluster, Workload
from harness.planner.params import count_params, model_shape, with_lora

CFG = dict(KNOWN["llama-2-7b"])
H, FF, V, L = 4096, 11008, 32000, 32
# llama-2-7b from its shape: embedding and untied head, per block q/k/v/o, gate/up/down and two norms, final norm
P = 2 * V * H + L * (4 * H * H + 3 * H * FF + 2 * H) + H
NORMS = (2 * L + 1) * H  # the tensors under ZeRO-3's persistence threshold, kept whole on every rank
CLUSTER = Cluster(8, 80 * 10**9)


def evaluate(stage: int, *, offload: str = "none", mode: str | None = None, objective: str = "dpo",
             count=None, **work) -> dict:
    c = layouts.Candidate(f"zero{stage}", stage, offload, offload if stage == 3 else "none")
    w = Workload(4096, objective=objective, reference_mode=mode, **work)
    return layouts.evaluate(c, count or count_params(CFG), model_shape(CFG), CLUSTER, w)


def test_engine_and_precomputed_bytes_equal_the_arithmetic_of_the_shape():
    assert count_params(CFG).total == P
    threshold = memory.harness_buckets(H).param_persistence_threshold
    assert H <= threshold < H * H  # the norms persist, no matrix does
    modes = evaluate(3, pairs=60_000)["memory"]["reference"]["modes"]
    assert modes["engine"] == {"gpu": 2 * math.ceil(P / 8) + 2 * NORMS, "cpu": 0, "nvme": 0, "fits": True,
                               "applicable": True}
    assert modes["precomputed"] == {"gpu": 0, "cpu": 16 * 60_000, "nvme": 0, "fits": True,
                                    "applicable": True}  # float64 x (chosen, rejected) per pair
    assert modes["adapter"] == {"gpu": 0, "cpu": 0, "nvme": 0, "fits": False, "applicable": False}  # no LoRA
    whole = evaluate(2)["memory"]["reference"]["modes"]["engine"]
    assert (whole["gpu"], whole["cpu"]) == (2 * P, 0)  # stages 0-2: a whole 16-bit copy per rank
    host = evaluate(3, offload="cpu")["memory"]["reference"]["modes"]["engine"]
    assert (host["gpu"], host["cpu"]) == (2 * NORMS, 2 * math.ceil(P / 8))  # offload_param moves the shards
    fp32 = evaluate(2, precision="fp32")["memory"]["reference"]["modes"]["engine"]
    assert fp32["gpu"] == 4 * P


def test_the_mode_used_is_in_the_totals_and_lora_has_a_free_reference():
    engine, precomputed = evaluate(3, mode="engine"), evaluate(3, mode="precomputed", pairs=10**6)
    assert engine["memory"]["gpu_bytes"] - precomputed["memory"]["gpu_bytes"] == 2 * math.ceil(P / 8) + 2 * NORMS
    assert precomputed["memory"]["cpu_bytes_per_node"] - engine["memory"]["cpu_bytes_per_node"] == 8 * 16 * 10**6
    lora = with_lora(count_params(CFG), CFG, 16)
    ref = evaluate(2, count=lora)["memory"]["reference"]
    assert ref["mode"] == ref["recommended"] == "adapter" and ref["modes"]["adapter"]["gpu"] == 0
    assert ref["base_params"] == P  # the reference has no adapters
    assert evaluate(2, objective="simpo")["memory"]["reference"]["mode"] is None


def test_two_sequences_per_pair_in_activations_and_the_logits_of_2b_rows():
    shape, w = model_shape(CFG), Workload(4096, micro_batch=1)
    pair = memory.activation_bytes(shape, w.but(objective="dpo"))
    lm_two = memory.activation_bytes(shape, w.but(micro_batch=2))
    assert pair["tokens_per_rank"] == 2 * 4096 and pair["layers"] == lm_two["layers"]
    # the 16-bit logits of both rows and their gradient; one row up-cast to fp32 and exponentiated at a time
    assert pair["logits"] == 2 * (2 * 4096) * V * 2 + 2 * 4096 * V * 4


def test_step_time_counts_the_reference_forward_or_the_pass_up_front():
    from harness.planner import hardware

    profile, count, shape = hardware.load("a100-80gb-sxm"), count_params(CFG), model_shape(CFG)
    c = layouts.Candidate("zero3", 3)
    for mode in ("engine", "precomputed"):
        work = Workload(4096, objective="dpo", reference_mode=mode, pairs=60_000, global_batch=16, grad_accum=2)
        result = layouts.evaluate(c, count, shape, CLUSTER, work)
        t = steptime.step_time(c, count, shape, profile, CLUSTER, work, result)
        lm = steptime.step_time(c, count, shape, profile, CLUSTER, work.but(objective=None, micro_batch=2,
                                                                            global_batch=32), result)
        assert t["breakdown"]["forward_s"] == pytest.approx(lm["breakdown"]["forward_s"])  # 2 rows per pair
        if mode == "engine":
            assert t["breakdown"]["reference_s"] == t["breakdown"]["forward_s"]
        else:
            assert "reference_s" not in t["breakdown"]
        # the pass up front (in no step; shown for every mode): 60,000 pairs over 8 ranks, one pair per forward
        assert t["reference_pass_s"] == pytest.approx(60_000 / 8 * t["breakdown"]["forward_s"] / 2)


def test_the_recommendation_rule():
    fits = {"precomputed": True, "engine": True, "adapter": False}
    w = Workload(objective="dpo", global_batch=8)
    assert reference.recommend("orpo", False, w, fits)[0] is None
    assert reference.recommend("dpo", True, w, fits)[0] == "adapter"
    assert reference.recommend("dpo", False, w, fits)[0] == "precomputed"  # steps not given: every pair once
    assert reference.recommend("dpo", False, w.but(pairs=800, steps=100), fits)[0] == "precomputed"  # 800 trained
    assert reference.recommend("dpo", False, w.but(pairs=801, steps=100), fits)[0] == "engine"  # fewer than the set
    assert reference.recommend("dpo", False, w.but(pairs=801, steps=100), {**fits, "engine": False})[0] == \
        "precomputed"
    assert reference.recommend("dpo", False, w, {**fits, "precomputed": False})[0] == "engine"


def test_layouts_a_preference_objective_refuses():
    for c in (layouts.Candidate("tp", 1, tp=2), layouts.Candidate("pipeline", 1, pp=2),
              layouts.Candidate("zero3", 3, sp=2, tiled=True, act="checkpoint")):
        r = layouts.evaluate(c, count_params(CFG), model_shape(CFG), CLUSTER, Workload(4096, objective="dpo"))
        assert not r["applicable"] and r["why_not"].startswith("objective dpo refuses")


def run_plan(args: list[str], capsys) -> tuple[int, str]:
    from harness.cli import main

    code = main(["plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu-mem", "80GB", "--seq-len", "4096", *args])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


def test_harness_plan_objective_dpo_renders_the_reference(capsys):
    code, out = run_plan(["--objective", "dpo", "--pairs", "60000", "--zero", "3"], capsys)
    assert code == 0
    assert "objective dpo: the micro batch counts pairs, 2 sequences" in out
    assert "reference (dpo): precomputed" in out and "one pass up front" in out
    engine = f"{2 * math.ceil(P / 8) + 2 * NORMS:,}"
    code, out = run_plan(["--objective", "dpo", "--reference-mode", "engine", "--zero", "3", "--json"], capsys)
    plan = json.loads(out)
    ref = plan["evaluated"]["memory"]["reference"]
    assert code == 0 and ref["mode"] == "engine" and f"{ref['modes']['engine']['gpu']:,}" == engine
    assert plan["evaluated"]["time"]["breakdown"]["reference_s"] > 0
    code, out = run_plan(["--objective", "dpo", "--lora-r", "16"], capsys)
    assert code == 0 and "reference (dpo): adapter" in out and "ref-fwd" in out


@pytest.mark.parametrize("args, message", [
    (["--objective", "dpo", "--reference-mode", "adapter"], "needs LoRA"),
    (["--objective", "simpo", "--reference-mode", "engine"], "simpo has no reference model"),
    (["--pairs", "100"], "add --objective dpo"),
])
def test_harness_plan_refuses_what_a_run_refuses(capsys, args, message):
    code, out = run_plan(args, capsys)
    assert code == 2 and message in out and "Traceback" not in out


def test_lm_plans_carry_no_preference_fields(capsys):
    code, out = run_plan(["--json"], capsys)
    plan = json.loads(out)
    assert code == 0 and "reference" not in out and "objective" not in plan["workload"]
    assert all("reference" not in r["memory"] for r in plan["candidates"])
    assert "reference_s" not in plan["recommended"]["time"]["breakdown"]


@pytest.mark.parametrize("overrides, mode", [([], "precomputed"), (["adapter.type=lora"], "adapter"),
                                             (["preference.reference_mode=engine"], "engine"),
                                             (["train.objective=orpo"], None)])
def test_run_model_resolves_the_reference_mode(overrides, mode):
    from harness.config.recipes import load_recipe
    from harness.config.run_model import RunModel
    from harness.config.validate import check_recipe, context, strip_annotations
    from harness.model_shapes import PRESETS
    from harness.planner import evaluate
    from harness.planner.rank import LiveFacts

    recipe, source = load_recipe("zero2", ["train.model=tiny-llama", "train.objective=dpo", *overrides])
    ds = strip_annotations(check_recipe(recipe, context(recipe, 2), source).ds_config)
    cfg = dict(PRESETS["tiny-llama"])
    run = RunModel.from_resolved(recipe, ds, 2, cfg)
    assert run.preference.reference_mode == mode and run.preference.beta == 0.1
    # the run's own prediction: two sequences per pair, an engine's frozen weights in its peak
    count = count_params(cfg)
    live = LiveFacts(total=count.total, largest_layer=count.largest_layer, largest_tensor=count.largest_tensor)
    own = evaluate(run, live=live).rank
    assert own["activations"]["tokens_per_rank"] == 2 * run.batch.micro_batch * run.sequence.seq_len
    assert own.get("reference") == (reference.engine_bytes(count.total, stage=2, offload_param="none", zero_shards=2,
                                                           precision=run.precision) if mode == "engine" else None)
    lm, source = load_recipe("zero2", ["train.model=tiny-llama"])
    assert RunModel.from_resolved(lm, ds, 2, {}).preference is None


@pytest.mark.multirank
def test_reference_engine_bytes_equal_the_live_engines(tmp_path):
    """A frozen reference engine (deepspeed.initialize, no optimizer) on 2 CPU ranks holds the bytes the planner
    counts: ZeRO-3 its partitions plus the persistent tensors whole, stage 0 a whole copy (tests/drivers/
    reference_bytes.py); after a no_grad forward ZeRO-3 holds nothing gathered."""
    from helpers.launch import launch

    out = tmp_path / "bytes.json"
    launch(str(out), script="tests/drivers/reference_bytes.py", timeout_s=240)
    for rank in (0, 1):
        results = json.loads((tmp_path / f"bytes.json.rank{rank}").read_text())
        z3, z0 = results["zero3"], results["zero0"]
        held = z3["held"]["partitioned"] + z3["held"]["whole"]
        # DeepSpeed pads each tensor's partition to a multiple of the world: at most 1 element per tensor more
        assert 0 <= held - z3["planned"]["gpu"] <= 4 * 64, (rank, held, z3["planned"])
        assert z3["held"]["whole"] > 0 and z3["held"]["partitioned"] < 4 * z3["params"]  # sharded, norms whole
        assert z3["after_forward"]["gathered"] == 0, z3["after_forward"]
        assert z0["held"]["whole"] == z0["planned"]["gpu"] == 4 * z0["params"]
        print(f"rank {rank}: zero3 engine {held} B, planner {z3['planned']['gpu']} B; zero0 {z0['held']['whole']} B")


def test_recipe_auto_plans_the_preference_run_it_will_train():
    """`--recipe auto` with a preference objective gives the planner the pairs (two sequences each) and the
    reference: it never picks a layout the run refuses (sp here, as tp and pp), and a pair's peak is above a
    sequence's."""
    from harness.config.recipes import complete
    from harness.planner import hardware
    from harness.train.auto_recipe import plan_for

    hw = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_bytes": 80 * 10**9, "cpu_mem_bytes": 2000 * 10**9,
          "nvme_bytes": None, "device": "cpu"}
    profile = hardware.load("h100-80gb-sxm")

    def auto(*overrides):
        return plan_for(complete({"description": "auto"}, "--recipe auto", ["train.model=llama-3.1-8b", "precision=bf16",
                                                                          "batch.micro_batch_per_gpu=1", *overrides]),
                        hw, profile)

    long_lm, long_dpo = auto("train.seq_len=90112"), auto("train.seq_len=90112", "train.objective=dpo")
    assert long_lm.recommended["sp"] > 1  # the long-context rung for one sequence
    assert all(r["sp"] == r["tp"] == r["pp"] == 1 for r in long_dpo.candidates + long_dpo.ranked if r["fits"])
    assert long_dpo.recommended is None and "tokens" in long_dpo.missing[0]  # --recipe auto: exit 2, the reason
    assert any("objective dpo refuses tensor parallel" in (r["why_not"] or "") for r in long_dpo.candidates)
    lm, dpo = auto("train.seq_len=2048"), auto("train.seq_len=2048", "train.objective=dpo")
    assert lm.recommended["label"] == dpo.recommended["label"] == "zero1"
    acts = [r.recommended["memory"]["activations"] for r in (lm, dpo)]
    assert acts[1]["tokens_per_rank"] == 2 * acts[0]["tokens_per_rank"] == 4096  # a pair: chosen and rejected
    assert dpo.recommended["memory"]["gpu_bytes"] > lm.recommended["memory"]["gpu_bytes"] + acts[0]["layers"]
