"""The planner: parameter counts, per-rank memory, traffic per step, the CLI (pure: no process group)."""

import json
import subprocess
import sys

import pytest

from harness.commands import plan as plan_cmd
from harness.errors import UsageError
from harness.model_shapes import KNOWN, PRESETS
from harness.planner import plan
from harness.planner.comm import comm_bytes_per_step, wire_bytes
from harness.config.run_model import ZeroBuckets
from harness.planner.inputs import Cluster, LongContext, Workload
from harness.config.run_model import Zero
from harness.planner.memory import (Holding, activation_bytes, by_device, harness_buckets, model_state_bytes,
                                    training_peak)
from harness.planner.pipeline import bubble_fraction
from harness.planner.params import closed_form_count, count_params, meta_count, model_shape
from harness.planner.render import to_json, to_text
from helpers.plan import run_plan

GB, GIB = 10**9, 2**30


def gpu_total(terms):
    return by_device(terms)["gpu"]


# --- the seeds' worked example ------------------------------------------------------------------

def test_seed_example_7b_on_8_gpus():
    """16 B/param: 7B -> 112 GB per GPU under data parallel, 14 GB per GPU under ZeRO-3 on 8."""
    ddp = model_state_bytes(Holding(7 * 10**9), Zero(0), zero_shards=8, precision="bf16", convention="seed")
    z3 = model_state_bytes(Holding(7 * 10**9), Zero(3), zero_shards=8, precision="bf16", convention="seed")
    assert gpu_total(ddp) == 112 * GB
    assert gpu_total(z3) == 14 * GB
    assert {t: v["gpu"] for t, v in ddp.items() if v["gpu"]} == {
        "params": 14 * GB, "grads": 14 * GB, "fp32_master": 28 * GB, "optimizer_moments": 56 * GB}


def test_seed_example_in_the_plan_of_a_7b_model():
    cfg = dict(KNOWN["llama-2-7b"])
    result = plan(cfg, Cluster(gpus_per_node=8, gpu_mem_bytes=80 * GB), Workload(), model_name="llama-2-7b")
    p = result.model["params"]["total"]
    assert result.seed["dp_bytes_per_gpu"] == 16 * p
    assert result.seed["zero3_bytes_per_gpu"] == 2 * p
    text = to_text(result)
    assert "DP 107.8 GB per GPU; ZeRO-3 over 8 GPUs 13.5 GB per GPU" in text


def test_seed_rule_is_16_bytes_per_param_in_fp32_too():
    terms = model_state_bytes(Holding(1000), Zero(0), zero_shards=1, precision="fp32", convention="seed")
    assert gpu_total(terms) == 16 * 1000 and terms["fp32_master"]["gpu"] == 0


# --- parameter counts ---------------------------------------------------------------------------

SHAPES = {**PRESETS, **KNOWN}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_closed_form_count_equals_what_transformers_builds_on_meta(name):
    fast, exact = closed_form_count(SHAPES[name]), meta_count(SHAPES[name])
    assert exact.method == "meta-device"
    for field in ("total", "num_layers", "per_layer", "embedding", "lm_head", "other", "largest_layer",
                  "largest_tensor", "tensor_sizes"):
        assert getattr(fast, field) == getattr(exact, field), field


@pytest.mark.parametrize("name, total", [
    ("gpt2", 124_439_808), ("gpt2-xl", 1_557_611_200), ("llama-2-7b", 6_738_415_616),
    ("llama-2-70b", 68_976_648_192), ("llama-3-8b", 8_030_261_248), ("mistral-7b", 7_241_732_096),
    ("llama-3.2-1b", 1_235_814_400),
])
def test_known_models_have_their_published_parameter_counts(name, total):
    assert count_params(KNOWN[name]).total == total


def test_unknown_family_is_counted_on_the_meta_device():
    cfg = {"model_type": "gpt_neox", "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 2,
           "num_attention_heads": 4, "intermediate_size": 128}
    count = count_params(cfg)
    assert count.method == "meta-device" and count.num_layers == 2 and count.total > 0
    result = plan(cfg, Cluster(gpus_per_node=1, gpu_mem_bytes=16 * GB), Workload(), model_name="neox-tiny")
    assert result.recommended["recipe"] == "ddp"


