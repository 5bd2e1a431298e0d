"""What Ray costs a run: its start-up, the first step's delay under `harness ray` against `harness launch` started on
each host directly, and the memory Ray itself holds per node.

Two hosts (tests/helpers/twohosts.py: two network namespaces joined by a veth pair, root only), Ray started in them as
tests/test_ray.py starts it (tests/helpers/ray_cluster.py: addresses given, usage statistics off, object store
capped at 100 MB, one CPU per node). The same run (ZeRO-3, tiny-llama, one CPU rank per host, --steps steps) goes
--repeat times each way, alternating:
  - `harness launch --no_ssh --node_rank i` on each host at once (docker/launch_multinode.sh, what the plain
    launcher does);
  - `harness ray --nodes 2 --gpus-per-node 1 --cpu` from the head's host (placement group, agents, one launch each).
Per run: the seconds from the start of the command(s) to the first step's record in metrics.jsonl (wall clock), and
to the end. Memory: each node's Ray processes (every process in the namespace that is not the launch, its
DeepSpeed launcher or a rank: raylet, GCS, workers, the agent), as the sum of their proportional set sizes (PSS:
shared pages split between the processes that map them), idle after start-up and at its largest during a run.

    sudo python bench/ray_start.py [--steps 4] [--repeat 2] [--work DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import psutil  # noqa: E402

from helpers import ray_cluster, twohosts  # noqa: E402
from helpers.twohosts import start_nodes, tails, wait_nodes  # noqa: E402

RUN = ["--recipe", "zero3", "--set", "precision=fp32", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
       "--set", "scheduler.type=none", "--set", "train.log_every=1", "--profile-steps", "",
       "--set", "train.model=tiny-llama", "--set", "batch.micro_batch_per_gpu=2", "--set", "batch.grad_accum_steps=1"]
TRAINING = ("harness", "deepspeed")  # in a process's command line: the launch, its launcher, a rank


def ray_pss_bytes(c: ray_cluster.RayCluster, host: int) -> int:
    total = 0
    for pid in c.pids(host):
        try:
            proc = psutil.Process(pid)
            if any(word in " ".join(proc.cmdline()) for word in TRAINING):
                continue
            total += proc.memory_full_info().pss
        except psutil.Error:
            pass
    return total


class PeakMemory(threading.Thread):
    """Samples both nodes' Ray memory every 0.5 s while a run goes."""

    def __init__(self, c: ray_cluster.RayCluster):
        super().__init__(daemon=True)
        self.c, self.peak, self.done = c, [0, 0], threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            for host in (0, 1):
                self.peak[host] = max(self.peak[host], ray_pss_bytes(self.c, host))
            self.done.wait(0.5)


def first_step_s(run: Path, began_wall: float) -> float:
    for line in (run / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["kind"] == "train":
            return record["time"] - began_wall
    raise RuntimeError(f"no train record in {run}")


def plain_run(hosts, work: Path, steps: int, tag: str) -> dict:
    run = work / tag
    began_wall, began = time.time(), time.monotonic()
    procs, logs = start_nodes(hosts, work, [*RUN, "--set", f"train.steps={steps}", "--output-dir", str(run)], tag)
    codes = wait_nodes(procs, timeout_s=600)
    if codes != [0, 0]:
        raise RuntimeError(f"harness launch on both hosts exited {codes}{tails(logs)}")
    return {"first_step_s": first_step_s(run, began_wall), "total_s": time.monotonic() - began}


def ray_run(c: ray_cluster.RayCluster, work: Path, steps: int, tag: str) -> dict:
    run, log = work / tag, work / f"{tag}.log"
    argv = [str(twohosts.HARNESS), "ray", "--address", c.address, "--nodes", "2", "--gpus-per-node", "1", "--cpu",
            "harness/run.py", *RUN, "--set", f"train.steps={steps}", "--output-dir", str(run)]
    peak = PeakMemory(c)
    began_wall, began = time.time(), time.monotonic()
    peak.start()
    with open(log, "w") as out:
        code = c.popen(0, argv, stdout=out, stderr=subprocess.STDOUT).wait(timeout=600)
    peak.done.set()
    peak.join()
    if code != 0:
        raise RuntimeError(f"harness ray exited {code}:\n{log.read_text()[-4000:]}")
    return {"first_step_s": first_step_s(run, began_wall), "total_s": time.monotonic() - began, "peak": peak.peak}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--work", type=Path, default=None, help="scratch folder (default: a temporary one, removed)")
    args = parser.parse_args()
    problem = twohosts.unavailable() or ray_cluster.ray_problem()
    if problem:
        print(f"cannot run: {problem}")
        return 2
    work = args.work or Path(tempfile.mkdtemp(prefix="dsh-ray-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        with twohosts.TwoHosts() as hosts:
            c = ray_cluster.RayCluster(hosts, work)
            try:
                head, worker = c.start_head(), c.start_worker()
                time.sleep(5)  # let the workers Ray prestarts settle
                idle = [ray_pss_bytes(c, host) for host in (0, 1)]
                runs = {"launch": [], "ray": []}
                for i in range(args.repeat):
                    runs["launch"].append(plain_run(hosts, work, args.steps, f"launch{i}"))
                    runs["ray"].append(ray_run(c, work, args.steps, f"ray{i}"))
            finally:
                c.stop()
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    mb = 1e6
    print(f"Ray start-up: head {head:.1f} s, worker joined {worker:.1f} s (`ray start`, each in its namespace)")
    print(f"Ray's memory (PSS), idle: head node {idle[0] / mb:.0f} MB, worker node {idle[1] / mb:.0f} MB; during a "
          f"run, largest: head {max(r['peak'][0] for r in runs['ray']) / mb:.0f} MB, worker "
          f"{max(r['peak'][1] for r in runs['ray']) / mb:.0f} MB")
    for way, rs in runs.items():
        first = [r["first_step_s"] for r in rs]
        total = [r["total_s"] for r in rs]
        print(f"{way:>6}: first step {statistics.median(first):.1f} s after the start (runs: "
              f"{', '.join(f'{x:.1f}' for x in first)}), done in {statistics.median(total):.1f} s "
              f"({', '.join(f'{x:.1f}' for x in total)}), {args.steps} steps")
    delay = statistics.median(r["first_step_s"] for r in runs["ray"]) - \
        statistics.median(r["first_step_s"] for r in runs["launch"])
    print(f"harness ray's first step comes {delay:+.1f} s after harness launch's (median of {args.repeat})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
