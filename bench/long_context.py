"""Long context on 2 CPU ranks (issue #24): what a rank holds against the planner, the longest sequence under a cap,
the harness against a plain DeepSpeed loop, and the predicted step time against the measured one.

    python bench/long_context.py --part memory   [--seq-lens 2048,4096,8192] [--ckpt off,on] [--sp 1,2] [--tiled off,on]
    python bench/long_context.py --part longest  [--cap-mb 256] [--granularity 1024] [--max-runs 6]
    python bench/long_context.py --part overhead [--seq-len 4096] [--pairs 3] [--steps 12] [--sp 2]
    python bench/long_context.py --part steptime [--seq-len 4096]

Each part launches real `deepspeed` ranks (wrap it in `flock /tmp/dsharness-ranks.lock`; each part is sized to take
under 5 minutes on 2 shared cores) and prints a table; --json also writes the rows. The model: tiny-llama's shape
(hidden 64, 4 heads, 2 kv heads, 2 blocks, vocab 512) with 32768 positions, written with save_pretrained to a temp
folder; ZeRO-3, fp32, micro-batch 1, the builtin corpus packed to seq_len (--packing, document by default), sdpa at
sp 1 and the harness's document_sdpa under SP (attention auto).

- memory: each rank's training peak of memory in use (RssAnon less what malloc holds free, sampled) above the memory
  in use once its engine was built (startup's engine_setup in_use_after_bytes), against the planner's peak for the
  same run (planner/rank.py: memory.activation_bytes with the run's sp, tiling, attention and offload, plus the
  transient model states) less the model states that exist by then (its after-step states). Goal: within +-15 %.
  Also printed: the old comparison (above the rank's baseline before the model was built, report/compare.peak_rows)
  and the difference of the two baselines, "runtime fixed": what building the model and the engine adds besides
  the model states (measured ~75 MiB per rank here: transformers' and DeepSpeed's runtime modules and objects, op
  libraries, gloo), the same at every seq_len, which no planner term describes (a GPU's CUDA context and
  allocator pools are likewise outside torch.cuda.max_memory_allocated). It is why the pre-build comparison was off
  by a fixed 70-90 MiB while the growth between seq_lens matched.
- longest: the planner's max_seq_len for this layout under a per-rank cap (planner/longest.py with the cap as the
  usable memory), and the measured bracket: the longest seq_len whose training peak above the built engine stays
  under the cap and the next step (--granularity) that does not, found from the prediction outwards then by
  bisection (part_longest).
- overhead: harness tokens/s over bench/raw_deepspeed.py's on the same resolved config (bench/overhead.py's pairs),
  at sp 2 on ZeRO-3: the raw side is DeepSpeed's Ulysses tutorial loop (its loss is exact on ZeRO-3; on ZeRO-0/2
  its gradient is sp x too large, which changes no work). Losses must agree step for step. Goal >= 0.98.
- steptime: `harness calibrate` for this machine at the run's shapes, then a run at sp max(--sp) (default 2)
  that records the time model's prediction beside its measured median step (report/step_time.py). Goal: within +-25 %.

sp > 1 and tiling use the recipe keys of issue #24 (parallel.sequence, train.tiled_mlp, train.tiled_loss,
train.activation_offload); where this checkout's schema lacks them the rows say "skipped" rather than run something
else.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import overhead  # noqa: E402

PEAK_TOL, TIME_TOL, GOAL = 0.15, 0.25, 0.98
POSITIONS = 32768
PACKING = ["document"]  # --packing: document (the default: s^2 masks) or concat (sp 1 sdpa runs causal, no mask)
TILE = 512  # train.tile_tokens when tiled: the default 4096 would leave these lengths in one tile


def model_folder(path: Path) -> str:
    """tiny-llama's shape with POSITIONS positions, random weights, the built-in tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from harness.model.hf import load_tokenizer
    from harness.model_shapes import PRESETS

    if not (path / "config.json").is_file():
        cfg = {k: v for k, v in PRESETS["tiny-llama"].items() if k != "model_type"}
        torch.manual_seed(7)
        config = LlamaConfig(**dict(cfg, max_position_embeddings=POSITIONS))
        AutoModelForCausalLM.from_config(config).save_pretrained(path)
        load_tokenizer("tiny-llama").save_pretrained(path)
    return str(path)