def test_largest_layer_is_deepspeeds_largest_module():
    count = count_params(KNOWN["llama-2-7b"])
    assert count.largest_layer == 32000 * 4096  # embedding / lm_head
    assert count.persistent_numel(10 * 4096) == (2 * 32 + 1) * 4096  # the RMSNorm weights


def test_model_config_without_model_type_is_a_usage_error():
    with pytest.raises(UsageError, match="model_type"):
        meta_count({"hidden_size": 8})


# --- model states: measured live-engine bytes (docs/deepspeed-facts.md) ---------------------------

TINY_GPT2_087M = {"model_type": "gpt2", "vocab_size": 512, "n_embd": 128, "n_layer": 4, "n_head": 4,
                  "n_positions": 128}


@pytest.mark.parametrize("stage, zero_shards, precision, per_param", [
    (0, 2, "bf16", 14.0), (1, 2, "bf16", 8.0), (2, 2, "bf16", 8.0), (2, 2, "fp32", 10.0),
])
def test_after_step_bytes_match_the_live_engine_measurements(stage, zero_shards, precision, per_param):
    terms = model_state_bytes(Holding(1_000_000), Zero(stage), zero_shards=zero_shards, precision=precision,
                              phase="after_step")
    assert gpu_total(terms) / 1_000_000 == pytest.approx(per_param, rel=1e-6)


@pytest.mark.parametrize("reduce_bucket, per_param", [(500_000, 11.2), (500_000_000, 1163)])
def test_zero3_after_step_includes_its_fixed_bucket(reduce_bucket, per_param):
    count = count_params(TINY_GPT2_087M)
    buckets = ZeroBuckets(reduce_bucket_elems=reduce_bucket)
    held = Holding(count.total, count.largest_layer,
                   persistent=count.persistent_numel(buckets.param_persistence_threshold))
    terms = model_state_bytes(held, Zero(3, buckets=buckets), zero_shards=2, precision="bf16", phase="after_step")
    assert gpu_total(terms) / count.total == pytest.approx(per_param, rel=0.02)
    assert terms["reduce_buckets"]["gpu"] == 2 * reduce_bucket


def test_zero2_step_matches_deepspeeds_estimator_for_llama2_7b_on_8_plus_its_flat_copy():
    """DeepSpeed's estimator: 2P + 18P/N = 26.67 GiB. Inside the step ZeRO also holds the 16-bit flat copy of the
    gradient partition it upcasts (2P/N, measured on CPU ranks: bench/scale.py) and one parameter's gradient;
    the reduce buckets are backward's only."""
    count = count_params(KNOWN["llama-2-7b"])
    held = Holding(count.total, largest_tensor=count.largest_tensor)
    common = dict(zero_shards=8, precision="bf16")
    zero = Zero(2, buckets=harness_buckets(4096))
    step = model_state_bytes(held, zero, phase="step", **common)
    flat, one_grad = 2 * count.total / 8, 2 * count.largest_tensor
    assert gpu_total(step) == pytest.approx(26.67 * GIB + flat + one_grad, rel=0.005)
    backward = model_state_bytes(held, zero, phase="backward", **common)
    assert gpu_total(step) - gpu_total(backward) == pytest.approx(
        (4 + 2) * count.total / 8 - 2 * 2 * 4096**2, rel=1e-6)  # fp32 + flat partition, less the two buckets


def test_training_peak_is_backward_with_activations_or_the_step_whichever_is_larger():
    count = count_params(KNOWN["llama-2-7b"])

    def states(phase):
        return model_state_bytes(Holding(count.total, largest_tensor=count.largest_tensor),
                                 Zero(1, buckets=harness_buckets(4096)), zero_shards=8, precision="bf16", phase=phase)

    backward, step = gpu_total(states("backward")), gpu_total(states("step"))
    assert step > backward  # the fp32 and 16-bit flat gradient partitions
    assert training_peak(states, 0) == step
    big = step - backward + GIB
    assert training_peak(states, big) == backward + big
    assert training_peak(states, 0) < gpu_total(states("peak"))  # every term at its peak overcounts


