"""The planner for long context (issue #24): activation bytes with sp, tiling, masks and activation offload against
hand arithmetic, the Ulysses all-to-all bytes, max_seq_len per layout, the long-context rung, `harness plan
--seq-len` and `--recipe auto`. Pure arithmetic: no ranks."""

from __future__ import annotations

import io
import json
import re
import time
from contextlib import redirect_stdout

import pytest

from harness.model_shapes import KNOWN, PRESETS
from harness.planner import hardware, layouts, longest, plan, sequence
from harness.planner.inputs import Cluster, LongContext, Workload
from harness.planner.memory import activation_bytes
from harness.planner.params import count_params, model_shape

GB = 10**9
GIB = 2**30


def llama8b():
    cfg = KNOWN["llama-3.1-8b"]
    return cfg, model_shape(cfg), count_params(cfg)


def test_llama_activation_bytes_match_hand_arithmetic_with_sp_tiling_and_checkpointing():
    _, shape, _ = llama8b()
    h, inter, kv, vocab, layers = 4096, 14336, 8 * 128, 128256, 32
    s, sp, lp = 65536, 4, 2
    t = s // sp  # 16384 tokens per rank
    work, long_context = Workload(s, 1, "bf16", True), LongContext(sp=sp)
    plain = activation_bytes(shape, work.but(activation_checkpointing=False), long_context=long_context)
    # norms in/out 4h; q, k, v, out 2h + 2kv; MLP gate, up, act, act*up 4I; under Ulysses the output twice (+h)
    per_layer = t * lp * (4 * h + 2 * h + 2 * kv + 4 * inter + h)
    assert plain["per_layer"] == per_layer
    assert plain["logits"] == t * vocab * (2 + 8)
    assert plain["total"] == layers * per_layer + t * vocab * 10 + 2 * t * lp * h
    long_context = LongContext(sp=sp, tiled_mlp=True, tiled_loss=True)
    tiled = activation_bytes(shape, work, long_context=long_context)
    tile = 4096  # train.tile_tokens' default
    assert tiled["per_layer"] == t * lp * (4 * h + 2 * h + 2 * kv + h)  # no MLP intermediates kept
    assert tiled["mlp_tile"] == 2 * tile * lp * 4 * inter  # one tile's intermediates, and their gradients
    assert tiled["logits"] == tile * vocab * 10 + vocab * h * lp  # one tile; the lm_head-sized gradient buffer
    assert tiled["layers"] == layers * t * lp * h  # checkpointing: block inputs only
    assert tiled["total"] == tiled["layers"] + tiled["per_layer"] + tiled["mlp_tile"] + tiled["logits"] + 2 * t * lp * h
    off = activation_bytes(shape, work, long_context=LongContext(sp=sp, tiled_mlp=True, tiled_loss=True, offload=True))
    assert off["cpu_offload"] == layers * t * lp * h and off["layers"] == 2 * t * lp * h
    assert off["total"] == tiled["total"] - (layers - 2) * t * lp * h


def test_gpt2_tiling_drops_its_two_mlp_tensors():
    shape = model_shape(KNOWN["gpt2"])
    work, tiled_mlp = Workload(1024, 2, "fp32", False), LongContext(tiled_mlp=True)
    full, tiled = activation_bytes(shape, work), activation_bytes(shape, work, long_context=tiled_mlp)
    assert full["per_layer"] - tiled["per_layer"] == 2048 * 4 * 2 * 3072  # fc out and gelu out, fp32
    assert tiled["mlp_tile"] == 2 * 2048 * 4 * 2 * 3072  # all 2048 tokens: fewer than one 4096-token tile
    small_tiles = work.but(tile_tokens=512)
    assert activation_bytes(shape, small_tiles, long_context=tiled_mlp)["mlp_tile"] == 2 * 512 * 4 * 2 * 3072


def test_tiling_lowers_the_logits_bytes_and_sp_divides_them():
    _, shape, _ = llama8b()
    work = Workload(131072, 1, "bf16", activation_checkpointing=True)
    full = activation_bytes(shape, work)["logits"]
    tiled = activation_bytes(shape, work, long_context=LongContext(tiled_loss=True))["logits"]
    assert tiled < full / 20 and full == 131072 * 128256 * 10
    assert activation_bytes(shape, work, long_context=LongContext(sp=2))["logits"] * 2 == full


