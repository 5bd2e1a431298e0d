"""The decision order on a table of hardware cases: DDP -> ZeRO-1/2 -> ZeRO-3 -> offload optimizer (ZeRO-2,
then ZeRO-3) -> offload params (CPU, then NVMe) -> tensor parallel inside a node -> pipeline / 3D.

Each row says why its answer is the first that fits; every case also checks that all cheaper options fail
and say why. Cases keep a margin from the GPU limit so small refinements of the math do not flip them.
"""

import pytest

from harness.model_shapes import KNOWN, PRESETS
from harness.planner import plan
from harness.planner.inputs import Cluster, Workload

GB = 10**9

# model, gpus/node, GB/GPU, nodes, CPU GB/node, NVMe GB/node, seq, micro batch, act. ckpt, precision
# -> recommended strategy label (None: nothing fits)
CASES = [
    # a tiny model fits one GPU: data parallel
    ("tiny-llama", 1, 16, 1, None, None, 2048, 1, False, "bf16", "ddp"),
    ("gpt2", 1, 24, 1, None, None, 1024, 1, False, "bf16", "ddp"),
    ("gpt2", 8, 16, 2, None, None, 1024, 4, False, "bf16", "ddp"),
    # 7B: 16 B/param = 108 GB does not fit 80 GB; sharding Adam (ZeRO-1) does
    ("llama-2-7b", 8, 80, 1, None, None, 2048, 1, False, "bf16", "zero1"),
    # on 40 GB ZeRO-1's replicated 16-bit weights + grads (27 GB) + shards are too much; ZeRO-2 fits
    ("llama-2-7b", 8, 40, 1, None, None, 2048, 1, True, "bf16", "zero2"),
    # 70B over 32 GPUs: only full sharding (ZeRO-3, ~20 B/param / 32) fits
    ("llama-2-70b", 8, 80, 4, None, None, 2048, 1, True, "bf16", "zero3"),
    # one GPU: sharding saves nothing; the seed's ZeRO-2 + CPU optimizer offload does
    ("gpt2-xl", 1, 16, 1, None, None, 1024, 1, False, "bf16", "zero2 opt->cpu"),
    ("llama-3.2-1b", 1, 24, 1, None, None, 2048, 1, False, "fp32", "zero2 opt->cpu"),
    # 8B on 8 x 16 GB: ZeRO-2 offload still keeps 16 GB of bf16 weights per GPU; ZeRO-3 + offload fits
    ("llama-3-8b", 8, 16, 1, None, None, 2048, 1, True, "bf16", "zero3 opt->cpu"),
    ("llama-2-70b", 8, 80, 2, None, None, 2048, 1, False, "bf16", "zero3 opt->cpu"),
    # ... unless bf16 master weights and optimizer states make ZeRO-3 fit: the rung before any offload (issue 47;
    # docs/optimizers.md: 10 B/param of model states instead of 16, at a cost in precision the plan states)
    ("llama-3-70b", 8, 80, 2, 2000, None, 4096, 1, True, "bf16", "zero3 bf16-states"),
    # 13B on one 24 GB GPU: the weights themselves (26 GB) must leave the GPU
    ("llama-2-13b", 1, 24, 1, 512, None, 2048, 1, True, "bf16", "zero3 opt->cpu params->cpu"),
    # ... and with 128 GB of CPU RAM they go to NVMe
    ("llama-2-13b", 1, 24, 1, 128, 2000, 2048, 1, True, "bf16", "zero3 opt->nvme params->nvme"),
    # 8k tokens without checkpointing: activations overflow every ZeRO variant; tp 2 splits them
    ("llama-2-7b", 8, 40, 4, None, None, 8192, 1, False, "bf16", "tp zero3 tp2"),
    # activations of 64 x 1024 tokens; GPT-2 cannot be tensor-parallel split: only the long-context rung holds them
    # (checkpointing, tiled MLP and loss, the checkpointed block inputs in CPU RAM, which is not given: not checked)
    ("gpt2-xl", 8, 16, 1, None, None, 1024, 64, False, "bf16", "zero3 tiled ckpt->cpu"),
    # impossible: 405B model states exceed 1 TB of CPU RAM and there is no NVMe
    ("llama-3.1-405b", 8, 80, 1, 1000, None, 2048, 1, True, "bf16", None),
    # impossible: 1024 x 1024 tokens; one recomputed block is 27 GB, 25 heads allow no sp over 8 GPUs
    ("gpt2-xl", 8, 16, 1, None, None, 1024, 1024, False, "bf16", None),
]


