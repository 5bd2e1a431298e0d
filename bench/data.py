"""Data at scale: preparation throughput vs processes, per-rank private memory vs corpus size, time to the
first step with and without a prepared store.

    python bench/data.py [--sizes 1,10,40] [--prep-size 10] [--ranks 2] [--steps 20] [--work /tmp/dsharness_bench_data]

Corpora are synthetic jsonl text (made-up words, ~250 tokens per document) of about 1M, 10M and 40M tokens of
the shipped tokenizer, generated once into --work.
  prep     `prepare` of the --prep-size corpus into a fresh store with num_proc 1, then 2 (the corpus's Arrow cache
           is warmed first, so both time tokenization + writing); tokens/s and the ratio. Goal >= 1.6x.
  launch   per corpus: a launch with an empty store folder (it prepares the store: local rank 0 with every core),
           then a launch with that store. Time to first step = the first train record's step-end stamp minus the
           moment the launcher was started. Goal: with a store, 1M vs 40M within 2 s.
  memory   USS (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) of every rank, sampled every 0.2 s during
           the launch with a store; the peak per rank. Store pages two ranks both read are shared (page cache);
           Goal: peak USS at 40M within 50 MB of 1M.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.train.dist import free_port  # noqa: E402
from overhead import BIN, env  # noqa: E402  (bench/ is on sys.path when this runs as a script)

TOKENS_PER_DOC = 250


def make_corpus(path: Path, tokens: int, tok, seed: int = 0) -> Path:
    """jsonl of made-up words with about `tokens` tokens; calibrated on a sample."""
    if path.is_file():
        return path
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    words = ["".join(rng.choice(letters, rng.integers(2, 9))) for _ in range(5000)]
    sample = " ".join(rng.choice(words, 2000))
    per_word = len(tok(sample)["input_ids"]) / 2000
    words_per_doc = int(TOKENS_PER_DOC / per_word)
    num_docs = int(tokens / (words_per_doc * per_word + 1))
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        for start in range(0, num_docs, 1000):
            picks = rng.choice(words, (min(1000, num_docs - start), words_per_doc))
            f.write("".join(json.dumps({"text": " ".join(row)}) + "\n" for row in picks))
    os.replace(tmp, path)
    return path


def bench_prep(corpus: Path, work: Path, tok) -> dict:
    from harness.train.data import DataSpec, load_dataset_for
    from harness.train.store import prepare

    spec = DataSpec(str(corpus))
    load_dataset_for(spec)  # JSON -> Arrow once, outside the timings
    out = {}
    for num_proc in (1, 2, 1, 2):  # interleaved: drift on a shared machine hits both
        root = work / f"prep_{num_proc}"
        shutil.rmtree(root, ignore_errors=True)
        start = time.perf_counter()
        store, _ = prepare(spec, tok, 128, str(root), num_proc=num_proc)
        seconds = time.perf_counter() - start
        out.setdefault(num_proc, []).append(store.meta["tokens"] / seconds)
        shutil.rmtree(root)
    return {n: max(v) for n, v in out.items()}


def uss_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines()[1:])
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))


def rank_pids(launcher: int) -> list[int]:
    """The rank processes under a deepspeed launcher: python harness/run.py --local_rank=N."""
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmd = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"harness/run.py" in cmd and any(c.startswith(b"--local_rank=") for c in cmd):
                out.append(int(proc.name))
    return sorted(out)


def launch(args, corpus: Path, store_dir: Path, run_dir: Path) -> dict:
    """One training launch: time to first step, peak USS per rank, and whether it prepared the store."""
    cmd = [str(BIN / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(args.ranks),
           "harness/run.py", "--recipe", "ddp", "--set", "precision=fp32", "--set", f"train.dataset={corpus}",
           "--set", f"train.store_dir={store_dir}", "--set", f"train.steps={args.steps}", "--set",
           "train.eval_every=0", "--set", "train.log_every=1", "--profile-steps", "", "--output-dir", str(run_dir),
           "--overwrite"]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    mine: set[int] = set()
    while proc.poll() is None:
        mine.update(pid for pid in rank_pids(proc.pid) if str(run_dir) in Path(f"/proc/{pid}/cmdline").read_text())
        for pid in mine:
            uss = uss_bytes(pid)
            if uss is not None:
                peaks[pid] = max(peaks.get(pid, 0), uss)
        time.sleep(0.2)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{output[-4000:]}")
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    return {"first_step_s": train[0]["time"] - start, "uss_mb": [peaks[p] / 1e6 for p in sorted(peaks)],
            "prepared": "prepared store" in output}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,10,40", help="corpus sizes in millions of tokens")
    p.add_argument("--prep-size", type=int, default=10, help="corpus (M tokens) for the num_proc comparison")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--work", type=Path, default=Path("/tmp/dsharness_bench_data"))
    p.add_argument("--skip-prep", action="store_true")
    args = p.parse_args()
    from harness.train.models import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    corpora = {m: make_corpus(args.work / f"corpus_{m}M.jsonl", m * 10**6, tok) for m in sorted({*sizes, args.prep_size})}
    if not args.skip_prep:
        rates = bench_prep(corpora[args.prep_size], args.work, tok)
        print(f"prep {args.prep_size}M tokens: num_proc 1 {rates[1] / 1e6:.2f}M tok/s, num_proc 2 {rates[2] / 1e6:.2f}M "
              f"tok/s, ratio {rates[2] / rates[1]:.2f}x (goal >= 1.6x, {os.cpu_count()} cores)", flush=True)
    rows = {}
    for m in sizes:
        store_dir = args.work / f"stores_{m}M"
        shutil.rmtree(store_dir, ignore_errors=True)
        cold = launch(args, corpora[m], store_dir, args.work / f"run_{m}M")
        warm = launch(args, corpora[m], store_dir, args.work / f"run_{m}M")
        assert cold["prepared"] and not warm["prepared"], (cold, warm)
        rows[m] = (cold, warm)
        print(f"{m:>3}M tokens: first step {cold['first_step_s']:.1f}s without store, {warm['first_step_s']:.1f}s with; "
              f"peak USS per rank with store {', '.join(f'{u:.0f}' for u in warm['uss_mb'])} MB", flush=True)
    small, large = rows[min(sizes)][1], rows[max(sizes)][1]
    uss_delta = max(b - a for a, b in zip(small["uss_mb"], large["uss_mb"]))
    first_delta = large["first_step_s"] - small["first_step_s"]
    print(f"USS {max(sizes)}M - {min(sizes)}M: {uss_delta:+.1f} MB (goal <= 50); time to first step with store "
          f"{max(sizes)}M - {min(sizes)}M: {first_delta:+.1f}s (goal within 2 s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
