"""The planner's pipeline and tensor axes (pure: no process group): DeepSpeed's layer partition, per-stage
parameters, p2p / 3D / TP / tied bytes per step, the bubble, and 3D launch lines that pass the launcher's and
the harness's own argument checks."""

from __future__ import annotations

import random
import shlex

import pytest

from harness.model_shapes import KNOWN, load_model_config
from harness.planner import plan
from harness.planner import pipeline as pl
from harness.planner.inputs import Cluster, Workload
from harness.planner.params import count_params, model_shape


def tiny(layers=3, tied=False, model="tiny-llama") -> dict:
    cfg = load_model_config(model)
    cfg["num_hidden_layers" if "num_hidden_layers" in cfg else "n_layer"] = layers
    cfg["tie_word_embeddings"] = tied
    return cfg


def test_partition_equals_deepspeeds_own_functions():
    """Same boundaries as deepspeed.runtime.utils for random weights (zeros, ties, more parts than items)."""
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    rng = random.Random(0)
    for _ in range(400):
        n, m = rng.randint(1, 14), rng.randint(1, 6)
        weights = [rng.choice([0, 1, 3, 64, 64, 100, 46208, 32768]) for _ in range(n)]
        assert pl.partition_balanced(weights, m) == [int(x) for x in partition_balanced(weights, m)], (weights, m)
        assert pl.partition_uniform(n, m) == [int(x) for x in partition_uniform(n, m)], (n, m)


def test_layer_list_and_partition_of_a_real_model_shape():
    """llama-2-7b over 4 stages: [embed, 32 blocks, norm, head]; DeepSpeed's balanced split, computed by it."""
    from deepspeed.runtime.utils import partition_balanced

    count = count_params(dict(KNOWN["llama-2-7b"]))
    specs = pl.layer_specs(count)
    assert len(specs) == 35 and specs[0] == ("embedding", 32000 * 4096) and specs[-1] == ("lm_head", 32000 * 4096)
    want = [int(x) for x in partition_balanced([n for _, n in specs], 4)]
    assert pl.partition(count, 4) == want
    stages = pl.stages(count, 4)
    assert sum(s["params"] for s in stages) == count.total
    assert pl.partition(count, 4, "uniform") == [0, 9, 18, 27, 35]


def test_tiny_llama_stage_params_by_hand():
    """tiny-llama, 3 blocks: embed 512x64 = 32768, block 46208 (q 4096, k 2048, v 2048, o 4096, gate/up/down
    3 x 11264, 2 norms 128), norm 64, head 32768 -> [embed, b0, b1 | b2, norm, head]."""
    count = count_params(tiny())
    assert [n for _, n in pl.layer_specs(count)] == [32768, 46208, 46208, 46208, 64, 32768]
    stages = pl.stages(count, 2)
    assert [s["layers"] for s in stages] == [[0, 3], [3, 6]]
    assert [s["params"] for s in stages] == [32768 + 2 * 46208, 46208 + 64 + 32768]
    assert [s["blocks"] for s in stages] == [2, 1]


def test_tied_embedding_is_held_by_both_end_stages_and_once_without_a_pipeline():
    count = count_params(tiny(tied=True))
    assert count.lm_head == 0
    stages = pl.stages(count, 2)
    assert [s["params"] for s in stages] == [32768 + 2 * 46208, 46208 + 64 + 32768]  # the head's copy
    assert all(s["tied_copy"] for s in stages)
    assert pl.stages(count, 1)[0]["params"] == count.total  # one module when one stage holds both ends


def test_gpt2_positions_are_a_layer_and_only_the_token_embedding_is_tied():
    """tiny-gpt2, 2 blocks: [wte 32768, wpe 32768, block 12h^2 + 13h = 49984 x 2, ln_f 128, head = wte]."""
    from deepspeed.runtime.utils import partition_balanced

    count = count_params(tiny(layers=2, tied=True, model="tiny-gpt2"))
    weights = [n for _, n in pl.layer_specs(count)]
    assert weights == [32768, 32768, 49984, 49984, 128, 32768]
    assert pl.partition(count, 2) == [int(x) for x in partition_balanced(weights, 2)]
    stages = pl.stages(count, 2)
    assert sum(s["params"] for s in stages) == count.total + 32768  # the last stage's copy of wte
    assert pl.stages(count, 1)[0]["params"] == count.total
    assert pl.tied_allreduce_bytes(count, stage=0, pp=2, precision="fp32") == 32768 * 4


