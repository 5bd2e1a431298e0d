"""Data at scale: preparation throughput vs processes, per-rank private memory vs corpus size, time to the
first step with and without a prepared store; with --stream, train.streaming against a finished store.

    python bench/data.py [--sizes 1,10,40] [--prep-size 10] [--ranks 2] [--steps 20] [--work /tmp/dsharness_bench_data]
    python bench/data.py --stream --sizes 1,10 --prep-size 1 [--shard-tokens 524288]

Corpora are synthetic jsonl text (made-up words, ~250 tokens per document) of about 1M, 10M and 40M tokens of
the shipped tokenizer, generated once into --work.
  prep     `prepare` of the --prep-size corpus into a fresh store: one process with the fast tokenizer pinned to
           one thread (the one-core baseline), one process with the tokenizer's own threads (what a single
           process gets by default), two processes (one thread each); the corpus's Arrow cache is warmed first,
           so all time tokenization + writing; tokens/s and the ratios. Goal: 2 processes >= 1.6x one core.
           Printed beside it: the machine's own 2-process scaling on a pure CPU loop (a ceiling for the ratio
           when other jobs share the cores).
  launch   per corpus: a launch with an empty store folder (it prepares the store: local rank 0 with every core),
           then a launch with that store. Time to first step = the first train record's step-end stamp minus the
           moment the launcher was started; "data" = the launch's own load_data time (store lookup or preparation,
           memory map, split), which is the part that could depend on the corpus and is far less disturbed by a
           busy machine than the whole start-up. Goal: with a store, 1M vs 40M within 2 s.
  memory   USS (Private_Clean + Private_Dirty of /proc/PID/smaps_rollup) of every rank, sampled every 0.2 s during
           the launch with a store; the peak per rank. Store pages two ranks both read are shared (page cache);
           Goal: peak USS at 40M within 50 MB of 1M.
           And, for both launches, RssAnon (/proc/PID/status: private anonymous memory, what a rank allocated)
           of every rank while training (from the first train record on), the peak per rank. The launch without
           a store prepares it in a child process of local rank 0 (harness/data/store.py prepare_in_child), so
           Goal: without a store, peak RssAnon while training at 40M within 50 MB of 1M (issue #18: it was 565
           vs 456 MB when rank 0 tokenized in the training process).
           Measured 2026-12-01 (2 cores shared, load average 13-18; ddp, 2 ranks, 20 steps), without a store:
           rank 0 / rank 1 peak RssAnon while training 311 / 311 MB at 1M, 316 / 316 MB at 40M (+4.9 MB); the
           same launches on the code before (rank 0 tokenizing in itself): 373 / 311 MB and 480 / 315 MB (+108).
  stream   (--stream) train.streaming=true launches with empty store folders at the smallest and largest corpus (the
           writer starts with the run; shards of --shard-tokens), then at the largest a launch that builds the finished
           store first and one that finds it built. Time to first step and its data phase (streaming: the writer's
           start-up and first shard; finished: the whole tokenization) side by side; rank RSS (VmRSS) and RssAnon
           while training, largest / smallest corpus. Goal: RSS flat (<= 1.05x).
           Measured 2026-12-06 (2 cores shared by 8 sessions, load average 11-15; ddp, 2 ranks, 20 steps, 1M and 10M
           tokens, 512K-token shards): first step at 10M 94.3 s streaming (data 10.6 s), 131.3 s with the store built
           at launch (data 42.1 s), 81.8 s with it built beforehand: streaming 0.72x the built-at-launch time, its
           data phase 0.25x; rank RSS 644 / 644 MB at 1M and 10M (0.999x), RssAnon 389 / 389 MB (0.998x).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from harness.profiling.proc import status_bytes  # noqa: E402
from harness.dist import free_port  # noqa: E402
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


PREP_RUNS = {"1 process, 1 thread": (1, "false"), "1 process, tokenizer threads": (1, None), "2 processes": (2, None)}


def bench_prep(corpus: Path, work: Path, tok) -> dict:
    """{run name: (best tokens/s by wall clock, CPU seconds of that run incl. worker processes)} for PREP_RUNS.
    "1 thread" pins the fast tokenizer to one thread (TOKENIZERS_PARALLELISM=false), the one-core baseline; left
    alone, one process already spreads a batch over the cores with the tokenizer's own threads. With 2 processes
    the harness gives each worker one thread."""
    from harness.data.corpus import DataSpec, load_dataset_for
    from harness.data.store import prepare

    spec = DataSpec(str(corpus))
    load_dataset_for(spec)  # JSON -> Arrow once, outside the timings
    out: dict[str, tuple[float, float]] = {}
    for name in [*PREP_RUNS, *PREP_RUNS]:  # interleaved: drift on a shared machine hits all
        num_proc, threads = PREP_RUNS[name]
        root = work / "prep"
        shutil.rmtree(root, ignore_errors=True)
        if threads is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = threads  # the tokenizer reads it at every call
        before, start = os.times(), time.perf_counter()
        store, _ = prepare(spec, tok, 128, str(root), num_proc=num_proc)
        seconds, after = time.perf_counter() - start, os.times()
        cpu_s = sum(getattr(after, k) - getattr(before, k) for k in ("user", "system", "children_user",
                                                                        "children_system"))
        rate = store.meta["tokens"] / seconds
        if rate > out.get(name, (0, 0))[0]:
            out[name] = (rate, cpu_s)
        shutil.rmtree(root)
    os.environ.pop("TOKENIZERS_PARALLELISM", None)
    return out


def _spin(n: int) -> None:
    x = 0
    for i in range(n):
        x += i


def cpu_scaling(n: int = 20_000_000) -> float:
    """The machine's own 2-process speed-up on a pure CPU loop (what 2 cores give right now): the ceiling for
    the prep ratio. On a shared machine it can be far below 2, even below 1."""
    import multiprocessing

    start = time.perf_counter()
    _spin(n)
    one = time.perf_counter() - start
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(2) as pool:
        pool.map(_spin, [n, n])
    return 2 * one / (time.perf_counter() - start)


def uss_bytes(pid: int) -> int | None:
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:
        return None
    fields = dict(line.split(":", 1) for line in text.splitlines()[1:])
    return sum(int(fields[k].split()[0]) * 1024 for k in ("Private_Clean", "Private_Dirty"))


def rss_anon_bytes(pid: int) -> int | None:
    return status_bytes("RssAnon", pid)


def training(run_dir: Path) -> bool:
    """A train record is in the metrics: the ranks are past data preparation and engine set-up."""
    try:
        return '"kind": "train"' in (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return False


def rank_pids(run_dir: Path) -> list[int]:
    """The rank processes of this launch (python harness/run.py --local_rank=N ... run_dir), not the processes
    they fork (same command line, parent is a rank)."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0") if proc.name.isdigit() else []
            ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1]) if cmd else 0
        except OSError:
            continue
        if str(run_dir).encode() in cmd and any(c.startswith(b"--local_rank=") for c in cmd):
            found[int(proc.name)] = ppid
    return sorted(pid for pid, ppid in found.items() if ppid not in found)


