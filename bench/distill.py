"""Distillation (train.objective gkd) through the harness: per teacher mode on main, the step time and the per-rank
peak memory beside the planner's prediction, and harness / TRL 1.16 GKDTrainer tokens/s on the same CPU job.

    python bench/distill.py [--steps 8] [--batch 8] [--seq-len 64] [--ranks 2] [--pairs 3] [--json FILE]
                             [--keep DIR]                                   (~4 min on 2 cores)

A Llama-shaped student (2 layers, hidden 128) and a larger teacher (4 layers, hidden 512), seeded random weights,
the shipped 512-token tokenizer with a small ChatML-like chat template (both folders), and steps x batch
chat records of random words: {"prompt": [user message], "completion": [assistant message]} for the harness (TRL's
prompt-completion form in messages), {"messages": prompt + completion} for TRL's GKDTrainer (its DataCollatorForChatML
reads only that), one epoch exactly, so both sides read every record once.

1. Teacher modes (each a harness run on --ranks ranks, --steps steps, micro batch --batch): `engine` on ZeRO-2
   (a whole teacher copy per rank), `engine` on ZeRO-3 (the teacher sharded like the student) and `adapter` under
   LoRA on ZeRO-2 (the student's base with the adapters off, no teacher named; distill.ce_alpha 0.5, else the
   student, its base at the start, would have no gradient). Reported from the runs' own files:
   median step time (step_time_s, the first step left out) and its teacher share (time/teacher_s), the peak per
   rank measured by the profiling hook over the last two steps (CPU ranks: RssAnon less malloc's free memory)
   beside the run's own prediction (summary.json memory.predicted_peak_total_per_rank, teacher counted). On CPU ranks
   the peak includes each process's own heap (Python, torch, DeepSpeed: ~300 MiB) that the planner does not price,
   so each row's peak over the adapter run's (no teacher, the same student) stands beside the planner's difference:
   the teacher's weights and logits, measured against predicted.
   `precomputed` and `served` are not on main yet: not measured here.
2. Harness (ddp, 1 rank) and TRL GKDTrainer (1 CPU process) on the same job: fp32, micro batch --batch, no
   accumulation, AdamW lr 1e-4, no weight decay, clipping 1.0, constant lr, lmbda 0 (both train on the dataset's
   completions), beta 0.5, seq_kd false, max length --seq-len. tokens/s = the input tokens the steps read (each
   side's own tokenization of the same records: attention-mask tokens, padding left out) / the training loop's
   wall time (TRL: trainer.train(); harness: first-to-last step end plus the first step), and the ratio of the
   median steps (the first left out). --pairs pairs back to back in alternating order (H T, T H, ...), so drift on a
   shared machine hits both sides; the verdict is the median of the pairs' ratios. Goal: harness / TRL >= 1.0.
   Where the two compute differently (so the comparison is read right): TRL draws one on-policy coin per micro-batch
   and process, the harness one per row (no coin matters at lmbda 0); the loss is at T = 1 on both (GKDTrainer's
   quirk, the harness's default distill.loss_temperature); the harness normalises the loss over all loss tokens of
   the step (TRL's num_items_in_batch), computes it in float32 chunks of distill.loss_chunk_tokens, and TRL over the
   whole B x L x V at once; a chat record's tokens come from each side's own rendering (the harness appends EOS
   to the completion as TRL's prompt-completion path does; TRL's ChatML collator takes the template's text as is).
The numbers are printed as a table and written to --json (default /tmp/distill_bench.json).
trl is not a dependency of the harness: `pip install --no-deps trl==1.16.0` (pinned in the `bench` extra).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT))
from overhead import deepspeed, env, fail  # noqa: E402  the same launch and environment as bench/overhead.py

GOAL = 1.0
SHAPES = {"student": dict(hidden_size=128, num_hidden_layers=2, intermediate_size=352, num_attention_heads=4),
          "teacher": dict(hidden_size=512, num_hidden_layers=4, intermediate_size=1408, num_attention_heads=8)}
TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|> {% endif %}")
MODES = (("engine", "zero2", False), ("engine", "zero3", False), ("adapter", "zero2", True))
WORDS = ("alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa")
HYPER = {"lr": 1e-4, "clip": 1.0, "beta": 0.5}


def write_model(folder: Path, shape: str, seed: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from harness.model.hf import _shipped_eos_id, load_tokenizer

    eos = _shipped_eos_id()
    cfg = LlamaConfig(vocab_size=512, num_key_value_heads=SHAPES[shape]["num_attention_heads"],
                      max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=eos, eos_token_id=eos,
                      attention_dropout=0.0, **SHAPES[shape])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    tokenizer = load_tokenizer("tiny-llama")
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def write_records(path: Path, count: int, seq_len: int) -> list[dict]:
    """Prompts of ~seq_len / 8 words, completions of ~seq_len / 5 (a word is 2-3 tokens): rows of unequal length
    that fit seq_len."""
    rng = random.Random(0)
    words = lambda lo, hi: " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))  # noqa: E731
    records = [{"prompt": [{"role": "user", "content": words(seq_len // 16, seq_len // 8)}],
                "completion": [{"role": "assistant", "content": words(seq_len // 10, seq_len // 5)}]}
               for _ in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return records


def harness_run(args, run: Path, work: Path, recipe: str, ranks: int, mode: str, lora: bool) -> dict:
    sets = {"train.model": work / "student", "train.dataset": work / "records.jsonl", "train.objective": "gkd",
            "train.steps": args.steps, "train.seq_len": args.seq_len, "precision": "fp32",
            "batch.micro_batch_per_gpu": args.batch // ranks, "batch.grad_accum_steps": 1,
            "batch.train_batch_size": '"auto"', "optimizer.type": "adamw", "optimizer.lr": HYPER["lr"],
            "optimizer.weight_decay": 0, "scheduler.type": "none", "gradient_clipping": HYPER["clip"],
            "train.eval_every": 0, "train.eval_fraction": 0, "train.save_every": 0, "train.log_every": 1,
            "distill.lmbda": 0, "distill.beta": HYPER["beta"], "distill.teacher_mode": mode}
    if lora:
        # a CE term on the completions: LoRA's B starts at 0, so the student starts equal to its base (the teacher)
        # and a divergence alone has no gradient
        sets.update({"adapter.type": "lora", "adapter.dropout": 0, "distill.ce_alpha": 0.5})
    else:
        sets["distill.teacher_model_name_or_path"] = work / "teacher"
    argv = [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    proc = deepspeed(ranks, "harness/run.py", "--recipe", recipe, "--output-dir", str(run), *argv,
                     "--profile-steps", f"{args.steps - 1}-{args.steps}")
    if not (run / "summary.json").is_file():
        raise fail(proc)
    train = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    mem = json.loads((run / "summary.json").read_text())["memory"]
    peaks = [r.get("peak_allocated_bytes", r.get("peak_in_use_bytes")) for r in mem["peak_per_rank"]]
    return {"tokens": sum(r["num_tokens"] for r in train),
            "seconds": train[-1]["time"] - train[0]["time"] + train[0]["step_time_s"],
            "step_s": statistics.median(r["step_time_s"] for r in train[1:]),
            "teacher_s": statistics.median(r["time/teacher_s"] for r in train[1:]),
            "step_tps": statistics.median(r["num_tokens"] / r["step_time_s"] for r in train[1:]),
            "peak_per_rank": peaks, "predicted_per_rank": mem["predicted_peak_total_per_rank"],
            "loss": [r["loss"] for r in train]}


TRL_SCRIPT = r"""
import json, sys, time
from datasets import Dataset
from transformers import AutoTokenizer, TrainerCallback
from trl.experimental.gkd import GKDConfig, GKDTrainer
from trl.experimental.utils import DataCollatorForChatML
work, (steps, batch, seq_len), hyper = sys.argv[1], map(int, sys.argv[2:5]), json.loads(sys.argv[5])
rows = [json.loads(line) for line in open(work + "/records.jsonl")]
data = Dataset.from_list([{"messages": r["prompt"] + r["completion"]} for r in rows])
tokenizer = AutoTokenizer.from_pretrained(work + "/student")
collate = DataCollatorForChatML(tokenizer=tokenizer, max_length=seq_len)
tokens = [int(collate([data[i]])["attention_mask"].sum()) for i in range(len(data))]
class Clock(TrainerCallback):
    def __init__(self): self.began, self.steps = 0.0, []
    def on_step_begin(self, *a, **k): self.began = time.perf_counter()
    def on_step_end(self, *a, **k): self.steps.append(time.perf_counter() - self.began)
