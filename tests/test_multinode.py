"""Two DeepSpeed "nodes" on one machine, started the way docker/launch_multinode.sh starts real ones.

Each node is its own launcher (`deepspeed --hostfile HF --no_ssh --node_rank N --master_addr ...`) with one
local rank; together they make one world of 2 that trains into one run folder, as two GPU nodes sharing
storage would. The hostfile names (nodeA, nodeB) are not resolvable hosts: with --no_ssh DeepSpeed only
uses them as labels, so they just need to be distinct (DeepSpeed refuses a name listed twice).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import pytest

from helpers.launch import DEEPSPEED, ROOT, env, free_port, records

pytestmark = pytest.mark.multirank

SCRIPT = ROOT / "docker" / "launch_multinode.sh"
TIMEOUT_S = 600


def start_node(node_rank: int, hostfile, port: int, log_path, args: list[str]) -> subprocess.Popen:
    # the script's default launcher, `harness launch` (the venv's): each node's wrapper around its own runner
    node_env = dict(env(), NODE_RANK=str(node_rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                    HOSTFILE=str(hostfile), DEEPSPEED=f"{DEEPSPEED.parent / 'harness'} launch")
    # Output to files, not pipes: a node blocked on a full pipe would stall the other in a collective.
    with open(log_path, "w") as log:
        return subprocess.Popen([str(SCRIPT), *args], cwd=ROOT, env=node_env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def wait_all(procs: list[subprocess.Popen], timeout_s: int) -> list[int]:
    """Exit codes; once one node fails, the other would wait for it until the rendezvous times out: stop it."""
    deadline = time.monotonic() + timeout_s
    while any(p.poll() is None for p in procs):
        failed = any(p.poll() not in (None, 0) for p in procs)
        if failed or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGTERM)
                    p.wait(timeout=30)
            break
        time.sleep(0.5)
    return [p.returncode for p in procs]


def test_two_nodes_without_ssh_train_one_run(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("nodeA slots=1\nnodeB slots=1\n")
    run = tmp_path / "run"
    args = ["--recipe", "zero2", "--set", "train.steps=4", "--set", "train.seq_len=64", "--set", "train.eval_every=0",
            "--profile-steps", "", "--output-dir", str(run)]
    port = free_port()
    logs = [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    procs = [start_node(rank, hostfile, port, logs[rank], args) for rank in (0, 1)]
    codes = wait_all(procs, TIMEOUT_S)  # the ranks unlink DeepSpeed's /dev/shm buffers themselves (harness.dist)
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], f"exit codes {codes}\n--- node 0\n{outputs[0][-5000:]}\n--- node 1\n{outputs[1][-5000:]}"
    for rank, out in enumerate(outputs):  # each launcher started its own node's single rank
        assert f"nnodes=2, num_local_procs=1, node_rank={rank}" in out, out[-3000:]
    assert [r["step"] for r in records(run, "train")] == [1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    manifests = list((run / "checkpoints").glob("global_step4/manifest.json"))
    assert manifests and json.loads(manifests[0].read_text())["world_size"] == 2
