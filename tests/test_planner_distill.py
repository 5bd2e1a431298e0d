"""The planner with a distillation objective (train.objective gkd, distill; planner/teacher.py): the teacher's bytes
per mode written out from its shape, the logits term, the precomputed store's size and pass, the recommendation,
`harness plan --objective gkd|distill --teacher`, what it refuses, the rollouts when on-policy, and the teacher
engine's bytes against a live frozen ZeRO-3 engine on 2 ranks."""

from __future__ import annotations

import json
import math

import pytest

from harness.cli import main
from harness.model_shapes import KNOWN
from harness.planner import activations, layouts, memory, teacher
from harness.planner.inputs import Cluster, Workload
from harness.planner.params import count_params, model_shape, with_lora

STUDENT, TEACHER = dict(KNOWN["llama-3.2-1b"]), dict(KNOWN["llama-3.1-8b"])
V, H_T, L_T = 128256, 4096, 32
NORMS_T = (2 * L_T + 1) * H_T  # the teacher's norms: at or under the student's persistence threshold, whole
CLUSTER = Cluster(8, 80 * 10**9)


def load(cfg=TEACHER, **kw):
    args = {"is_student": cfg is STUDENT, "beta": 0.5, "chunk_tokens": 256, **kw}
    return teacher.teacher_load("t", cfg, STUDENT, **args)


def evaluate(stage: int, *, offload: str = "none", count=None, t=None, **work) -> dict:
    c = layouts.Candidate(f"zero{stage}", stage, offload, offload if stage == 3 else "none")
    w = Workload(1024, objective="gkd", prompt_len=512, completion_len=512, teacher=t or load(), **work)
    return layouts.evaluate(c, count or count_params(STUDENT), model_shape(STUDENT), CLUSTER, w)


def test_teacher_bytes_per_mode_equal_the_arithmetic_of_its_shape():
    p_t = count_params(TEACHER).total
    t = load(records=10_000, top_k=8)
    assert t.persistent == NORMS_T and t.params == p_t
    modes = evaluate(3, t=t)["memory"]["teacher"]["modes"]
    tokens = 1024  # micro-batch 1 x (512 + 512)
    engine = modes["engine"]
    assert engine["weights_gpu"] == 2 * math.ceil(p_t / 8) + 2 * NORMS_T  # ZeRO-3: sharded like the student
    assert engine["targets"] == tokens * V * 2 and engine["gpu"] == engine["weights_gpu"] + engine["targets"]
    assert modes["adapter"]["weights_gpu"] == 0 and not modes["adapter"]["applicable"]  # no LoRA, another model
    for mode in ("precomputed", "served"):  # top-k ids (int64) and log-probs (float32), nothing else here
        assert modes[mode]["gpu"] == modes[mode]["targets"] == tokens * (8 * (8 + 4) + 4)  # + the actual token's
    # k x (uint32 id + float32 log-prob) + the actual token's log-prob per loss token, uint64 row index
    assert modes["precomputed"]["disk_bytes"] == 10_000 * 512 * (8 * (4 + 4) + 4) + 10_001 * 8
    assert teacher.id_bytes(65_536) == 2 and teacher.id_bytes(V) == 4  # uint16 ids while the vocabulary fits
    assert modes["served"]["endpoint_bytes"] == 2 * p_t
    whole = evaluate(2, t=t)["memory"]["teacher"]["modes"]["engine"]
    assert whole["weights_gpu"] == 2 * p_t  # stages 0-2: a whole copy per rank
    host = evaluate(3, offload="cpu", t=t)["memory"]["teacher"]["modes"]["engine"]
    assert (host["weights_gpu"], host["cpu"]) == (2 * NORMS_T, 2 * math.ceil(p_t / 8))  # offload_param moves shards