clock = Clock()
args = GKDConfig(output_dir=work + "/trl_out", use_cpu=True, per_device_train_batch_size=batch, max_length=seq_len,
                 learning_rate=hyper["lr"], max_steps=steps, logging_steps=1, report_to=[], save_strategy="no",
                 lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=hyper["clip"],
                 seed=0, bf16=False, lmbda=0.0, beta=hyper["beta"], seq_kd=False, disable_tqdm=True)
trainer = GKDTrainer(model=work + "/student", teacher_model=work + "/teacher", args=args, train_dataset=data,
                     processing_class=tokenizer, callbacks=[clock])
began = time.perf_counter()
trainer.train()
seconds = time.perf_counter() - began
loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
per_step = [sum(tokens[i * batch:(i + 1) * batch]) for i in range(steps)]
print(json.dumps({"tokens": sum(per_step), "seconds": seconds, "step_times": clock.steps, "per_step": per_step,
                  "loss": loss}))
"""


def trl_run(args, work: Path) -> dict:
    proc = subprocess.run([sys.executable, "-c", TRL_SCRIPT, str(work), str(args.steps), str(args.batch),
                           str(args.seq_len), json.dumps(HYPER)], capture_output=True, text=True, env=env(),
                          timeout=3600)
    if proc.returncode:
        raise fail(proc)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["step_s"] = statistics.median(out["step_times"][1:])
    out["step_tps"] = statistics.median(n / t for n, t in zip(out["per_step"][1:], out["step_times"][1:]))
    return out


def mode_rows(args, work: Path) -> list[dict]:
    rows = []
    for mode, recipe, lora in MODES:
        r = harness_run(args, work / f"{mode}_{recipe}", work, recipe, args.ranks, mode, lora)
        rows.append({"mode": mode, "recipe": recipe, "ranks": args.ranks, **r})
    return rows


def pairs(args, work: Path) -> list[tuple[dict, dict]]:
    """(harness, TRL) per pair, back to back in alternating order (H T, T H, ...): drift on a shared machine hits
    both sides alike."""
    out = []
    for pair in range(args.pairs):
        sides = {}
        for side in (("harness", "trl") if pair % 2 == 0 else ("trl", "harness")):
            sides[side] = trl_run(args, work) if side == "trl" else \
                harness_run(args, work / f"harness_ddp{pair}", work, "ddp", 1, "engine", False)
        out.append((sides["harness"], sides["trl"]))
    return out


def spread(ratios: list[float]) -> str:
    return f"median {statistics.median(ratios):.2f}, range {min(ratios):.2f}-{max(ratios):.2f}"


def table(modes: list[dict], runs: list[tuple[dict, dict]], meta: dict) -> str:
    mib = 2 ** 20
    out = [f"student {meta['student_params'] / 1e6:.2f}M params, teacher {meta['teacher_params'] / 1e6:.2f}M, "
           f"{meta['records']} records, batch {meta['batch']}, seq_len {meta['seq_len']}, {meta['steps']} steps, "
           f"load average {meta['load']}",
           f"  {'teacher mode':<22}{'step ms':>9}{'teacher':>9}{'peak MiB':>10}{'planner MiB':>13}{'ratio':>7}"
           f"{'over adapter: peak':>20}{'planner':>9}"]
    base = modes[-1]  # the adapter run: the same student, no teacher model
    for r in modes:
        peak, pred = max(r["peak_per_rank"]), max(r["predicted_per_rank"])
        r["over_adapter"] = {"peak": peak - max(base["peak_per_rank"]),
                             "predicted": pred - max(base["predicted_per_rank"])}
        out.append(f"  {r['mode'] + ' on ' + r['recipe']:<22}{r['step_s'] * 1000:>9.0f}"
                   f"{r['teacher_s'] / r['step_s']:>9.0%}{peak / mib:>10.1f}{pred / mib:>13.1f}{peak / pred:>7.2f}"
                   f"{r['over_adapter']['peak'] / mib:>20.1f}{r['over_adapter']['predicted'] / mib:>9.1f}")
    out += [f"  {'1 process, same job':<22}{'tokens':>9}{'tok/s':>9}{'median step ms':>16}{'loss first -> last':>22}"]
    wall, step = [], []
    for pair, (ours, theirs) in enumerate(runs):
        wall.append((ours["tokens"] / ours["seconds"]) / (theirs["tokens"] / theirs["seconds"]))
        step.append(ours["step_tps"] / theirs["step_tps"])
        for name, r in ((f"pair {pair} harness (ddp)", ours), (f"pair {pair} TRL {meta['trl']}", theirs)):
            out.append(f"  {name:<22}{r['tokens']:>9}{r['tokens'] / r['seconds']:>9.0f}{r['step_s'] * 1000:>16.0f}"
                       f"{r['loss'][0]:>12.4f} -> {r['loss'][-1]:.4f}")
    ok = min(statistics.median(wall), statistics.median(step)) >= GOAL
    out.append(f"  harness / TRL GKDTrainer tokens/s over the loop: {spread(wall)}; of the median step: {spread(step)} "
               f"over {len(runs)} pair(s) (goal >= {GOAL}: {'ok' if ok else 'MISSED'})")
    out.append("  differs from TRL: on-policy coin per row (TRL: per micro-batch and process; none drawn at lmbda 0), "
               "T = 1 in the loss on both (distill.loss_temperature), loss over the step's tokens in float32 chunks")
    meta.update(harness_over_trl_loop=wall, harness_over_trl_median_step=step)
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8, help="rows per step (split over the ranks in part 1)")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--pairs", type=int, default=3, help="harness / TRL pairs, in the order H T, T H, H T, ...")
    parser.add_argument("--json", default="/tmp/distill_bench.json")
    parser.add_argument("--keep", help="keep the models and runs in this folder")
    args = parser.parse_args()
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="distill_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        import trl

        meta = {"student_params": write_model(work / "student", "student", 0),
                "teacher_params": write_model(work / "teacher", "teacher", 1),
                "records": len(write_records(work / "records.jsonl", args.steps * args.batch, args.seq_len)),
                "batch": args.batch, "seq_len": args.seq_len, "steps": args.steps, "trl": trl.__version__,
                "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                "load": " ".join(Path("/proc/loadavg").read_text().split()[:3])}
        modes = mode_rows(args, work)
        runs = pairs(args, work)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(table(modes, runs, meta))
    Path(args.json).write_text(json.dumps({"meta": meta, "modes": modes, "pairs": [{"harness": h, "trl": t}
                                                                                   for h, t in runs]}, indent=1))
    print(f"written: {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