def test_mask_bytes_of_each_attention():
    _, shape, _ = llama8b()
    work, sp2 = Workload(131072, 1, "bf16", activation_checkpointing=True), LongContext(sp=2)
    flash = activation_bytes(shape, work)
    assert flash["mask"] == 0 and activation_bytes(shape, work.but(attention="flex"))["mask"] == 0
    assert activation_bytes(shape, work.but(attention="sdpa"))["mask"] == 16 * GIB  # the 16 GiB at 128K
    # under SP the harness's document_sdpa builds the mask over the gathered sequence: S^2 on every rank
    sdpa = activation_bytes(shape, work.but(attention="sdpa"), long_context=sp2)
    assert sdpa["mask"] == 16 * GIB
    # torch's sdpa keeps an additive bf16 copy of the mask for backward in every block that runs with gradients
    assert sdpa["per_layer"] - activation_bytes(shape, work, long_context=sp2)["per_layer"] == 131072**2 * 2
    eager = activation_bytes(shape, work.but(attention="eager"))
    assert eager["mask"] == 32 * GIB  # bf16 additive mask
    assert eager["per_layer"] - activation_bytes(shape, work)["per_layer"] == 2 * 32 * 131072**2 * 2
    with pytest.raises(ValueError, match="attention 'xla'"):
        activation_bytes(shape, work.but(attention="xla"))


def test_ulysses_all_to_all_bytes_match_hand_arithmetic():
    _, shape, _ = llama8b()
    got = sequence.a2a_bytes_per_step(shape, seq_len=1_000_000, micro_batch=1, micro_batches=2, sp=8, blocks=32,
                                      precision="bf16", activation_checkpointing=True)
    per_block = 125_000 * 2 * (4096 + 1024 + 1024 + 4096)  # q, k, v in, output back; 8 kv heads x 128
    assert got == {"all_to_all_single": per_block * 3 * 32 * 2}  # forward, backward, recompute; 2 micro-batches
    # 8 kv heads over sp 16: DeepSpeed repeats them to 16
    assert sequence.a2a_widths(shape, 16) == [4096, 2048, 2048, 4096]
    assert sequence.a2a_bytes_per_step(shape, seq_len=8, micro_batch=1, micro_batches=1, sp=1, blocks=1,
                                       precision="bf16", activation_checkpointing=False) == {}
    from harness.planner import comm

    assert comm.wire_bytes("all_to_all_single", 800, 8) == 700


def test_sp_traffic_is_in_the_step_time_and_the_comm_rows():
    cfg, shape, count = llama8b()
    p = plan(cfg, Cluster(gpus_per_node=8, gpu_mem_bytes=80 * GB), Workload(seq_len=524288), model_name="llama-3.1-8b",
             hardware_profile=hardware.load("h100-80gb-sxm"))
    sp_layouts = [r for r in p.ranked if r["sp"] > 1]
    assert sp_layouts
    for r in sp_layouts:
        rows = [row for row in r["comm"]["rows"] if row["group"] == "sp"]
        assert len(rows) == 1 and rows[0]["group_size"] == r["sp"] and rows[0]["collective"] == "all_to_all_single"
        assert r["time"]["breakdown"]["sp_a2a_s"] > 0
    assert all(r["time"]["breakdown"]["sp_a2a_s"] == 0 for r in p.ranked if r["sp"] == 1)