def test_tensor_parallel_splits_block_weights_only():
    """tp 2: column (q, k, v, gate, up) and row (o, down) weights halve, norms stay: 128 + 46080 / 2."""
    count = count_params(tiny())
    assert count.per_layer_split == 46080 and count.block_params(2) == 23168
    stages = pl.stages(count, 2, tp=2)
    assert [s["params"] for s in stages] == [32768 + 2 * 23168, 23168 + 64 + 32768]
    qwen = count_params(dict(KNOWN["qwen2.5-7b"]))  # q/k/v biases split too; norms whole
    h, kv_dim = 3584, 4 * 128
    assert qwen.per_layer - qwen.per_layer_split == 2 * h
    assert qwen.block_params(4) == 2 * h + (qwen.per_layer - 2 * h) // 4 and (h + 2 * kv_dim) % 4 == 0


def test_partition_weighs_the_blocks_as_deepspeed_counted_them():
    """A stage that splits its blocks after the PipelineModule is built was partitioned on whole blocks."""
    count = count_params(dict(KNOWN["llama-3.2-1b"]))
    assert pl.partition(count, 4, tp=2, counted_tp=1) == pl.partition(count, 4)
    middle = pl.stages(count, 4, tp=2, counted_tp=1)[1]
    assert middle["names"][0].startswith("block") and middle["params"] == middle["blocks"] * count.block_params(2)


def test_p2p_bytes_by_hand():
    """micro 2 x seq 32 x hidden 64 = 4096 elements = 16 KiB fp32 per message; 4 micro-batches per step."""
    shape = model_shape(tiny())
    ids = 8 * 2 * 32 * 4  # document packing: each forward message also carries [2, 32] int64 position ids
    doc, m = Workload(32, 2, "fp32"), dict(micro_batches=4)
    assert pl.p2p_bytes(shape, doc, stage=0, pp=2, **m) == {"send": 65536 + ids, "recv": 65536}
    assert pl.p2p_bytes(shape, doc, stage=1, pp=3, **m) == {"send": 131072 + ids, "recv": 131072 + ids}
    assert pl.p2p_bytes(shape, doc, stage=1, pp=2, tp=2, **m)["recv"] == 4 * (8192 + 72) + ids  # sent whole
    concat = doc.but(packing="concat")  # the hidden states only
    assert pl.p2p_bytes(shape, concat, stage=0, pp=2, **m) == {"send": 65536, "recv": 65536}
    assert pl.p2p_bytes(shape, concat, stage=1, pp=3, **m) == {"send": 131072, "recv": 131072}
    assert pl.p2p_bytes(shape, concat, stage=0, pp=1, **m) == {}
    # 3D: half the activation (8192 B) + 9 longs of partition meta per message; all-gathers rebuild it
    assert pl.p2p_bytes(shape, concat, stage=0, pp=2, tp=2, **m) == {
        "send": 4 * (8192 + 72), "recv": 4 * (8192 + 72), "all_gather_into_tensor": 2 * 4 * 8192}
    assert pl.p2p_bytes(shape, concat, stage=1, pp=2, tp=2, **m)["all_gather_into_tensor"] == 4 * 8192
    assert pl.p2p_bytes(shape, concat, stage=1, pp=2, tp=2, partitioned=False, **m) == {"send": 65536, "recv": 65536}