def schema_has(key: str) -> bool:
    from harness.config.schema import RECIPE_SCHEMA, subschema

    return subschema(RECIPE_SCHEMA, key) is not None


def config_sets(seq_len: int, ckpt: bool, sp: int, tiled: bool) -> list[str] | str:
    """--set overrides of one configuration, or why this checkout cannot run it."""
    sets = [f"train.seq_len={seq_len}", f"activation_checkpointing={str(ckpt).lower()}", "precision=fp32",
            "batch.micro_batch_per_gpu=1", "batch.grad_accum_steps=1", "train.eval_every=0", "train.eval_batches=1",
            f"train.packing={PACKING[0]}"]
    if sp > 1:
        if not schema_has("parallel.sequence"):
            return "skipped: parallel.sequence is not a recipe key in this checkout (sp-core's branch adds it)"
        sets.append(f"parallel.sequence={sp}")
    if tiled:
        if not schema_has("train.tiled_mlp"):
            return "skipped: train.tiled_mlp is not a recipe key in this checkout (sp-core's branch adds it)"
        sets += ["train.tiled_mlp=true", "train.tiled_loss=true", f"train.tile_tokens={TILE}"]
    return sets


def harness_run(model: str, run_dir: Path, sets: list[str], steps: int, extra_env: dict | None = None) -> Path:
    args = ["harness/run.py", "--recipe", "zero3", "--set", f"train.model={model}", "--set", f"train.steps={steps}",
            "--output-dir", str(run_dir)]
    for s in sets:
        args += ["--set", s]
    if extra_env:
        os.environ.update(extra_env)
    proc = overhead.deepspeed(2, *args)
    if not (run_dir / "summary.json").is_file():
        raise overhead.fail(proc)
    return run_dir


def peaks(run_dir: Path) -> list[dict]:
    from harness.report.compare import load_run, peak_rows

    return peak_rows(load_run(run_dir))


def part_memory(args, model: str, tmp: Path) -> list[dict]:
    rows = []
    for seq in args.seq_lens:
        for ckpt in args.ckpt:
            for sp in args.sp:
                for tiled in args.tiled:
                    sets = config_sets(seq, ckpt, sp, tiled)
                    row = {"seq_len": seq, "ckpt": ckpt, "sp": sp, "tiled": tiled}
                    if isinstance(sets, str):
                        rows.append(dict(row, note=sets))
                        print(f"  {row}: {sets}", flush=True)
                        continue
                    run = harness_run(model, tmp / f"m_{seq}_{ckpt}_{sp}_{tiled}", sets, args.steps)
                    summary = json.loads((run / "summary.json").read_text())
                    acts = summary["memory"]["predicted"].get("activations", {})
                    for p, engine in zip(peaks(run), above_engine(summary)):
                        rows.append(dict(row, rank=p["rank"], measured=p["measured"], predicted=p["predicted"],
                                         ratio=p["ratio"], activations=acts.get("total"), mask=acts.get("mask"),
                                         flag=p["flag"], **engine))
                        print(f"  seq {seq} ckpt {ckpt} sp {sp} tiled {tiled} rank {p['rank']}: above the engine "
                              f"{_mb(engine['measured_above_engine'])} vs {_mb(engine['predicted_above_engine'])} "
                              f"ratio {_r(engine['ratio_above_engine'])}; runtime fixed {_mb(engine['runtime_fixed'])};"
                              f" above the pre-build baseline {_mb(p['measured'])} vs {_mb(p['predicted'])} ratio "
                              f"{_r(p['ratio'])}", flush=True)
                    save(args, rows)  # what finished survives a timeout
    return rows