def test_offload_moves_optimizer_terms_to_cpu_and_nvme():
    z2 = model_state_bytes(Holding(8000), Zero(2, "cpu"), zero_shards=2, precision="bf16")
    assert z2["fp32_master"] == {"gpu": 0, "cpu": 4 * 4000, "nvme": 0}
    assert z2["optimizer_moments"]["cpu"] == 8 * 4000 and z2["fp32_grads"]["cpu"] == 4 * 4000
    inf = model_state_bytes(Holding(8000), Zero(3, "nvme", "nvme"), zero_shards=2, precision="bf16")
    assert inf["params"]["nvme"] == 2 * 4000 and inf["optimizer_moments"]["nvme"] == 8 * 4000
    assert inf["offload_buffers"]["cpu"] > 0 and inf["fp32_master"]["gpu"] == 0


def test_offload_param_needs_stage_3():
    with pytest.raises(ValueError, match="needs ZeRO stage 3"):
        model_state_bytes(Holding(10), Zero(2, "cpu", "cpu"), zero_shards=2, precision="bf16")


def test_harness_buckets_follow_hidden_size():
    b = harness_buckets(4096)
    assert (b.reduce_bucket_elems, b.prefetch_bucket_elems, b.param_persistence_threshold) == (
        4096**2, int(0.9 * 4096**2), 40960)


# --- activations --------------------------------------------------------------------------------

def test_activation_checkpointing_keeps_block_inputs_only():
    shape = model_shape(KNOWN["llama-2-7b"])
    full = activation_bytes(shape, Workload(2048, 1, "bf16", False))
    ckpt = activation_bytes(shape, Workload(2048, 1, "bf16", True))
    assert ckpt["layers"] == 32 * 2048 * 4096 * 2 and ckpt["recompute"] == full["per_layer"]
    assert full["per_layer"] == 2048 * 2 * (6 * 4096 + 2 * 4096 + 4 * 11008)
    assert ckpt["total"] < full["total"] / 5


def test_tensor_parallel_splits_the_split_activations_only():
    shape = model_shape(KNOWN["llama-2-7b"])
    one = activation_bytes(shape, Workload(1024, 1, "bf16", False))
    two = activation_bytes(shape, Workload(1024, 1, "bf16", False), tp=2)
    replicated = 1024 * 2 * 4 * 4096
    assert two["per_layer"] - replicated == (one["per_layer"] - replicated) // 2


# --- communication ------------------------------------------------------------------------------

P = 536_064  # the facts' tiny GPT-2


def test_comm_bytes_as_the_comms_logger_records_them():
    assert comm_bytes_per_step(P, stage=0, zero_shards=2, precision="bf16") == {"all_reduce": 2 * P}
    assert comm_bytes_per_step(P, stage=1, zero_shards=2, precision="bf16", grad_accum=2) == {
        "all_reduce": 2 * P, "all_gather_into_tensor": P}
    assert comm_bytes_per_step(P, stage=2, zero_shards=2, precision="bf16", grad_accum=2)["all_reduce"] == 4 * P
    z3 = comm_bytes_per_step(P, stage=3, zero_shards=2, precision="bf16", grad_accum=2)
    assert z3 == {"reduce_scatter_tensor": 4 * P, "all_gather_into_tensor": 2 * 2 * P}
    assert comm_bytes_per_step(P, stage=3, zero_shards=4, precision="fp32") == {
        "reduce_scatter_tensor": 4 * P, "all_gather_into_tensor": 2 * P}
    # a group of one: DeepSpeed still calls (and the logger logs) the gradient reductions, no all-gather
    # (measured on one CPU rank, fp32, 2 micro-batches per step: ZeRO-1 4P, ZeRO-2 8P, ZeRO-3 8P + 8 B)
    assert comm_bytes_per_step(P, stage=1, zero_shards=1, precision="fp32", grad_accum=2) == {"all_reduce": 4 * P}
    assert comm_bytes_per_step(P, stage=2, zero_shards=1, precision="fp32", grad_accum=2) == {"all_reduce": 8 * P}
    assert comm_bytes_per_step(P, stage=3, zero_shards=1, precision="fp32", grad_accum=2) == {
        "reduce_scatter_tensor": 8 * P}
    alone = comm_bytes_per_step(P, stage=3, zero_shards=1, precision="bf16")
    assert all(wire_bytes(op, n, 1) == 0 for op, n in alone.items())