def test_max_seq_len_is_monotone_in_sp_and_tiling_and_the_alst_anchor():
    cfg, shape, count = llama8b()
    hw = layouts.hardware(8, 1, 80 * GB, None, None)
    work = Workload(**{"seq_len": 8192, "micro_batch": 1, "precision": "bf16", "activation_checkpointing": False,
            "grad_accum": 1, "attention": "flash"})

    def longest_of(**kw):
        return longest.max_seq_len(layouts.Candidate("zero3", 3, **kw), count, shape, hw, work)

    plain, ckpt = longest_of(), longest_of(act="checkpoint")
    tiled = longest_of(tiled=True, act="checkpoint")
    by_sp = [longest_of(sp=s, tiled=True, act="checkpoint") for s in (1, 2, 4, 8)]
    offload = longest_of(sp=8, tiled=True, act="offload")
    assert plain < ckpt < tiled == by_sp[0] and by_sp == sorted(by_sp) and len(set(by_sp)) == 4
    assert 24_000 <= ckpt <= 40_000  # ALST's plain HF run: ~32K tokens on 8 H100
    assert 3_000_000 <= offload <= 4_500_000  # ALST: 3.7M tokens, ZeRO-3, sp 8, tiling, checkpoint offload
    assert all(n % s == 0 for n, s in zip(by_sp, (1, 2, 4, 8)))
    # the answer is the edge: it fits, sp more tokens do not
    c = layouts.Candidate("zero3", 3, sp=8, tiled=True, act="offload")
    assert layouts.evaluate(c, count, shape, hw, work.but(seq_len=offload))["fits"]
    assert not layouts.evaluate(c, count, shape, hw, work.but(seq_len=offload + 8))["fits"]
    # activation offload needs CPU RAM: 32 blocks' inputs per rank; 256 GB per node caps it
    small = layouts.hardware(8, 1, 80 * GB, 256 * GB, None)
    capped = longest.max_seq_len(c, count, shape, small, work)
    assert capped < offload and 32 * capped // 8 * 2 * 4096 * 8 <= small.usable_cpu_bytes


def test_the_long_context_rung_comes_last_and_refuses_what_ulysses_cannot_split():
    cfg, shape, count = llama8b()
    p = plan(cfg, Cluster(gpus_per_node=8, gpu_mem_bytes=80 * GB), Workload(seq_len=250_000), model_name="llama-3.1-8b")
    labels = [c["label"] for c in p.candidates]
    rung = labels.index("zero3 ckpt")
    assert all(not c["act"] for c in p.candidates[:rung]) and all(c["act"] for c in p.candidates[rung:])
    assert labels[rung:rung + 5] == ["zero3 ckpt", "zero3 tiled ckpt", "zero3 sp2 tiled ckpt", "zero3 sp4 tiled ckpt",
                                     "zero3 sp8 tiled ckpt"]
    rec = p.recommended
    assert rec["label"] == "zero3 sp2 tiled ckpt" and rec["max_seq_len"] >= 250_000  # 289K; sp1 tiled: 148K
    assert rec["overrides"]["parallel.sequence"] == 2 and rec["overrides"]["train.tiled_mlp"] is True
    assert "--set parallel.sequence=2" in rec["launch"]
    # seq_len % sp and heads % sp are refused with the numbers
    odd = plan(cfg, Cluster(gpus_per_node=8, gpu_mem_bytes=80 * GB), Workload(seq_len=250_001),
               model_name="llama-3.1-8b")
    sp2 = next(c for c in odd.candidates if c["label"] == "zero3 sp2 tiled ckpt")
    assert not sp2["applicable"] and sp2["why_not"] == "seq_len 250001 does not divide by sp 2"
    assert sp2["max_seq_len"] == rec["max_seq_len"]  # what it holds does not depend on the seq_len asked
    def heads(q: int, kv: int):
        return model_shape(cfg).but(num_attention_heads=q, num_key_value_heads=kv)

    assert sequence.sp_problem(heads(12, 12), 8) == \
        "12 attention heads do not divide by sp 8"
    assert sequence.sp_problem(heads(24, 6), 4) == \
        "6 kv heads: neither kv % sp nor sp % kv is 0 (sp 4)"
    assert sequence.sp_degrees(6, heads(12, 4)) == [2]


def test_plan_a_million_tokens_on_eight_h100s_in_under_five_seconds():
    from harness.cli import main

    out = io.StringIO()
    start = time.perf_counter()
    with redirect_stdout(out):
        code = main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-mem", "80GB", "--seq-len", "1000000",
                     "--hardware", "h100-80gb-sxm", "--json"])
    elapsed = time.perf_counter() - start
    assert code == 0 and elapsed < 5, elapsed
    result = json.loads(out.getvalue())
    rec = result["recommended"]
    assert rec["fits"] and rec["sp"] > 1 and rec["max_seq_len"] >= 1_000_000
    for r in result["candidates"] + result["ranked"]:
        assert isinstance(r["max_seq_len"], int) and r["max_seq_len"] >= 0
        assert (r["max_seq_len"] >= 1_000_000) == r["fits"] or not r["applicable"], r["label"]
    with redirect_stdout(io.StringIO()) as text:
        main(["plan", "--model", "llama-3.1-8b", "--gpus", "8", "--gpu-mem", "80GB", "--seq-len", "1000000"])
    table = text.getvalue()
    assert "max seq" in table and re.search(r"[\d.]+M  <- first fit in the decision order", table)
    # the optimizer and parameters in CPU RAM leave sp8 tiled ckpt->cpu's 3.87M more room (ALST: 3.7M)
    longest_line = re.search(r"longest sequence of any layout: zero3 opt->cpu params->cpu sp8 tiled ckpt->cpu holds "
                             r"([\d,]+) tokens", table)
    assert longest_line and 3_870_000 <= int(longest_line.group(1).replace(",", "")) <= 2 * 3_700_000