def above_engine(summary: dict) -> list[dict]:
    """Per rank: the training peak above the memory in use once the engine was built, beside the planner's peak
    less the model states that exist by then (its after-step states); and the runtime's fixed part: what building
    the model and the engine added besides those states (interpreter state of transformers' and DeepSpeed's
    modules, op libraries, gloo), which the planner does not model and the pre-build baseline leaves in."""
    memory, startup = summary["memory"], summary.get("startup", {}).get("per_rank") or []
    states = [sum(sum(v.values()) for v in terms.values()) for terms in memory.get("predicted_after_step_per_rank")]
    out = []
    for rank, peak in enumerate(memory.get("peak_per_rank", [])):
        engine = (startup[rank].get("engine_setup") or {}) if rank < len(startup) else {}
        base = engine.get("in_use_after_bytes")
        predicted = memory["predicted_peak_total_per_rank"][rank] - states[rank]
        measured = None if base is None else peak["peak_in_use_bytes"] - base
        before = (startup[rank].get("build") or {}).get("rss_anon_before_bytes") if rank < len(startup) else None
        out.append({"measured_above_engine": measured, "predicted_above_engine": predicted,
                    "ratio_above_engine": measured / predicted if measured is not None and predicted else None,
                    "runtime_fixed": None if base is None or before is None else base - before - states[rank]})
    return out


def _r(x) -> str:
    return "-" if x is None else f"{x:.3f}"


def planner_longest(model: str, cap: int, ckpt: bool, sp: int, tiled: bool) -> int:
    """The planner's max_seq_len for this run's layout with `cap` bytes usable per rank (2 ranks, one node)."""
    from harness.model_shapes import load_model_config
    from harness.planner import layouts, longest
    from harness.planner.params import count_params, model_shape

    cfg = load_model_config(model)
    count, shape = count_params(cfg), model_shape(cfg)
    from harness.config.run_model import Sequence
    from harness.planner.inputs import RESERVE_FRACTION, Workload
    from harness.planner.rank import attention_kind

    hw = layouts.hardware(2, 1, int(cap / (1 - RESERVE_FRACTION)) + 1, None, None)

    work = Workload(2048, 1, "fp32", ckpt, 1, attention=attention_kind(Sequence(2048, packing=PACKING[0]), sp),
                    packing=PACKING[0])
    c = layouts.Candidate("zero3", 3, sp=sp, tiled=tiled)
    return longest.max_seq_len(c, count, shape, hw, work)


def part_longest(args, model: str, tmp: Path) -> list[dict]:
    """The bracket [longest that fits, first that does not] under --cap-mb, to --granularity tokens: from the
    planner's prediction (rounded to the granularity) outwards by doubling steps until one length fits and one does
    not, then bisection. "Fits": every rank's training peak above its built engine (above_engine: the memory the
    planner's states + activations describe; the runtime's fixed part is outside it, as CUDA's context is outside
    max_memory_allocated on a GPU) is at most the cap. Checkpointing on, sp 1, untiled, document packing."""
    cap, step = int(args.cap_mb * 2**20), args.granularity
    predicted = planner_longest(model, cap, True, 1, False)
    tried: dict[int, int] = {}

    def fits(seq: int) -> bool:
        run = harness_run(model, tmp / f"l_{seq}", config_sets(seq, True, 1, False), args.steps)
        rows = above_engine(json.loads((run / "summary.json").read_text()))
        tried[seq] = max(r["measured_above_engine"] for r in rows)
        predicted_bytes = rows[0]["predicted_above_engine"]
        print(f"  seq {seq}: peak above the engine {_mb(tried[seq])} (planner {_mb(predicted_bytes)}, cap "
              f"{_mb(cap)}): {'fits' if tried[seq] <= cap else 'over'}", flush=True)
        shutil.rmtree(run, ignore_errors=True)
        return tried[seq] <= cap

    lo = hi = None
    seq, jump = max(step, round(predicted / step) * step), step
    while (lo is None or hi is None) and len(tried) < args.max_runs and step <= seq <= POSITIONS:
        if fits(seq):
            lo, seq = seq, seq + jump
        else:
            hi, seq = seq, seq - jump
        jump *= 2
        if lo is not None and hi is not None:
            break
        seq = min(max(seq, step), POSITIONS) if seq not in tried else seq + step
    while lo is not None and hi is not None and hi - lo > step and len(tried) < args.max_runs:
        mid = (lo + hi) // 2 // step * step
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return [{"cap_bytes": cap, "planner_max_seq_len": predicted, "measured_longest_under_cap": lo,
             "first_over_cap": hi, "granularity": step, "peaks": tried,
             "bracketed": lo is not None and hi is not None and hi - lo <= step,
             "ratio": (lo / predicted) if lo and predicted else None}]