def test_the_mode_used_is_in_the_totals_and_lora_self_distillation_is_free():
    engine, served = evaluate(3, t=load(mode="engine")), evaluate(3, t=load(mode="served"))
    t_engine = engine["memory"]["teacher"]["modes"]["engine"]
    assert engine["memory"]["gpu_bytes"] - served["memory"]["gpu_bytes"] == \
        t_engine["gpu"] - engine["memory"]["teacher"]["modes"]["served"]["gpu"]
    lora = with_lora(count_params(STUDENT), STUDENT, 16)
    own = evaluate(2, count=lora, t=load(STUDENT))["memory"]["teacher"]
    assert own["mode"] == own["recommended"] == "adapter" and own["modes"]["adapter"]["weights_gpu"] == 0


def test_the_logits_term_is_the_students_in_16_bit_and_one_float32_chunk():
    shape, tokens = model_shape(STUDENT), 8 * 4096
    got = activations.distill_logits_bytes(tokens, shape, 2, 256, 0.5)
    assert got == 3 * tokens * V * 2 + 11 * 256 * V * 4  # logits, their loss-token copy and gradient; one chunk
    assert got < tokens * V * 4 * 2  # never the whole B x L x V twice in float32
    assert activations.distill_logits_bytes(tokens, shape, 2, 256, 0) == 3 * tokens * V * 2 + 7 * 256 * V * 4
    acts = evaluate(2)["memory"]["activations"]
    assert acts["logits"] == activations.distill_logits_bytes(1024, shape, 2, 256, 0.5)


def test_the_recommendation_rule():
    def best(t, stage=2, count=None):
        ref = evaluate(stage, t=t, count=count)["memory"]["teacher"]
        return ref["recommended"], ref["why"]

    assert best(load())[0] == "engine"  # 16 GB of teacher fit beside a 1B student at ZeRO-2
    big = dict(KNOWN["llama-3.1-70b"])
    mode, why = best(load(big))
    assert mode == "precomputed" and "one teacher pass before training" in why  # 141 GB whole: not beside it
    on_policy = load(big, on_policy=True, lmbda=0.5)
    mode, why = best(on_policy)
    assert mode is None and "nothing to precompute" in why and "--teacher-mode served" in why  # never picked for you
    whole = evaluate(2, t=on_policy)
    assert not whole["fits"] and whole["why_not"].startswith("teacher: its engine does not fit beside the student")
    assert best(on_policy, stage=3)[0] == "engine"  # ZeRO-3: 17.6 GB per rank
    served = evaluate(2, t=load(big, on_policy=True, lmbda=0.5, mode="served"))
    assert served["fits"] and served["memory"]["teacher"]["mode"] == "served"  # asked for: an endpoint's GPUs


def test_step_time_counts_the_teacher_forward_and_the_store_pass():
    from harness.planner import hardware

    profile = hardware.load("h100-80gb-sxm")
    work = Workload(1024, objective="gkd", prompt_len=512, completion_len=512,
                    teacher=load(mode="engine", records=1000), global_batch=8)
    c = layouts.Candidate("zero2", 2, "none", "none")
    count, shape = count_params(STUDENT), model_shape(STUDENT)
    result = layouts.evaluate(c, count, shape, CLUSTER, work)
    from harness.planner import steptime

    t = steptime.step_time(c, count, shape, profile, CLUSTER, work, result)
    b = t["breakdown"]
    assert b["teacher_s"] == pytest.approx(b["forward_s"] * count_params(TEACHER).total / count.total)
    flops = hardware.achieved_flops(profile, "bf16")
    assert t["teacher_pass_s"] == pytest.approx(2 * count_params(TEACHER).total * 1000 * 1024 / (8 * flops))


PLAN = ["plan", "--model", "llama-3.2-1b", "--gpus", "8", "--gpu-mem", "80GB", "--teacher", "llama-3.1-8b"]