def test_zero3_moves_one_and_a_half_times_data_parallel_traffic():
    n = 8
    ddp = comm_bytes_per_step(8 * P, stage=0, zero_shards=n, precision="bf16")
    z3 = comm_bytes_per_step(8 * P, stage=3, zero_shards=n, precision="bf16")
    ddp_wire = sum(wire_bytes(k, v, n) for k, v in ddp.items())
    z3_wire = sum(wire_bytes(k, v, n) for k, v in z3.items())
    assert z3_wire == pytest.approx(1.5 * ddp_wire, rel=1e-6)


@pytest.mark.parametrize("p, m, expected", [(1, 8, 0.0), (2, 4, 1 / 5), (4, 16, 3 / 19), (8, 8, 7 / 15)])
def test_pipeline_bubble_fraction(p, m, expected):
    assert bubble_fraction(p, m) == pytest.approx(expected)


# --- plan, text and JSON --------------------------------------------------------------------------

def test_plan_json_has_the_recommendation_and_every_candidate():
    result = plan(KNOWN["llama-2-7b"], Cluster(gpus_per_node=8, gpu_mem_bytes=80 * GB), Workload(),
                  model_name="llama-2-7b")
    data = json.loads(to_json(result))
    rec = data["recommended"]
    assert rec["recipe"] == "zero1" and rec["fits"]
    assert rec["launch"].startswith("harness launch --num_gpus 8 harness/run.py --recipe zero1 --model llama-2-7b")
    assert "--set batch.micro_batch_per_gpu=1" in rec["launch"]
    assert [c["recipe"] for c in data["candidates"][:5]] == ["ddp", "zero1", "zero2", "zero3", "zero2_bf16_states"]
    assert data["candidates"][0]["why_not"].startswith("GPU: needs 146.5 GB > 72.0 GB usable")
    assert set(rec["memory"]["model_states"]["fp32_grads"]) == {"gpu", "cpu", "nvme"}
    assert {r["collective"] for r in rec["comm"]["rows"]} == {"all_reduce", "all_gather_into_tensor"}


def test_text_states_units_and_why_cheaper_options_fail():
    result = plan(KNOWN["llama-2-13b"], Cluster(gpus_per_node=8, gpu_mem_bytes=40 * GB, cpu_mem_bytes=512 * GB),
                  Workload(activation_checkpointing=True), model_name="llama-2-13b")
    text = to_text(result)
    assert "GB = 10^9 bytes, GiB = 2^30 bytes" in text and " GiB" in text
    assert "recommended: zero3:" in text
    for line in [l for l in text.splitlines() if l.lstrip().startswith(("1  ddp", "2  zero1", "3  zero2"))]:
        assert " no " in line and "GPU: needs" in line


def test_multi_node_launch_uses_a_hostfile():
    result = plan(KNOWN["llama-2-70b"], Cluster(gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * GB), Workload(),
                  model_name="llama-2-70b")
    assert result.recommended["launch"].startswith(
        "deepspeed --hostfile hostfile --num_nodes 2 --num_gpus 8 harness/run.py --recipe ")
    assert all(c["tp"] <= 8 for c in result.candidates)  # tensor parallel never crosses a node


