"""The commands that start a planned layout: `harness launch` on one node (or DeepSpeed's runner across nodes), and
the same run under a scheduler: `harness slurm`, `harness ray` and `harness k8s` (docs/cluster.md). Pure."""

from __future__ import annotations

import shlex

from harness.planner.inputs import Cluster


def launch_command(recipe: str, model_name: str, cluster: Cluster, sets: dict) -> str:
    head = f"harness launch --num_gpus {cluster.gpus_per_node}"  # `deepspeed` that is safe to signal (README)
    if cluster.nodes > 1:  # DeepSpeed's pdsh launcher: the other nodes' ranks cannot report to `harness launch`
        head = f"deepspeed --hostfile hostfile --num_nodes {cluster.nodes} --num_gpus {cluster.gpus_per_node}"
    return f"{head} harness/run.py {_run_args(recipe, model_name, sets)}"


def _run_args(recipe: str, model_name: str, sets: dict) -> str:
    args = " ".join(f"--set {k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in sets.items())
    return f"--recipe {recipe} --model {shlex.quote(model_name)} {args}"


def cluster_commands(recipe: str, model_name: str, cluster: Cluster, sets: dict) -> dict[str, str]:
    """The same run under a scheduler: `harness slurm` (a batch script), `harness ray` (on a Ray cluster whose head
    is HEAD) and `harness k8s` (Kubeflow Trainer manifests; IMAGE and CLAIM are the user's); RUN_DIR stands for a run
    folder every node shares (docs/cluster.md)."""
    nodes = f"--nodes {cluster.nodes} --gpus-per-node {cluster.gpus_per_node}"
    run = _run_args(recipe, model_name, sets)
    return {"slurm": f"harness slurm {nodes} --output-dir RUN_DIR {run}",
            "ray": f"harness ray --address HEAD:6379 {nodes} harness/run.py {run} --output-dir RUN_DIR",
            "k8s": f"harness k8s {nodes} --image IMAGE --pvc CLAIM {run}"}