def launch(args, corpus: Path, store_dir: Path, run_dir: Path, extra: tuple = ()) -> dict:
    """One training launch: time to first step, peak USS per rank, peak RssAnon and RSS per rank while training,
    and whether it prepared the store. extra: more harness/run.py arguments."""
    cmd = [str(BIN / "deepspeed"), "--master_port", str(free_port()), "--num_gpus", str(args.ranks),
           "harness/run.py", "--recipe", "ddp", "--set", "precision=fp32", "--set", f"train.dataset={corpus}",
           "--set", f"train.store_dir={store_dir}", "--set", f"train.steps={args.steps}", "--set",
           "train.eval_every=0", "--set", "train.log_every=1", "--profile-steps", "", "--output-dir", str(run_dir),
           "--overwrite", *extra]
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    peaks: dict[int, int] = {}
    anon: dict[int, int] = {}
    rss: dict[int, int] = {}
    mine: set[int] = set()
    while proc.poll() is None:
        mine.update(rank_pids(run_dir))
        trains = training(run_dir)
        for pid in mine:
            uss = uss_bytes(pid)
            if uss is not None:
                peaks[pid] = max(peaks.get(pid, 0), uss)
            held = rss_anon_bytes(pid) if trains else None
            if held is not None:
                anon[pid] = max(anon.get(pid, 0), held)
            whole = status_bytes("VmRSS", pid) if trains else None
            if whole is not None:
                rss[pid] = max(rss.get(pid, 0), whole)
        time.sleep(0.2)
    output = proc.stdout.read()
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} exited {proc.returncode}\n{output[-4000:]}")
    train = [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if r["kind"] == "train"]
    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    ready = re.search(r"data ready in ([0-9.]+)s", output)
    return {"first_step_s": train[0]["time"] - start, "uss_mb": [peaks[p] / 1e6 for p in sorted(peaks)],
            "anon_mb": [anon[p] / 1e6 for p in sorted(anon)], "rss_mb": [rss[p] / 1e6 for p in sorted(rss)],
            "prepared": "prepared store" in output, "data_s": float(ready.group(1))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,10,40", help="corpus sizes in millions of tokens")
    p.add_argument("--prep-size", type=int, default=10, help="corpus (M tokens) for the num_proc comparison")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--work", type=Path, default=Path("/tmp/dsharness_bench_data"))
    p.add_argument("--skip-prep", action="store_true")
    p.add_argument("--skip-launch", action="store_true")
    p.add_argument("--stream", action="store_true", help="only the streaming comparison (train.streaming=true)")
    p.add_argument("--shard-tokens", type=int, default=2**19, help="train.stream_shard_tokens for --stream")
    args = p.parse_args()
    from harness.model.hf import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    args.work.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    corpora = {m: make_corpus(args.work / f"corpus_{m}M.jsonl", m * 10**6, tok) for m in sorted({*sizes, args.prep_size})}
    if args.stream:
        return bench_stream(args, corpora)
    if not args.skip_prep:
        scaling = cpu_scaling()
        rates = bench_prep(corpora[args.prep_size], args.work, tok)
        scaling = min(scaling, cpu_scaling())
        one, threads, two = (rates[name] for name in PREP_RUNS)
        for name, (rate, cpu_s) in rates.items():
            print(f"prep {args.prep_size}M tokens, {name}: {rate / 1e6:.2f}M tok/s ({cpu_s:.1f} CPU s)", flush=True)
        print(f"prep ratio 2 processes / 1 process on 1 thread: {two[0] / one[0]:.2f}x (goal >= 1.6x); / 1 process "
              f"with the tokenizer's threads: {two[0] / threads[0]:.2f}x ({os.cpu_count()} cores, load average "
              f"{os.getloadavg()[0]:.1f}; the machine's own 2-process scaling on a pure CPU loop: {scaling:.2f}x)",
              flush=True)
    if args.skip_launch:
        return 0
    rows = {}
    for m in sizes:
        store_dir = args.work / f"stores_{m}M"
        shutil.rmtree(store_dir, ignore_errors=True)
        cold = launch(args, corpora[m], store_dir, args.work / f"run_{m}M")
        warm = launch(args, corpora[m], store_dir, args.work / f"run_{m}M")
        assert cold["prepared"] and not warm["prepared"], (cold, warm)
        rows[m] = (cold, warm)
        print(f"{m:>3}M tokens: first step {cold['first_step_s']:.1f}s without store (data {cold['data_s']:.2f}s), "
              f"{warm['first_step_s']:.1f}s with (data {warm['data_s']:.2f}s); peak USS per rank with store "
              f"{', '.join(f'{u:.0f}' for u in warm['uss_mb'])} MB; peak RssAnon per rank while training without "
              f"store {', '.join(f'{u:.0f}' for u in cold['anon_mb'])} MB, with "
              f"{', '.join(f'{u:.0f}' for u in warm['anon_mb'])} MB", flush=True)
    for name, i in (("without", 0), ("with", 1)):
        a, b = rows[min(sizes)][i]["anon_mb"], rows[max(sizes)][i]["anon_mb"]
        print(f"RssAnon while training, {name} a store, {max(sizes)}M - {min(sizes)}M: "
              f"{max(y - x for x, y in zip(a, b)):+.1f} MB per rank (goal <= 50)")
    small, large = rows[min(sizes)][1], rows[max(sizes)][1]
    uss_delta = max(b - a for a, b in zip(small["uss_mb"], large["uss_mb"]))
    first_delta = large["first_step_s"] - small["first_step_s"]
    data_delta = large["data_s"] - small["data_s"]
    print(f"USS {max(sizes)}M - {min(sizes)}M: {uss_delta:+.1f} MB (goal <= 50); time to first step with store "
          f"{max(sizes)}M - {min(sizes)}M: {first_delta:+.1f}s, of it the data phase {data_delta:+.2f}s "
          f"(goal within 2 s)")
    return 0


def bench_stream(args, corpora: dict) -> int:
    """--stream: streamed launches on the smallest and largest corpus (empty store folders: the writer starts with
    the run), and at the largest a launch that builds the finished store first and one that finds it built."""
    small, large = min(corpora), max(corpora)
    streamed = ("--set", "train.streaming=true", "--set", f"train.stream_shard_tokens={args.shard_tokens}")
    out = {}
    for m in (small, large):
        store_dir = args.work / f"stream_stores_{m}M"
        shutil.rmtree(store_dir, ignore_errors=True)
        out[m] = launch(args, corpora[m], store_dir, args.work / f"stream_run_{m}M", streamed)
        print(f"{m:>3}M tokens, streaming: first step {out[m]['first_step_s']:.1f}s (data {out[m]['data_s']:.2f}s); "
              f"peak RSS per rank while training {', '.join(f'{u:.0f}' for u in out[m]['rss_mb'])} MB, RssAnon "
              f"{', '.join(f'{u:.0f}' for u in out[m]['anon_mb'])} MB", flush=True)
    store_dir = args.work / f"stores_{large}M"
    shutil.rmtree(store_dir, ignore_errors=True)
    cold = launch(args, corpora[large], store_dir, args.work / f"run_{large}M")
    warm = launch(args, corpora[large], store_dir, args.work / f"run_{large}M")
    print(f"{large:>3}M tokens, finished store: first step {cold['first_step_s']:.1f}s when the launch builds it "
          f"(data {cold['data_s']:.2f}s), {warm['first_step_s']:.1f}s when it is built", flush=True)
    stream = out[large]["first_step_s"]
    print(f"time to first step at {large}M ({large // small}x the corpus): streaming {stream:.1f}s = "
          f"{stream / cold['first_step_s']:.2f}x the finished store built at launch, {stream / warm['first_step_s']:.2f}x "
          f"the store built beforehand; its data phase (writer start-up and first shard) {out[large]['data_s']:.1f}s = "
          f"{out[large]['data_s'] / cold['data_s']:.2f}x the finished store's built at launch")
    for name in ("rss_mb", "anon_mb"):
        ratio = max(b / a for a, b in zip(out[small][name], out[large][name]))
        print(f"streaming, {name[:-3]} per rank at {large}M / {small}M: {ratio:.3f}x (goal: flat, <= 1.05x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