def test_tp_and_tied_allreduce_bytes_by_hand():
    shape = model_shape(tiny())
    per_call = 2 * 32 * 64 * 4
    kw = dict(seq_len=32, micro_batch=2, micro_batches=4, precision="fp32")
    assert pl.tp_allreduce_bytes(shape, tp=2, blocks=2, **kw) == 4 * 2 * 4 * per_call
    assert pl.tp_allreduce_bytes(shape, tp=2, blocks=2, activation_checkpointing=True, **kw) == 6 * 2 * 4 * per_call
    assert pl.tp_allreduce_bytes(shape, tp=1, blocks=2, **kw) == 0
    tied = count_params(tiny(tied=True))
    assert pl.tied_allreduce_bytes(tied, stage=1, pp=2, precision="fp32") == 32768 * 4
    assert pl.tied_allreduce_bytes(tied, stage=1, pp=3, precision="fp32") == 0  # a middle stage holds no copy
    assert pl.tied_allreduce_bytes(tied, stage=0, pp=2, precision="bf16", bf16_optimizer=True) == 32768 * 4
    assert pl.tied_allreduce_bytes(count_params(tiny()), stage=0, pp=2, precision="fp32") == 0


@pytest.mark.parametrize("p, m, want", [(1, 8, 0.0), (2, 4, 0.2), (4, 16, 3 / 19), (8, 8, 7 / 15)])
def test_bubble(p, m, want):
    assert pl.bubble_fraction(p, m) == pytest.approx(want)


def test_plan_uses_the_largest_stage_and_names_pipeline_traffic():
    result = plan(dict(KNOWN["llama-2-13b"]), Cluster(gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * 10**9), Workload())
    count = count_params(dict(KNOWN["llama-2-13b"]))
    row = next(c for c in result.candidates if c["label"] == "3d zero1 tp2 pp2")
    assert row["params_per_rank"] == max(s["params"] for s in pl.stages(count, 2, tp=2))
    groups = {(r["group"], r["collective"]) for r in row["comm"]["rows"]}
    assert {("pp", "send"), ("pp", "recv"), ("tp", "all_reduce"), ("tp-pipe", "all_gather_into_tensor"),
            ("dp", "all_reduce")} <= groups


def test_pipeline_and_3d_launch_lines_run_as_printed():
    """Every pipeline / 3D line `harness plan` prints passes DeepSpeed's launcher parser and the harness's own
    recipe, override and layout checks for the world size it names (not the checks of the machine it will run
    on: this one has neither a 13B tokenizer nor room for its checkpoints)."""
    from deepspeed.launcher.runner import parse_args

    from harness.dist import Launch
    from harness.train import run_args, session

    result = plan(dict(KNOWN["llama-2-13b"]), Cluster(gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * 10**9), Workload(),
                  model_name="llama-2-13b")
    lines = [c["launch"] for c in result.candidates if c["pp"] > 1]
    assert any("--recipe 3d" in line for line in lines) and any("--recipe pipeline" in line for line in lines)
    for line in lines:
        argv = shlex.split(line)
        script = argv.index("harness/run.py")
        launcher = parse_args(argv[1:script + 1])
        world = launcher.num_nodes * launcher.num_gpus
        launch = Launch(world_size=world, local_size=launcher.num_gpus)
        spec = session.resolve_spec(run_args.parse(argv[script + 1:]), launch)  # the config, not this machine's disk
        c = next(c for c in result.candidates if c["launch"] == line)
        assert (spec.pp, spec.tp, spec.dp) == (c["pp"], c["tp"], c["dp"]), line
        assert spec.ds_config["pipeline"]["stages"] == c["pp"]


def _qwen2_tied():
    from transformers import AutoModelForCausalLM, Qwen2Config

    return AutoModelForCausalLM.from_config(Qwen2Config(
        vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=True))


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-gpt2", "qwen2-tied"])
def test_layer_list_weighs_what_the_harness_pipeline_module_builds(model):
    """The planner's layer list against harness/model/parallel/pipeline.py's LayerSpecs, weighed the way
    DeepSpeed's _count_layer_params does (build each spec, count trainable parameters)."""
    from harness.model.hf import build_model
    from harness.model.parallel.pipeline import layer_specs as pipe_specs

    hf = _qwen2_tied() if model == "qwen2-tied" else build_model(model, seed=0)
    built = [sum(p.numel() for p in spec.build().parameters() if p.requires_grad) for spec in pipe_specs(hf)]
    assert [n for _, n in pl.layer_specs(count_params(hf.config.to_dict()))] == built


