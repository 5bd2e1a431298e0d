"""ZeRO-3 and pipeline across a real wire, open and slowed: predicted vs measured step time, and the planner's pick.

Two hosts (tests/helpers/twohosts.py: two network namespaces joined by a veth pair, one rank each, root only) train a
Llama-shaped model of ~3.5M parameters, whose ZeRO-3 traffic (weights gathered twice per step, gradients
reduce-scattered: ~20 MB each way per step) is large beside its pipeline traffic (activations at one stage
boundary: ~2 MB), with the same global batch of 8 x 128 tokens:

1. `harness calibrate` on this machine at the model's shapes (2 ranks: compute, memory, the ZeRO step), once;
2. per wire, open and capped with a tbf at --rate (no netem in this kernel; see tests/helpers/twohosts.py):
   `harness calibrate --link` across the hosts (the wire's curves), then zero3 and pipeline for --steps each,
   the run's prediction made on that profile ($HARNESS_HARDWARE) beside each rank's measured median step;
3. `harness plan` on each wire's profile: the layout it recommends for this model on 2 nodes x 1 rank.

    sudo python bench/two_hosts.py [--rate 100mbit] [--steps 6] [--base FILE] [--work DIR]

Pass: every prediction within +-25 % of the measured time on the slow wire, and the planner recommending a
pipeline on the slow wire. Takes about 10 minutes here (2 cores, shared).
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from helpers import twohosts  # noqa: E402
from helpers.launch import env  # noqa: E402
from helpers.bench_shapes import LLAMA_3M  # noqa: E402
from time_model import make_model  # noqa: E402

MODEL = LLAMA_3M
SEQ_LEN = 128
BATCH = {"zero3": (4, 1), "pipeline": (2, 4)}  # (micro, accum): 8 sequences per step on 2 ranks (pipeline: 1 replica)
TOLERANCE = 0.25


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(twohosts.HARNESS), *args], cwd=ROOT, env=env(), capture_output=True, text=True,
                          check=True)


def run_recipe(hosts, recipe: str, model: Path, work: Path, steps: int, profile: Path) -> dict:
    micro, accum = BATCH[recipe]
    out = work / f"run-{recipe}"
    shutil.rmtree(out, ignore_errors=True)
    os.environ["HARNESS_HARDWARE"] = str(profile)
    args = ["--recipe", recipe, "--model", str(model), "--output-dir", str(out), "--set", f"train.steps={steps}",
            "--set", f"train.seq_len={SEQ_LEN}", "--set", f"batch.micro_batch_per_gpu={micro}",
            "--set", f"batch.grad_accum_steps={accum}", "--set", "batch.train_batch_size=auto",
            "--set", "train.eval_every=0", "--set", "profile.steps=", "--set", "precision=fp32"]
    procs, logs = twohosts.start_nodes(hosts, work, args, recipe)
    codes = twohosts.wait_nodes(procs, timeout_s=1800)
    if codes != [0, 0]:
        raise SystemExit(f"{recipe}: exit codes {codes}{twohosts.tails(logs)}")
    st = json.loads((out / "summary.json").read_text())["throughput"]["step_time"]
    return {"recipe": recipe, "predicted_s": st.get("step_time_s"), "measured_s": max(st["measured_median_s_per_rank"]),
            "breakdown": st.get("breakdown", {}), "note": st.get("note")}


def recommend(model: Path, profile: Path) -> dict:
    plan = json.loads(harness("plan", "--model", str(model), "--gpus", "1", "--nodes", "2", "--hardware",
                              str(profile), "--seq-len", str(SEQ_LEN), "--global-batch", "8", "--precision", "fp32",
                              "--json").stdout)
    rec = plan["recommended"]
    top = [f"{r['label']} (micro {r['micro_batch']}) {r['time']['step_time_s']:.3f} s" for r in plan["ranked"][:4]]
    return {"recommended": rec["label"], "step_time_s": rec["time"]["step_time_s"], "why": plan["comparison"]["why"],
            "ranked": top}


def summary_line(r: dict) -> str:
    err = r["measured_s"] / r["predicted_s"] - 1 if r["predicted_s"] else float("nan")
    terms = ", ".join(f"{k.removesuffix('_s')} {v:.3f}" for k, v in r["breakdown"].items() if v)
    return (f"{r['recipe']:<9} predicted {r['predicted_s'] or float('nan'):6.3f} s  measured {r['measured_s']:6.3f} s"
            f"  error {err:+.0%}   [{terms}]")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default="100mbit", help="the slow wire's cap (tc tbf rate)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--base", help="a node profile from `harness calibrate` at this model (default: calibrate)")
    parser.add_argument("--work", default="/tmp/dsharness-two-hosts")
    parser.add_argument("--wires", default="open,slow")
    args = parser.parse_args()
    why = twohosts.unavailable()
    if why:
        print(f"two hosts: {why}")
        return 2
    work = Path(args.work)
    model = work / "llama-3m"
    make_model(model, MODEL)
    base = Path(args.base) if args.base else work / "base.json"
    if not args.base and not base.exists():
        start = time.time()
        harness("calibrate", "--model", str(model), "--seq-len", str(SEQ_LEN), "--micro-batch", "4", "--ranks", "2",
                "--precision", "fp32", "--out", str(base))
        print(f"node profile: {base} [{time.time() - start:.0f} s]", flush=True)
    print("uptime before:", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    results, picks = {}, {}
    with twohosts.TwoHosts() as hosts:
        for wire in args.wires.split(","):
            if wire == "slow":
                hosts.slow(args.rate)
            profile = work / f"{wire}.json"
            twohosts.calibrate_link(hosts, base, profile)
            link = json.loads(profile.read_text())["measured"]["inter_node"]["bus_gbps"]
            print(f"{wire} wire: all_reduce {link['all_reduce']['2'] * 1e3:.2f} MB/s, send {link['send']['2'] * 1e3:.2f}"
                  f" MB/s (bus bandwidth across the wire)", flush=True)
            picks[wire] = recommend(model, profile)
            for recipe in BATCH:
                start = time.time()
                r = run_recipe(hosts, recipe, model, work, args.steps, profile)
                results[(wire, recipe)] = r
                print(f"{wire} wire: {summary_line(r)} [{time.time() - start:.0f} s]", flush=True)
            hosts.unslow()
    print("uptime after: ", subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip())
    ok = True
    for wire, pick in picks.items():
        print(f"{wire} wire: harness plan recommends {json.dumps(pick)[:300]}")
    for (wire, recipe), r in results.items():
        within = r["predicted_s"] and abs(r["measured_s"] / r["predicted_s"] - 1) <= TOLERANCE
        print(f"{wire:<5} {summary_line(r)}  {'ok' if within else 'OUTSIDE +-25 %'}")
        ok = ok and (within or wire != "slow")
    if "slow" in picks:
        ok = ok and picks["slow"]["recommended"].startswith("pipeline")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