def part_overhead(args, model: str, tmp: Path) -> list[dict]:
    """Pairs at sp = max(--sp) (default 2): the raw side is then DeepSpeed's Ulysses tutorial loop (see
    bench/raw_deepspeed.py), exact on ZeRO-3 like the harness, so the losses must agree step for step."""
    sets = config_sets(args.seq_len, True, max(args.sp), False)
    if isinstance(sets, str):
        raise SystemExit(sets)
    rows = []
    for pair in range(args.pairs):
        got = {}
        for arm in (("harness", "raw") if pair % 2 == 0 else ("raw", "harness")):
            if arm == "harness" or "cfg" not in got:
                run = harness_run(model, tmp / f"o_{pair}", sets + ["profile.steps="], args.steps)
                train = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
                train = [r for r in train if r["kind"] == "train"]
                timed = train[args.warmup_steps:]
                tokens = train[0]["tokens_per_s"] * train[0]["step_time_s"]
                wall = train[-1]["time"] - train[args.warmup_steps - 1]["time"]
                got["harness"], got["cfg"] = {"tokens_per_s": tokens * len(timed) / wall,
                                              "loss": [r["loss"] for r in train]}, run
            if arm == "raw":
                raw_args = argparse.Namespace(ranks=2, steps=args.steps, warmup_steps=args.warmup_steps)
                got["raw"] = overhead.run_raw(raw_args, got["cfg"])
        worst = overhead.check_same_work(got["harness"], got["raw"])
        rows.append({"pair": pair + 1, "harness": got["harness"]["tokens_per_s"], "raw": got["raw"]["tokens_per_s"],
                     "ratio": got["harness"]["tokens_per_s"] / got["raw"]["tokens_per_s"], "loss_rel_diff": worst})
        print(f"  pair {pair + 1}: harness {rows[-1]['harness']:.0f} tok/s, raw {rows[-1]['raw']:.0f} tok/s, ratio "
              f"{rows[-1]['ratio']:.3f}", flush=True)
    return rows


def part_steptime(args, model: str, tmp: Path) -> list[dict]:
    profile = tmp / "hardware.json"
    proc = overhead.subprocess.run([sys.executable, "-m", "harness.cli", "calibrate", "--out", str(profile), "--model",
                                    model, "--seq-len", str(args.seq_len), "--precision", "fp32"], cwd=ROOT,
                                   env=overhead.env(), capture_output=True, text=True, timeout=600)
    if not profile.is_file():
        raise overhead.fail(proc)
    sp = max(args.sp)
    run = harness_run(model, tmp / "t", config_sets(args.seq_len, True, sp, False) + ["profile.steps="], args.steps,
                      {"HARNESS_HARDWARE": str(profile)})
    st = json.loads((run / "summary.json").read_text()).get("throughput", {}).get("step_time", {})
    measured = st.get("measured_median_s_per_rank") or []
    return [{"rank": i, "predicted_s": st.get("step_time_s"), "measured_s": m,
             "ratio": m / st["step_time_s"] if m and st.get("step_time_s") else None,
             "breakdown": st.get("breakdown"), "note": st.get("note")} for i, m in enumerate(measured)] or [st]


def save(args, rows: list[dict]) -> None:
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str) + "\n")


def _mb(n) -> str:
    return "-" if n is None else f"{n / 2**20:.1f} MiB"