def test_the_plan_gives_the_same_run_under_slurm_on_ray_and_on_kubernetes():
    """`harness plan` prints `harness slurm`, `harness ray` and `harness k8s` beside the launch line (issue 48): each
    parses with its own command's parser into the same nodes, GPUs, recipe and overrides as the launch line."""
    import shlex

    from harness.cli import parser_for
    from harness.train import run_args

    result = plan(KNOWN["llama-2-70b"], Cluster(gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * GB), Workload(),
                  model_name="llama-2-70b")
    rec = result.recommended
    launch = run_args.parse(shlex.split(rec["launch"].split(" harness/run.py ", 1)[1]))
    slurm = parser_for(shlex.split(rec["slurm"])[1:]).parse_args(shlex.split(rec["slurm"])[1:])
    ray = parser_for(shlex.split(rec["ray"])[1:]).parse_args(shlex.split(rec["ray"])[1:])
    k8s = parser_for(shlex.split(rec["k8s"])[1:]).parse_args(shlex.split(rec["k8s"])[1:])
    on_ray = run_args.parse(ray.script_args)
    assert (slurm.nodes, slurm.gpus_per_node, ray.nodes, ray.gpus_per_node) == (2, 8, 2, 8)
    assert (k8s.nodes, k8s.gpus_per_node, k8s.recipe, k8s.model, k8s.overrides) == \
        (2, 8, slurm.recipe, slurm.model, slurm.overrides)
    assert slurm.recipe == on_ray.recipe == launch.recipe == rec["recipe"] and ray.script == "harness/run.py"
    assert on_ray.overrides == [f"train.model={slurm.model}", *slurm.overrides]
    assert on_ray.overrides == launch.overrides and on_ray.output_dir == slurm.output_dir == "RUN_DIR"
    text = to_text(result)
    assert f"  slurm:  {rec['slurm']}" in text and f"  ray:    {rec['ray']}" in text and f"  k8s:    {rec['k8s']}" in text


def test_impossible_request_says_what_is_missing():
    result = plan(KNOWN["llama-2-70b"], Cluster(gpus_per_node=8, gpu_mem_bytes=24 * GB, cpu_mem_bytes=256 * GB),
                  Workload(activation_checkpointing=True), model_name="llama-2-70b")
    assert result.recommended is None
    assert any(line.startswith("needs >= ") and "CPU RAM per node for optimizer" in line for line in result.missing)
    assert any("NVMe per node" in line and "none given" in line for line in result.missing)


def test_plan_rejects_bad_numbers_with_the_values():
    with pytest.raises(ValueError, match="gpus_per_node 0"):
        plan(KNOWN["gpt2"], Cluster(gpus_per_node=0, gpu_mem_bytes=GB), Workload())
    with pytest.raises(ValueError, match="precision 'fp8'"):
        plan(KNOWN["gpt2"], Cluster(gpus_per_node=1, gpu_mem_bytes=GB), Workload(precision="fp8"))


def test_planner_does_not_import_torch_or_deepspeed():
    code = ("import sys; from harness.planner import plan; from harness.model_shapes import KNOWN; "
            "from harness.planner.inputs import Cluster, Workload; "
            "plan(KNOWN['llama-2-70b'], Cluster(8, 80 * 10**9), Workload()); "
            "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# --- the command ----------------------------------------------------------------------------------

@pytest.mark.parametrize("text, nbytes", [
    ("80GB", 80 * GB), ("80 GB", 80 * GB), ("80GiB", 80 * GIB), ("24000MB", 24 * GB), ("1.5TB", 1_500 * GB),
    ("512gib", 512 * GIB),
])
def test_sizes_with_units(text, nbytes):
    assert plan_cmd.parse_size(text, "--gpu-mem") == nbytes


@pytest.mark.parametrize("text", ["80", "80G", "eighty GB", "0GB", "80 GBs"])
def test_ambiguous_or_bad_sizes_are_refused(text):
    with pytest.raises(UsageError, match="--gpu-mem"):
        plan_cmd.parse_size(text, "--gpu-mem")


def test_command_prints_the_plan_and_json(capsys):
    code, out = run_plan(["--model", "llama-2-7b", "--gpus", "8", "--gpu-mem", "80GB"], capsys)
    assert code == 0 and "recommended: zero1" in out and "launch: harness launch --num_gpus 8" in out
    code, out = run_plan(["--model", "llama-2-7b", "--gpus", "8", "--gpu-mem", "80GB", "--json"], capsys)
    assert code == 0 and json.loads(out)["recommended"]["recipe"] == "zero1"


def test_command_exits_1_when_nothing_fits(capsys):
    code, out = run_plan(["--model", "llama-3.1-405b", "--gpus", "8", "--gpu-mem", "80GB", "--cpu-mem", "1TB",
                          "--activation-checkpointing"], capsys)
    assert code == 1 and "no strategy fits:" in out and "needs >= " in out


def test_command_resolves_hub_ids_of_known_shapes_offline(capsys):
    code, out = run_plan(["--model", "meta-llama/Llama-2-7b-hf", "--gpus", "8", "--gpu-mem", "80GB", "--json"],
                         capsys)
    assert json.loads(out)["model"]["params"]["total"] == 6_738_415_616


def test_command_reads_a_local_config_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(KNOWN["gpt2"]))
    code, out = run_plan(["--model", str(tmp_path), "--gpus", "1", "--gpu-mem", "16GB", "--json"], capsys)
    assert json.loads(out)["model"]["params"]["total"] == 124_439_808