def test_auto_recipe_picks_sequence_parallel_for_a_long_sequence():
    from harness.config.recipes import complete
    from harness.train.auto_recipe import plan_for, planner_attention

    # 8 CPU ranks of 80 GB: sdpa, whose S^2 mask (bool, and the copy torch keeps per block) leaves one rank 79K
    # tokens with tiling; sp 2 holds 98K
    hw = {"gpus_per_node": 8, "nodes": 1, "gpu_mem_bytes": 80 * GB, "cpu_mem_bytes": 2000 * GB, "nvme_bytes": None,
          "device": "cpu"}
    settings = complete({"description": "auto"}, "--recipe auto",
                        ["train.model=llama-3.1-8b", "train.seq_len=90112", "precision=bf16",
                         "batch.micro_batch_per_gpu=1"])
    result = plan_for(settings, hw, hardware.load("h100-80gb-sxm"))
    best = result.recommended
    assert best["sp"] > 1 and best["overrides"]["parallel.sequence"] == best["sp"] and best["max_seq_len"] >= 90112
    assert not any(r["act"] == "offload" for r in result.candidates + result.ranked)  # refused on CPU ranks
    short = complete({"description": "auto"}, "--recipe auto", ["train.model=llama-3.1-8b", "train.seq_len=2048"])
    assert plan_for(short, hw, hardware.load("h100-80gb-sxm")).recommended["sp"] == 1
    assert planner_attention(None, "cpu") == "sdpa" and planner_attention("flash_attention_2", "cuda") == "flash"
    assert planner_attention("document_sdpa", "cuda") == "sdpa" and planner_attention("flex_attention", "cpu") == "flex"


def test_cpu_ranks_with_sdpa_count_the_mask():
    shape = model_shape(PRESETS["tiny-llama"])
    work, sp2 = Workload(4096, 1, "fp32", False), LongContext(sp=2)
    a = activation_bytes(shape, work.but(attention="sdpa"), long_context=sp2)
    b = activation_bytes(shape, work, long_context=sp2)
    # document_sdpa under SP: the whole sequence's bool mask, and the fp32 copy torch's sdpa keeps per block (2 blocks)
    assert a["total"] - b["total"] == 4096 * 4096 + 2 * 4096 * 4096 * 4


def plain_layer(shape) -> int:
    """One tiny-llama block's saved tensors at 512 tokens per rank, fp32, tiled MLP, no mask (the hand count)."""
    return 512 * 4 * (4 * 64 + 2 * 64 + 2 * 32)