def growth(rows: list[dict]) -> list[str]:
    """What the peak GAINS from one seq_len to the next, measured (rank mean) against predicted: the process's own
    fixed memory (interpreter, data, engine objects: ~70-100 MiB on CPU) cancels out."""
    out = []
    key = lambda r: (r["ckpt"], r["sp"], r["tiled"])  # noqa: E731
    for config in dict.fromkeys(key(r) for r in rows if "measured" in r):
        by_seq: dict[int, list] = {}
        for r in rows:
            if "measured" in r and key(r) == config:
                by_seq.setdefault(r["seq_len"], []).append(r)
        seqs = sorted(by_seq)
        for a, b in zip(seqs, seqs[1:]):
            meas = statistics.mean(r["measured"] for r in by_seq[b]) - statistics.mean(r["measured"] for r in by_seq[a])
            pred = by_seq[b][0]["predicted"] - by_seq[a][0]["predicted"]
            rows.append({"growth": f"{a}->{b}", "ckpt": config[0], "sp": config[1], "tiled": config[2],
                         "measured_gain": meas, "predicted_gain": pred, "ratio": meas / pred if pred else None})
            out.append(f"  ckpt {config[0]} sp {config[1]} tiled {config[2]} seq {a}->{b}: peak grows {_mb(meas)} "
                       f"measured vs {_mb(pred)} predicted, ratio {meas / pred if pred else float('nan'):.3f}")
    return out


def verdict(part: str, rows: list[dict]) -> str:
    if part == "memory":
        ratios = [r["ratio_above_engine"] for r in rows if r.get("ratio_above_engine")]
        inside = sum(abs(r - 1) <= PEAK_TOL for r in ratios)
        old = [r["ratio"] for r in rows if r.get("ratio")]
        fixed = [r["runtime_fixed"] for r in rows if r.get("runtime_fixed") is not None]
        lines = [f"memory: {inside}/{len(ratios)} rank peaks above the built engine within +-{PEAK_TOL:.0%} of the "
                 f"planner's peak less its model states; above the pre-build baseline "
                 f"{sum(abs(r - 1) <= PEAK_TOL for r in old)}/{len(old)}, the runtime's fixed part "
                 f"{_mb(min(fixed, default=None))}-{_mb(max(fixed, default=None))} per rank being in that one"]
        return "\n".join(lines + growth(rows))
    if part == "longest":
        r = rows[0]
        return (f"longest under {_mb(r['cap_bytes'])}: fits {r['measured_longest_under_cap']}, over "
                f"{r['first_over_cap']} ({'bracketed' if r['bracketed'] else 'NOT bracketed'} to {r['granularity']} "
                f"tokens); planner {r['planner_max_seq_len']}")
    if part == "overhead":
        ratio = statistics.median(r["ratio"] for r in rows)
        return f"overhead: median harness / raw {ratio:.3f} ({'meets' if ratio >= GOAL else 'misses'} >= {GOAL})"
    ratios = [r["ratio"] for r in rows if r.get("ratio")]
    return f"step time: measured / predicted {[round(r, 3) for r in ratios]} (goal within +-{TIME_TOL:.0%})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("memory", "longest", "overhead", "steptime"), required=True)
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    flags = lambda s: [x == "on" for x in s.split(",")]  # noqa: E731
    p.add_argument("--seq-lens", type=ints, default=[2048, 4096, 8192])
    p.add_argument("--ckpt", type=flags, default=[False, True])
    p.add_argument("--sp", type=ints, default=[1, 2])
    p.add_argument("--tiled", type=flags, default=[False, True])
    p.add_argument("--cap-mb", type=float, default=256)
    p.add_argument("--max-runs", type=int, default=6, help="longest: runs at most")
    p.add_argument("--granularity", type=int, default=1024, help="longest: the bracket's width in tokens")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--packing", choices=("document", "concat"), default="document")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    PACKING[0] = args.packing
    with tempfile.TemporaryDirectory(prefix="long_context_") as tmp:
        model = model_folder(Path(tmp) / "model")
        rows = globals()[f"part_{args.part}"](args, model, Path(tmp))
    print(verdict(args.part, rows))
    save(args, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