def test_cli_maps_bad_input_to_exit_2_with_one_line(capsys):
    from harness.cli import main

    assert main(["plan", "--model", "llama-2-7b", "--gpus", "8", "--gpu-mem", "80"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "give a size with a unit" in err[0]
    assert main(["plan", "--model", "no-such-model", "--gpus", "8", "--gpu-mem", "80GB"]) == 2


# --- model states: a live-engine calibration (2 CPU ranks, DeepSpeed 0.19.8, harness bucket sizes) -------
# Every live tensor counted once per rank after 2 steps (gc, deduplicated by storage), rank 0, for this
# Llama (3,164,416 params); the few hundred bytes over the prediction are scalars (loss scale, step).
CALIBRATION_LLAMA = {"model_type": "llama", "vocab_size": 512, "hidden_size": 256, "intermediate_size": 688,
                     "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
                     "tie_word_embeddings": False}
MEASURED = [  # stage, precision, offload_optimizer, offload_param, total bytes, fp32 bytes
    (0, "bf16", "none", "none", 44_302_084, 37_973_248),
    (1, "bf16", "none", "none", 25_315_592, 18_986_756),
    (2, "bf16", "none", "none", 25_315_592, 18_986_756),
    (2, "fp32", "none", "none", 31_644_424, 31_644_420),
    (3, "bf16", "none", "none", 25_451_277, 18_986_752),
    (2, "bf16", "cpu", "none", 35_513_348, 25_315_588),
    (3, "bf16", "cpu", "none", 31_780_101, 25_315_588),
    (3, "bf16", "cpu", "cpu", 31_780_101, 25_315_588),
]
FP32_TERMS = ("fp32_master", "optimizer_moments", "fp32_grads")


@pytest.mark.parametrize("stage, precision, opt, param, total, fp32", MEASURED)
def test_after_step_terms_match_a_live_engine_within_2_percent(stage, precision, opt, param, total, fp32):
    count = count_params(CALIBRATION_LLAMA)
    buckets = harness_buckets(256)
    held = Holding(count.total, count.largest_layer, count.largest_tensor,
                   persistent=count.persistent_numel(buckets.param_persistence_threshold))
    terms = model_state_bytes(held, Zero(stage, opt, param, buckets), zero_shards=2, precision=precision,
                              phase="after_step")
    predicted = sum(by_device(terms).values())
    predicted_fp32 = sum(sum(terms[t].values()) for t in FP32_TERMS)
    if precision == "fp32":
        predicted_fp32 = predicted
    assert predicted == pytest.approx(total, rel=0.02)
    assert predicted_fp32 == pytest.approx(fp32, rel=0.02)
    assert abs(predicted - total) < 1024  # in fact exact up to a few scalars


# --- the launch's free-space check (harness/train/checks.py) ------------------------------------

def test_nvme_swap_check_counts_the_zero_group_not_the_replicas(tmp_path):
    """ZeRO-3 shards over dp x sp ranks, so at one world size the NVMe swap files per rank are the same with
    sequence parallel 2 as without; counting the replicas (dp = world / sp) would double them."""
    from harness.dist import Launch
    from harness.train import checks, run_args, session

    def nvme_needs(*overrides):
        args = run_args.parse(["--recipe", "zero3_nvme", "--set", f"zero.nvme_path={tmp_path / 'nvme'}",
                               "--output-dir", str(tmp_path / "run"),
                               *[a for o in overrides for a in ("--set", o)]])
        asked = session.resolve_spec(args, Launch(world_size=4, local_size=4))
        return asked, checks._needs(asked, asked.model_config)["nvme"][1]

    plain, plain_bytes = nvme_needs()
    sharded, sp_bytes = nvme_needs("parallel.sequence=2")
    assert (plain.dp, plain.zero_shards, sharded.dp, sharded.zero_shards) == (4, 4, 2, 4)
    assert sp_bytes == plain_bytes > 0


def test_optimizer_states_follow_the_optimizer():
    """Adam's two fp32 moments per trainable element, Lion's one, plain SGD's none (torch keeps no state without
    momentum): the run reads which from its DeepSpeed dict, and model states and checkpoints follow."""
    from harness.config.run_model import optimizer_states

    sgd = {"optimizer": {"type": "SGD", "params": {"lr": 1.0, "momentum": 0.0}}}
    assert optimizer_states(sgd) == 0
    assert optimizer_states({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}}) == 1
    assert [optimizer_states({"optimizer": {"type": t}}) for t in ("AdamW", "Adam", "Lamb", "Lion")] == [2, 2, 2, 1]
    assert optimizer_states({}) == 2  # no optimizer block: the planner's Adam
    adam = model_state_bytes(Holding(1000), Zero(2), zero_shards=2, precision="bf16", phase="after_step")
    plain = model_state_bytes(Holding(1000, optimizer_states=0), Zero(2), zero_shards=2, precision="bf16",
                              phase="after_step")
    assert adam["optimizer_moments"]["gpu"] == 2 * 4 * 500 and plain["optimizer_moments"]["gpu"] == 0
    assert {t: v for t, v in plain.items() if t != "optimizer_moments"} == \
        {t: v for t, v in adam.items() if t != "optimizer_moments"}
    from harness.planner.memory import checkpoint_bytes
    assert (checkpoint_bytes(10, "bf16"), checkpoint_bytes(10, "bf16", optimizer_states=0)) == (140, 60)


def test_plan_optimizer_flag_prices_its_state(capsys):
    """`harness plan --optimizer`: AdamW's two fp32 moments per parameter, Lion's one, plain SGD's none; on ZeRO-2
    over 8 GPUs each state costs 4 B x P / 8 per GPU, and nothing else changes."""
    base = ["--model", "llama-2-7b", "--gpus", "8", "--gpu-mem", "80GB", "--zero", "2", "--json"]
    states = {}
    for opt in ("adamw", "lion", "sgd"):
        code, out = run_plan([*base, "--optimizer", opt], capsys)
        assert code == 0
        plan_ = json.loads(out)
        row = plan_["evaluated"]
        assert row["label"] == "zero2"
        states[opt] = (plan_["workload"]["optimizer_states"], row["memory"]["model_states"])
    p = count_params(KNOWN["llama-2-7b"]).total
    assert [states[o][0] for o in ("adamw", "lion", "sgd")] == [2, 1, 0]
    moments = {o: states[o][1]["optimizer_moments"]["gpu"] for o in states}
    assert moments == {"adamw": 2 * 4 * -(-p // 8), "lion": 4 * -(-p // 8), "sgd": 0}
    others = [{t: v for t, v in s.items() if t != "optimizer_moments"} for _, s in states.values()]
    assert others[0] == others[1] == others[2]
    code, text = run_plan(base[:-1] + ["--optimizer", "sgd"], capsys)
    assert "optimizer state 0 x fp32 per parameter" in text and "optimizer_moments" not in text
