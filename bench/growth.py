"""Scale is part of correctness: what a rank holds as the work grows, beside the planner, side by side in one run.

    python bench/growth.py [--parts teacher,store,turns,optim] [--ranks 2] [--steps 5] [--json FILE] [--keep DIR]

17 launches, about 1 min each on 2 idle cores; measured 2026-12-07 at a load average of ~15 on 2 shared cores:
teacher + store 11 min, turns 7 min, optim 15 min (run the parts apart with --parts).

Each case is a harness run (harness/run.py on --ranks CPU ranks, --steps steps, the last two profiled); per rank,
from the run's own files: the steps' peak in use (summary.json memory.peak_per_rank: RssAnon less what malloc holds
free, sampled in the rank) beside the run's own prediction (memory.predicted_peak_total_per_rank), and the whole
run's RssAnon peak sampled from outside every 0.2 s up to the last step (builds and the store's write included;
bench/scale.py's watcher), VmHWM beside it. A CPU rank's peak also counts its own heap (Python, torch, DeepSpeed:
~350 MiB) that the planner does not price, so each row reads as growth: its peak less the first row's (delta)
beside the planner's delta, and that delta over the bytes of the work that grew. Step time: the median unprofiled
step (metrics.jsonl step_time_s, the first step left out).

teacher  distillation (gkd, lmbda 0, beta 0.5, fp32) with an engine teacher on ZeRO-3: the teacher x1, x2, x4 (8, 16
         and 32 layers of hidden 512) beside a fixed 0.5M student. A rank must hold teacher / ranks: delta per rank
         over the teacher's fp32 bytes grown reads 1 / ranks (0.50 on 2), not 1.
store    the precomputed teacher (distill.teacher_mode precomputed, top-256, beta 0) as the corpus grows x1, x4: the
         store (1,540 B per loss token, written up front under train.store_dir) grows x4, the steps read the same
         number of rows; memory-mapped, so a rank's peak in use must not grow with it (delta over the store's
         growth near 0; its touched pages show in VmHWM, not RssAnon).
turns    multi-turn GRPO on ZeRO-3 (tests/helpers/tool_models.py's tool-calling tiny Llama on the SecretEnv of
         tests/fixtures/rl_tools, rl.max_completion_length 512, tool tokens counted in it) as
         rl.max_tool_calling_iterations grows 1, 2, 4: the planner keeps the KV cache at prompt + completion budget
         whatever the turns (harness/planner/rl.py), so the peak must stay flat while the generate calls and their
         prefill grow (planner: prefill tokens per row, beside the measured generate seconds).
optim    AdamW fp32 states (zero2), bf16 master + states (zero2_bf16_states) and Muon (zero2_muon) on ZeRO-2, bf16, as
         the model grows x1, x2, x4 (4, 8, 16 layers of hidden 512): the optimizer's bytes per rank (master +
         moments, the profiling hook's live count) beside the planner's per-term prediction, in bytes per parameter
         per rank: a rank holds 1 / ranks of them (12 / 2, 6 / 2 and ~8 / 2 B on 2 ranks), whatever the size.
Everything written goes under a temporary folder, deleted at the end (unless --keep). Not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from harness.dist import free_port  # noqa: E402
from scale import _env, _watch  # noqa: E402  the same outside sampler and environment as bench/scale.py

MIB = 2**20
TEACHER_LAYERS = (8, 16, 32)  # x1, x2, x4 of hidden 512
OPTIM_LAYERS = (4, 8, 16)
OPTIMIZERS = {"adamw fp32 states": "zero2", "adamw bf16 master+states": "zero2_bf16_states", "muon": "zero2_muon"}
STORE_RECORDS = (256, 1024)  # x1, x4
TOOL_CAPS = (1, 2, 4)


def llama(folder: Path, hidden: int, layers: int, seed: int = 0) -> int:
    """A seeded Llama of the shipped 512-id tokenizer, with bench/distill.py's chat template (gkd records)."""
    from distill import TEMPLATE
    from transformers import AutoTokenizer

    from lora_footprint import write_model

    params = write_model(folder, vocab=512, hidden=hidden, mlp=hidden * 11 // 4, layers=layers,
                         heads=max(1, hidden // 64))
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return params


def run(out: Path, recipe: str, sets: dict, ranks: int, steps: int) -> dict:
    """One harness run; its per-rank memory and step times from its own files and the outside sampler."""
    sets = {"train.steps": steps, "train.eval_every": 0, "train.eval_fraction": 0, "train.save_every": 0,
            "train.log_every": 1, **sets}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--master_port", str(free_port()), "--num_gpus",
           str(ranks), "harness/run.py", "--recipe", recipe, "--output-dir", str(out), "--overwrite",
           "--profile-steps", f"{steps - 1}-{steps}", *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")]]
    log = out.with_suffix(".log")
    watch = _watch(cmd, _env(), log, out / "metrics.jsonl", last_step=steps)
    if watch["rc"] or not (out / "summary.json").is_file():
        raise SystemExit(f"{' '.join(cmd)} exited {watch['rc']}\n{log.read_text()[-4000:]}")
    mem = json.loads((out / "summary.json").read_text())["memory"]
    train = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    timed = train[1:steps - 2] or train[1:]
    terms = lambda rank, keys: sum(sum(rank.get(k, {}).values()) for k in keys)  # noqa: E731
    states = ("fp32_master", "optimizer_moments")
    return {"in_use": [r["peak_in_use_bytes"] for r in mem["peak_per_rank"]],
            "vmhwm": [r["peak_rss_bytes"] for r in mem["peak_per_rank"]],
            "outside": watch["peak_rss_anon_per_rank"],
            "predicted": mem["predicted_peak_total_per_rank"],
            "teacher_predicted": sum((mem["predicted"].get("teacher") or {}).values()),
            "optim": [terms(r, states) for r in mem["model_states_per_rank"]],
            "optim_predicted": [terms(r, states) for r in mem["predicted_after_step_per_rank"]],
            "step_s": statistics.median(r["step_time_s"] for r in timed),
            "generate_s": statistics.median(r.get("time/generate_s", 0) for r in timed),
            "teacher_s": statistics.median(r.get("time/teacher_s", 0) for r in timed),
            "calls": statistics.mean(r.get("tools/call_frequency", 0) for r in train),
            "seconds": watch["seconds"]}


def distill_sets(work: Path, records: Path, mode: str, teacher: Path, stores: str = "stores") -> dict:
    return {"train.model": work / "student", "train.dataset": records, "train.objective": "gkd", "train.seq_len": 64,
            "precision": "fp32", "batch.micro_batch_per_gpu": 4, "batch.grad_accum_steps": 1,
            "batch.train_batch_size": '"auto"', "distill.lmbda": 0, "distill.teacher_mode": mode,
            "distill.teacher_model_name_or_path": teacher, "train.store_dir": work / stores}


def part_teacher(work: Path, args) -> list[dict]:
    from distill import write_records

    records = work / "records.jsonl"
    write_records(records, 64, 64)
    rows = []
    for scale, layers in zip((1, 2, 4), TEACHER_LAYERS):
        folder = work / f"teacher{scale}"
        params = llama(folder, 512, layers, seed=scale)
        r = run(work / f"teacher_x{scale}", "zero3", {**distill_sets(work, records, "engine", folder),
                                                      "distill.beta": 0.5}, args.ranks, args.steps)
        rows.append({"part": "teacher", "scale": scale, "params": params, "grown_bytes": params * 4, **r})
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def part_store(work: Path, args) -> list[dict]:
    from distill import write_records

    rows = []
    for scale, count in zip((1, 4), STORE_RECORDS):
        records = work / f"corpus{scale}.jsonl"
        write_records(records, count, 64)
        sets = {**distill_sets(work, records, "precomputed", work / "small_teacher", f"stores{scale}"),
                "distill.beta": 0, "distill.loss_top_k": 256}
        r = run(work / f"store_x{scale}", "zero3", sets, args.ranks, args.steps)
        store = sum(p.stat().st_size for p in (work / f"stores{scale}").rglob("*.bin"))
        rows.append({"part": "store", "scale": scale, "records": count, "grown_bytes": store, **r})
    return rows


def part_turns(work: Path, args) -> list[dict]:
    from helpers.tool_models import ENV_FILE, call_text, tool_model_folder, write_prompts

    from harness.planner.rl import prefill_tokens

    boost = {call_text("reveal"): 6.0, "<|im_end|>": 5.0}  # a turn: a few short calls, then its end
    model = tool_model_folder(work / "tool_llama", logit_boost=boost)
    prompts = write_prompts(work / "prompts.jsonl", 64)
    rows = []
    for cap in TOOL_CAPS:
        sets = {"train.model": model, "train.dataset": prompts, "train.objective": "grpo", "precision": "fp32",
                "batch.micro_batch_per_gpu": 8, "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"',
                "rl.num_generations": 4, "rl.max_completion_length": 512, "rl.max_prompt_length": 512,
                "rl.environment_factory": f"{ENV_FILE}:SecretEnv", "rl.max_tool_calling_iterations": cap}
        r = run(work / f"turns_{cap}", "zero3", sets, args.ranks, args.steps)
        rollouts = [json.loads(line) for line in (work / f"turns_{cap}" / "rollouts.jsonl").read_text().splitlines()]
        turns = [len(x["turns"]) for x in rollouts]
        finish = [x["finish"] for x in rollouts]
        rows.append({"part": "turns", "scale": cap, "turns": statistics.mean(turns), "max_turns": max(turns),
                     "finish": {f: finish.count(f) for f in sorted(set(finish))},
                     "prefill_tokens": prefill_tokens(prompt_len=64, completion_len=512, turns=cap + 1), **r})
    return rows


def part_optim(work: Path, args) -> list[dict]:
    rows = []
    for scale, layers in zip((1, 2, 4), OPTIM_LAYERS):
        folder = work / f"model{scale}"
        params = llama(folder, 512, layers)
        for name, recipe in OPTIMIZERS.items():
            sets = {"train.model": folder, "train.seq_len": 128, "batch.micro_batch_per_gpu": 2,
                    "batch.grad_accum_steps": 1, "batch.train_batch_size": '"auto"'}
            r = run(work / f"optim_{recipe}_x{scale}", recipe, sets, args.ranks, args.steps)
            rows.append({"part": "optim", "optimizer": name, "scale": scale, "params": params, **r})
        shutil.rmtree(folder, ignore_errors=True)
    return rows


PARTS = {"teacher": part_teacher, "store": part_store, "turns": part_turns, "optim": part_optim}


def _mib(b) -> str:
    return f"{b / MIB:,.1f}"


def _delta_lines(rows: list[dict], label) -> list[str]:
    """Each row's per-rank growth over the first row's, beside the planner's and over the bytes of the work grown."""
    base = rows[0]
    out = [f"  {'':<24}{'grown MiB':>10}{'peak/rank':>10}{'planner':>9}{'delta':>8}{'planner':>9}{'d/grown':>8}"
           f"{'outside':>9}{'d/grown':>8}{'VmHWM':>8}{'step s':>8}  other"]
    for r in rows:
        grown = (r["grown_bytes"] - base["grown_bytes"]) if "grown_bytes" in r else 0
        d = max(a - b for a, b in zip(r["in_use"], base["in_use"]))
        dp = max(a - b for a, b in zip(r["predicted"], base["predicted"]))
        do = max(a - b for a, b in zip(r["outside"], base["outside"]))
        ratio = lambda x: f"{x / grown:>8.2f}" if grown else f"{'-':>8}"  # noqa: E731
        out.append(f"  {label(r):<24}{_mib(r.get('grown_bytes', 0)):>10}{_mib(max(r['in_use'])):>10}"
                   f"{_mib(max(r['predicted'])):>9}{_mib(d):>8}{_mib(dp):>9}{ratio(d)}{_mib(max(r['outside'])):>9}"
                   f"{ratio(do)}{_mib(max(r['vmhwm'])):>8}{r['step_s']:>8.2f}  {other(r)}")
    return out


def other(r: dict) -> str:
    if r["part"] == "teacher":
        return f"teacher {r['teacher_s']:.2f}s/step, planner's teacher/rank {_mib(r['teacher_predicted'])} MiB"
    if r["part"] == "store":
        return f"{r['records']} records"
    if r["part"] == "turns":
        return (f"turns/row {r['turns']:.2f} (max {r['max_turns']}), calls/completion {r['calls']:.2f}, generate "
                f"{r['generate_s']:.2f}s/step, planner prefill {r['prefill_tokens']} tokens/row, finish {r['finish']}")
    return ""


def _optim_lines(rows: list[dict]) -> list[str]:
    out = [f"  {'':<34}{'params':>8}{'optim/rank MiB':>15}{'planner':>9}{'ratio':>7}{'B/param/rank':>13}"
           f"{'vs x1':>7}{'peak/rank':>10}{'planner':>9}{'step s':>8}"]
    for name in OPTIMIZERS:
        mine = [r for r in rows if r["optimizer"] == name]
        for r in mine:
            got, want = max(r["optim"]), max(r["optim_predicted"])
            growth = (got / max(mine[0]["optim"])) / (r["params"] / mine[0]["params"])
            out.append(f"  {name + ' x' + str(r['scale']):<34}{r['params'] / 1e6:>7.1f}M{_mib(got):>15}{_mib(want):>9}"
                       f"{got / want:>7.3f}{got / r['params']:>13.2f}{growth:>7.2f}{_mib(max(r['in_use'])):>10}"
                       f"{_mib(max(r['predicted'])):>9}{r['step_s']:>8.2f}")
    return out


def table(rows: list[dict], meta: dict) -> str:
    out = [f"bench/growth.py, {meta['ranks']} CPU ranks, {meta['steps']} steps a case, load average {meta['load']}, "
           f"{meta['date']}; peak/rank, planner, delta, outside, VmHWM in MiB (delta: over the first row)"]
    labels = {"teacher": lambda r: f"teacher x{r['scale']} {r['params'] / 1e6:.1f}M",
              "store": lambda r: f"store x{r['scale']}",
              "turns": lambda r: f"max_tool_calls {r['scale']}"}
    for part, label in labels.items():
        mine = [r for r in rows if r["part"] == part]
        if mine:
            out += [f"{part}:"] + _delta_lines(mine, label)
    mine = [r for r in rows if r["part"] == "optim"]
    if mine:
        out += ["optim (ZeRO-2, bf16; optim = fp32_master + optimizer_moments):"] + _optim_lines(mine)
    out.append(f"{len(rows)} runs in {meta['minutes']:.1f} min")
    return "\n".join(out)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--json", default="/tmp/growth_bench.json")
    parser.add_argument("--keep", help="keep the models and runs in this folder")
    args = parser.parse_args(argv)
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="growth_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    start, rows = time.perf_counter(), []
    meta = {"ranks": args.ranks, "steps": args.steps, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "load": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
    try:
        llama(work / "student", 128, 2)
        llama(work / "small_teacher", 256, 2, seed=1)
        for part in args.parts.split(","):
            rows += PARTS[part](work, args)
            meta["minutes"] = (time.perf_counter() - start) / 60
            print(table(rows, meta), flush=True)
            Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