def make_plan(model, gpus, mem, nodes, cpu, nvme, seq, mb, ckpt, precision):
    cfg = PRESETS.get(model) or KNOWN[model]
    return plan(cfg, Cluster(gpus_per_node=gpus, nodes=nodes, gpu_mem_bytes=mem * GB, cpu_mem_bytes=cpu and cpu * GB,
                             nvme_bytes=nvme and nvme * GB),
                Workload(seq_len=seq, micro_batch=mb, precision=precision, activation_checkpointing=ckpt),
                model_name=model)


@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[3]}x{c[1]}x{c[2]}GB-{c[10]}" for c in CASES])
def test_recommendation_follows_the_decision_order(case):
    *inputs, expected = case
    result = make_plan(*inputs)
    got = result.recommended["label"] if result.recommended else None
    assert got == expected, [(c["label"], c["why_not"]) for c in result.candidates[:10]]
    stop = result.candidates.index(result.recommended) if result.recommended else len(result.candidates)
    for cheaper in result.candidates[:stop]:
        assert not cheaper["fits"] and cheaper["why_not"], cheaper["label"]
    if result.recommended:
        rec = result.recommended
        assert rec["memory"]["gpu_bytes"] <= result.hardware.usable_gpu_bytes
        assert f"--recipe {rec['recipe']} --model {inputs[0]}" in rec["launch"]
        assert not result.missing
    else:
        assert result.missing and all(line for line in result.missing)


def test_impossible_405b_names_the_cpu_ram_and_nvme_it_would_need():
    result = make_plan(*CASES[-2][:-1])
    assert result.missing[0].startswith("needs >= ") and "CPU RAM per node" in result.missing[0]
    assert "1.0 TB given" in result.missing[0]
    assert "NVMe per node" in result.missing[1]


def test_gpt2_tensor_parallel_rows_say_why_not():
    result = make_plan(*CASES[-1][:-1])
    tp_rows = [c for c in result.candidates if c["tp"] > 1]
    assert tp_rows and all(not c["applicable"] and "model_type 'gpt2'" in c["why_not"] for c in tp_rows)
    assert "activations" in result.missing[0] and "--activation-checkpointing" in result.missing[0]


def test_tensor_parallel_never_crosses_a_node_and_pipelines_come_last():
    result = make_plan("llama-2-70b", 8, 80, 2, None, None, 2048, 1, False, "bf16")
    labels = [c["label"] for c in result.candidates]
    assert max(c["tp"] for c in result.candidates) == 8
    first_pp = next(i for i, c in enumerate(result.candidates) if c["pp"] > 1)
    rung = next(i for i, c in enumerate(result.candidates) if c["act"])  # the long-context rung, after them
    assert all(c["pp"] == 1 for c in result.candidates[:first_pp])
    assert all(c["pp"] > 1 for c in result.candidates[first_pp:rung]) and rung > first_pp
    assert all(c["act"] and c["tp"] == c["pp"] == 1 for c in result.candidates[rung:])
    assert "pipeline zero1 pp2" in labels and "3d zero1 tp8 pp2" in labels
    pp2 = result.candidates[labels.index("pipeline zero1 pp2")]
    assert pp2["overrides"]["parallel.pipeline"] == 2 and pp2["overrides"]["batch.grad_accum_steps"] == 8
    assert pp2["bubble_fraction"] == pytest.approx(1 / 9)


def test_nvme_recommendation_reminds_to_set_the_path():
    result = make_plan("llama-2-13b", 1, 24, 1, 128, 2000, 2048, 1, True, "bf16")
    assert result.recommended["recipe"] == "zero3_nvme"
    assert any("zero.nvme_path" in n for n in result.notes)
    assert result.recommended["overrides"]["zero.offload_param"] == "nvme"


def test_unchecked_cpu_ram_is_stated():
    result = make_plan("llama-2-70b", 8, 80, 2, None, None, 2048, 1, False, "bf16")
    assert result.recommended["recipe"] == "zero3_offload"
    assert result.recommended["overrides"]["zero.offload_param"] == "none"
    assert any(n.startswith("CPU RAM not given: zero3_offload needs >= ") for n in result.notes)