def test_plan_text_lists_the_stages():
    from harness.planner.render.text import _comm

    result = plan(dict(KNOWN["llama-2-13b"]), Cluster(gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * 10**9), Workload())
    row = next(c for c in result.candidates if c["label"] == "pipeline zero1 pp2")
    text = "\n".join(_comm(row))
    assert "pipeline bubble (p-1)/(m+p-1) = (2-1)/(8+2-1) = 11.1%" in text
    assert "stages (DeepSpeed's 'parameters' partition; memory above is the largest): 0: layers 0-" in text
    assert row["params_per_rank"] == max(s["params"] for s in row["stages"])


def test_multi_node_plan_says_where_the_hostfile_comes_from():
    result = plan(dict(KNOWN["llama-2-13b"]), Cluster(gpus_per_node=8, nodes=2, gpu_mem_bytes=80 * 10**9), Workload())
    assert any(n.startswith("the launch line reads ./hostfile: one line per node, '<host> slots=8'")
               for n in result.notes)
    single = plan(dict(KNOWN["llama-2-13b"]), Cluster(gpus_per_node=8, nodes=1, gpu_mem_bytes=80 * 10**9), Workload())
    assert not any("hostfile" in n for n in single.notes)


def test_packing_is_honoured_in_the_plans_pipeline_traffic_and_step_time():
    """Document rows send their int64 position ids with every forward message between stages; concat rows send the
    hidden states only. The plan (its --packing, the recipe's train.packing) and the step time both follow it;
    layouts without a pipeline are untouched."""
    from harness.planner import hardware

    cfg = dict(KNOWN["llama-2-7b"])
    cluster, profile = Cluster(8, 80 * 10**9), hardware.load("h100-80gb-sxm")

    def evaluated(packing: str, pp: int) -> dict:
        work = Workload(4096, packing=packing, global_batch=64)
        layout = {"zero": 1, "offload": "none", "tp": 1, "pp": pp}
        return plan(cfg, cluster, work, hardware_profile=profile, layout=layout).evaluated

    doc, concat = (evaluated(p, 2) for p in ("document", "concat"))
    m, micro = doc["micro_batches"], doc["micro_batch"]
    ids = 8 * 4096 * micro * m  # int64 position ids per step, sent by stage 0 (the middle of two stages)
    pp_doc = {row["collective"]: row["logged_bytes"] for row in doc["comm"]["rows"] if row["group"] == "pp"}
    pp_concat = {row["collective"]: row["logged_bytes"] for row in concat["comm"]["rows"] if row["group"] == "pp"}
    assert pp_doc["send"] - pp_concat["send"] == ids and pp_doc["recv"] == pp_concat["recv"]
    assert doc["time"]["breakdown"]["p2p_s"] > concat["time"]["breakdown"]["p2p_s"]
    assert doc["time"]["step_time_s"] > concat["time"]["step_time_s"]
    assert concat["overrides"]["train.packing"] == "concat" and "train.packing" not in doc["overrides"]
    one, two = (evaluated(p, 1) for p in ("document", "concat"))
    assert one["comm"] == two["comm"] and one["time"] == two["time"]


def test_a_runs_own_step_time_follows_its_packing():
    """planner.evaluate(run, ...): the run's packing reaches the step time (before, the run's time prediction always
    counted position ids while its byte prediction followed the recipe)."""
    from harness.config.run_model import Batch, Degrees, RunModel, Sequence, Zero
    from harness.planner import evaluate, hardware, layouts

    cluster, profile = layouts.hardware(8, 1, 80 * 10**9, None, None), hardware.load("h100-80gb-sxm")

    def run(packing: str) -> RunModel:
        return RunModel("llama-2-7b", KNOWN["llama-2-7b"], "bf16", Degrees(8, pp=2), Zero(stage=1), Batch(1, 8, 32),
                        Sequence(4096, packing=packing))

    doc, concat = (evaluate(run(p), cluster, profile) for p in ("document", "concat"))
    assert doc.layout["label"] == "pipeline zero1 pp2" and doc.rank is None
    assert doc.time["breakdown"]["p2p_s"] > concat.time["breakdown"]["p2p_s"]