def test_plan_gkd_prints_the_teacher_and_the_rollouts_when_on_policy(capsys):
    assert main([*PLAN, "--objective", "gkd", "--lmbda", "0", "--records", "1000", "--loss-top-k", "4"]) == 0
    text = capsys.readouterr().out
    # the completion: TRL GKDConfig's max_new_tokens 128 (distill_rules.settings), the prompt rl's default 512
    assert ("objective gkd: the micro batch counts completions, 1 per micro-step, each 512 prompt + 128 completion "
            "= 640 tokens; completions: the dataset's (off-policy)") in text
    assert "teacher   llama-3.1-8b: 8.03 B params, vocab 128256; loss top-k 4" in text
    assert "  teacher (gkd): engine: its weights fit beside the student" in text and "Rollouts" not in text
    assert f"store {(1000 * 128 * (4 * 8 + 4) + 1001 * 8) / 1e6:.1f} MB on disk; one pass up front" in text
    assert main([*PLAN, "--objective", "gkd", "--json"]) == 0  # TRL's lmbda 0.5: on-policy half the time
    plan = json.loads(capsys.readouterr().out)
    ref = plan["recommended"]["memory"]["teacher"]
    assert ref["on_policy"] and ref["lmbda"] == 0.5 and not ref["modes"]["precomputed"]["applicable"]
    assert plan["rollouts"]["lmbda"] == 0.5 and plan["rollouts"]["kv_cache_bytes"] > 0
    assert main([*PLAN, "--objective", "distill"]) == 0
    text = capsys.readouterr().out
    assert "completions: the student's own samples (on-policy)" in text
    assert "completions per rank per step, the student's, every micro-batch;" in text


@pytest.mark.parametrize("args, message", [
    (["--objective", "gkd", "--teacher", "qwen2.5-7b"], "its vocabulary (152064) is not the student's (128256)"),
    (["--objective", "distill", "--teacher-mode", "precomputed"], "the completions are generated during training"),
    (["--objective", "gkd", "--teacher-mode", "served", "--loss-top-k", "8"], "with beta > 0 and k > 1"),
    (["--objective", "gkd", "--teacher-mode", "adapter", "--lmbda", "0"], "it needs LoRA (--lora-r)"),
    (["--objective", "gkd", "--lmbda", "1.5"], "--lmbda 1.5: must be in [0, 1]"),
    (["--objective", "gkd", "--reference-mode", "engine"], "a distillation run has a teacher, not a reference"),
    (["--objective", "gkd", "--seq-len", "4096"], "give --max-prompt-length and --max-completion-length"),
    (["--objective", "dpo"], "--teacher plan a distillation run: add --objective gkd"),
    (["--objective", "gkd", "--lmbda", "0", "--generator", "vllm"], "and lmbda 0: the student generates nothing"),
    (["--objective", "distill", "--vllm-gpu-memory-utilization", "0"], "a share of the GPU, in (0, 1]"),
])
def test_plan_distill_refuses_what_a_run_refuses(capsys, args, message):
    assert main([*PLAN, *args]) == 2
    assert message in capsys.readouterr().err


def test_served_with_beta_0_takes_any_top_k(capsys):
    assert main([*PLAN, "--objective", "gkd", "--teacher-mode", "served", "--loss-top-k", "8", "--beta", "0",
                 "--json"]) == 0
    ref = json.loads(capsys.readouterr().out)["recommended"]["memory"]["teacher"]
    assert ref["mode"] == "served" and ref["modes"]["served"]["weights_gpu"] == 0


def test_plan_distill_prices_vllm_as_grpo_does(capsys):
    """distill.use_vllm as `--generator vllm`: the rollouts' vLLM term is grpo's (planner/rl.rollout_plan, one
    source): the student's 16-bit weights + its KV cache, against --vllm-gpu-memory-utilization of the GPU; a share
    too small for them is named by the distill block's key."""
    lengths = ["--max-prompt-length", "256", "--max-completion-length", "384", "--generator", "vllm",
               "--vllm-gpu-memory-utilization", "0.02", "--json"]
    plans = {}
    for goal in ("distill", "grpo"):
        args = [*PLAN, "--objective", goal, *lengths] if goal == "distill" else [*PLAN[:7], "--objective", goal,
                                                                               "--num-generations", "1", *lengths]
        assert main(args) == 0
        plans[goal] = json.loads(capsys.readouterr().out)["rollouts"]
    kd, rl = plans["distill"], plans["grpo"]
    shape = model_shape(STUDENT)
    kv = 2 * shape.num_hidden_layers * shape.num_key_value_heads * shape.head_dim * (256 + 384) * kd["sequences_per_rank"] * 2
    assert kd["kv_cache_bytes"] == kv and kd["vllm"]["budget_bytes"] == int(0.02 * 80 * 10**9)
    assert kd["vllm"]["bytes"] == 2 * count_params(STUDENT).total + kv
    assert {k: kd["vllm"][k] for k in ("bytes", "budget_bytes", "decode_s")} == \
        {k: rl["vllm"][k] for k in ("bytes", "budget_bytes", "decode_s")}
    assert "set distill.vllm_gpu_memory_utilization=0.1 (now 0.02)" in kd["recommend"]
    assert "set rl.vllm_gpu_memory_utilization=0.1 (now 0.02)" in rl["recommend"]