def test_a_runs_prediction_carries_the_sp_all_to_all_into_the_reports_comm_table():
    from pathlib import Path

    from harness.config.run_model import Batch, Degrees, RunModel, Sequence, Zero
    from harness.planner import evaluate
    from harness.planner.rank import LiveFacts
    from harness.report.compare import Run, comm_rows

    shape = model_shape(PRESETS["tiny-llama"])  # hidden 64, 4 heads, 2 kv heads of 16, 2 blocks
    count = LiveFacts(total=100_000, largest_layer=32_768, largest_tensor=32_768, persistent=0)
    recipe = {"parallel": {"sequence": 2}, "train": {"tiled_mlp": True, "tiled_loss": True, "attention": "sdpa"}}
    ds = {"zero_optimization": {"stage": 3}, "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 1}

    def run(sp: int, long_context: bool) -> RunModel:  # zero_shards 2: dp 2 / sp 1, or dp 1 x sp 2
        seq = Sequence(1024, tiled_mlp=long_context, tiled_loss=long_context,
                       attention="sdpa" if long_context else "flash")
        return RunModel("tiny-llama", PRESETS["tiny-llama"], "fp32", Degrees(2, sp=sp), Zero.of(ds), Batch(1, 2, 2),
                        seq)

    out = evaluate(run(2, True), live=count).rank
    a2a = 512 * 4 * (64 + 32 + 32 + 64) * 2 * 2 * 2  # tokens/rank x fp32 x (q, k, v, out) x fwd+bwd x blocks x accum
    assert out["comm"]["all_to_all_single"] == a2a
    assert out["activations"]["mask"] == 1024 * 1024 and out["activations"]["tokens_per_rank"] == 512
    assert out["activations"]["per_layer"] - plain_layer(shape) == 1024 * 1024 * 4 + 512 * 4 * 64  # mask copy, out
    plain = evaluate(run(1, False), live=count).rank
    assert "all_to_all_single" not in plain["comm"] and plain["activations"]["mask"] == 0
    for measured, flagged in ((a2a, False), (2 * a2a, True)):
        summary = {"comm": {"predicted": out["comm"], "measured_per_rank": [{"all_to_all_single": measured}] * 2}}
        row = next(r for r in comm_rows(Run(Path("."), [], summary, recipe, ds)) if r["collective"] == "all_to_all_single")
        assert row["predicted"] == a2a and row["ratio"] == [measured / a2a] * 2 and bool(row["flag"]) == flagged


def test_concat_rows_at_sp1_have_no_mask_terms_document_rows_and_sp_do():
    """sdpa at sp 1 on concat rows runs causal without a mask (no s^2 terms); document rows, or any row under SP
    (the harness's document_sdpa builds the mask from the gathered positions), keep the s^2 mask and its copy."""
    from harness.planner import memory
    from harness.config.run_model import Sequence
    from harness.planner.rank import attention_kind, long_context

    shape = model_shape(PRESETS["tiny-llama"])
    got = {}
    for packing in ("concat", "document"):
        for sp in (1, 2):
            seq = Sequence(1024, packing=packing)
            work = Workload(1024, 1, "fp32", activation_checkpointing=True, attention=attention_kind(seq, sp))
            got[packing, sp] = memory.activation_bytes(shape, work, long_context=long_context(seq, sp))
    assert attention_kind(Sequence(1024, packing="concat"), 1) == "flash"
    assert got["concat", 1]["mask"] == 0
    assert got["document", 1]["mask"] == got["concat", 2]["mask"] == got["document", 2]["mask"] == 1024 * 1024
    # the float copy of the mask torch's sdpa saves, in the one recomputed block
    assert got["document", 1]["recompute"] - got["concat", 1]["recompute"] == 1024 * 1024 * 4


def test_a_masked_attention_costs_the_profiles_measured_factor():
    """sdpa with a materialised mask (document packing, document_sdpa under SP) computes every score and reads the
    mask where the causal kernel calibrate times skips half: its attention term is scaled by the profile's
    masked_attention_factor (default 2)."""
    from harness.planner import steptime
    from harness.planner.params import count_params

    cfg = PRESETS["tiny-llama"]
    shape, count = model_shape(cfg), count_params(cfg)
    plain = steptime.block_flops_per_token(count, shape, 4096, 1)
    assert steptime.block_flops_per_token(count, shape, 4096, 1, masked=3.0) - plain == 2 * 4 * 4096 * 64
    profile = hardware.load("h100-80gb-sxm")
    work = Workload(**{"seq_len": 4096, "micro_batch": 1, "precision": "bf16", "activation_checkpointing": False})
    times = {(a, f): steptime.compute_s(count, shape, dict(profile, **({"masked_attention_factor": f} if f else {})),
                                        work.but(attention=a), 1, 2, False)["forward"]
             for a, f in (("flash", None), ("flash", 3.0), ("sdpa", None), ("sdpa", 3.0))}
    assert times["flash", None] == times["flash", 3.0] < times["sdpa", None] < times["sdpa", 3.0]


def test_fp32_logits_have_no_upcast_copy():
    shape = model_shape(PRESETS["tiny-llama"])
    work = Workload(1024, 1, activation_checkpointing=True)
    assert activation_bytes(shape, work.but(precision="fp32"))["logits"] == 1024 * 512 * (4 + 4)  # logits, log-softmax
    assert activation_bytes(shape, work.but(precision="bf16"))["logits"] == 1024 * 512 * (2 + 4 + 4)