@pytest.mark.multirank
def test_teacher_engine_bytes_equal_the_live_engines(distill_runs, capsys):
    """A gkd run's teacher, built as its engine mode builds it (reference_engine.build_engine from the resolved
    run: a folder model, no optimizer, the student's ZeRO-3 keys) on 2 CPU ranks, holds per rank the bytes
    `harness plan --objective gkd --teacher FOLDER --zero 3` counts: its partitions plus the tensors under the
    student's persistence threshold whole; after a no_grad forward nothing stays gathered, and in the forwards after
    it (DeepSpeed's trace complete) no more than one decoder layer is gathered at once (its prefetch ran ahead of the
    forward and gathered half the teacher: engine_config turns it off in a frozen engine)."""
    where = distill_runs.root / "bytes"  # a case of the distillation tests' shared launch (distill_launch.py)
    folder = str(where / "teacher")
    capsys.readouterr()
    assert main(["plan", "--model", "tiny-llama", "--gpus", "2", "--gpu-mem", "8GB", "--objective", "gkd",
                 "--teacher", folder, "--teacher-mode", "engine", "--zero", "3", "--precision", "fp32",
                 "--lmbda", "0", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)["evaluated"]["memory"]["teacher"]
    engine = planned["modes"]["engine"]
    for rank in (0, 1):
        live = json.loads((where / f"bytes.json.rank{rank}").read_text())
        held = live["held"]["partitioned"] + live["held"]["whole"]
        assert live["stage"] == 3 and live["params"] == planned["params"]
        # DeepSpeed pads each tensor's partition to a multiple of the world: at most 1 element per tensor more
        assert 0 <= held - engine["weights_gpu"] <= 4 * 64, (rank, held, engine)
        assert live["held"]["whole"] > 0 and live["held"]["partitioned"] < 4 * live["params"]  # sharded, norms whole
        assert live["after_forward"]["gathered"] == 0, live["after_forward"]
        assert 0 < live["peak_gathered"] <= live["layer_bytes"], live
        print(f"rank {rank}: teacher engine {held} B, planner {engine['weights_gpu']} B "
              f"(threshold {live['threshold']})")


def test_recipe_auto_plans_the_teacher_the_run_will_hold():
    """`--recipe auto` with gkd gives the planner the run's teacher in the mode the run resolves (auto: an engine of
    distill.teacher_model_name_or_path): a 70B teacher's whole copy fits no ZeRO-1/2 layout, so the planner goes to
    ZeRO-3, where the teacher shards like the student; the same student alone stays below ZeRO-3."""
    from harness.config.recipes import complete
    from harness.planner import hardware
    from harness.train.auto_recipe import plan_for

    hw = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_bytes": 80 * 10**9, "cpu_mem_bytes": 2000 * 10**9,
          "nvme_bytes": None, "device": "cuda"}

    def auto(*overrides):
        settings = complete({"description": "auto"}, "--recipe auto",
                            ["train.model=llama-3.2-1b", "precision=bf16", "train.seq_len=1024", *overrides])
        return plan_for(settings, hw, hardware.load("h100-80gb-sxm"))

    lm = auto()
    gkd = auto("train.objective=gkd", "distill.teacher_model_name_or_path=llama-3.1-70b", "distill.lmbda=0")
    t = gkd.workload.teacher
    assert (t.name, t.mode, t.on_policy, t.beta, t.chunk_tokens) == ("llama-3.1-70b", "engine", False, 0.5, 256)
    assert lm.recommended["zero_stage"] < 3 and gkd.recommended["zero_stage"] == 3
    used = gkd.recommended["memory"]["teacher"]
    assert used["mode"] == "engine" and used["modes"]["engine"]["weights_gpu"] < 2 * t.params / 7
    assert all(r["memory"]["teacher"]["modes"]["engine"]["weights_gpu"] == 2 * t.params
               for r in gkd.candidates if r["zero_stage"] < 3)


def test_a_runs_own_prediction_prices_its_completions_and_teacher():
    """A grpo or gkd run predicts itself (planner.evaluate of its RunModel: what the report sets beside the measured
    run) with the workload `harness plan` prices: grpo's rows of rl.max_prompt_length + rl.max_completion_length
    tokens (not train.seq_len) and a reference only with beta > 0; gkd's teacher in the mode the run resolves."""
    from harness.config.recipes import load_recipe
    from harness.config.run_model import RunModel
    from harness.config.validate import check_recipe, context, strip_annotations
    from harness.model_shapes import PRESETS
    from harness.planner import evaluate, hardware

    def predict(*overrides):
        recipe, source = load_recipe("zero3", ["train.model=tiny-llama", "train.seq_len=256", *overrides])
        ds = strip_annotations(check_recipe(recipe, context(recipe, 2), source).ds_config)
        run = RunModel.from_resolved(recipe, ds, 2, dict(PRESETS["tiny-llama"]))
        return run, evaluate(run, Cluster(2, 8 * 10**9), hardware.load("h100-80gb-sxm"))

    rl = ["train.objective=grpo", "rl.max_prompt_length=24", "rl.max_completion_length=40"]
    run, own = predict(*rl)
    assert (run.completions.prompt_len, run.completions.completion_len, run.completions.reference_mode) == (24, 40, None)
    assert own.layout["memory"]["activations"]["tokens_per_rank"] == run.batch.micro_batch * 64
    assert own.layout["memory"]["reference"]["mode"] is None
    _, with_ref = predict(*rl, "rl.beta=0.04")
    assert with_ref.layout["memory"]["reference"]["mode"] == "engine" and "reference_s" in with_ref.time["breakdown"]
    run, own = predict("train.objective=gkd", "distill.lmbda=0")
    t = own.layout["memory"]["teacher"]
    assert run.completions.teacher == "tiny-llama" and t["mode"] == t["recommended"] == "engine"  # no LoRA: a copy
    assert t["params"] == count_params(dict(PRESETS["tiny-llama"])).total and own.time["breakdown"]["teacher_s"] > 0
    acts = own.layout["memory"]["activations"]
    assert acts["logits"] == activations.distill_logits_bytes(acts["tokens_per_rank"], model_shape(
        dict(PRESETS["tiny-llama"])), 2, run.completions.chunk_tokens, 0.5)  # gkd's beta 0.5 (TRL's), bf16
    # this rank's own prediction (the report's per-rank peak): the teacher engine's ZeRO-3 share, and grpo's
    # reference engine at beta > 0, in its peak; the live facts are the student's
    from harness.planner.rank import LiveFacts

    count = count_params(dict(PRESETS["tiny-llama"]))
    threshold = run.zero.buckets.param_persistence_threshold
    live = LiveFacts(total=count.total, largest_layer=count.largest_layer, largest_tensor=count.largest_tensor,
                     persistent=count.persistent_numel(threshold))
    rank = evaluate(run, live=live).rank
    assert rank["teacher"]["gpu"] == 2 * math.ceil(count.total / 2) + 2 * count.persistent_numel(threshold)
    rl_run, _ = predict(*rl, "rl.beta=0.04")
    assert evaluate(rl_run, live=live).rank["reference"]["gpu"] == rank["teacher"]["gpu"]  # the same model, frozen
