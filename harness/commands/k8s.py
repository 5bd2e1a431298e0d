"""`harness k8s [FILE] --recipe NAME --nodes N --gpus-per-node G --image IMAGE --pvc CLAIM`: Kubeflow Trainer v2
manifests for a run (a TrainingRuntime and the TrainJob that uses it), written to FILE for `kubectl apply -f`.

What the manifests say, and why:
- the torch runtime (`mlPolicy.torch`) gives every node's pod PET_NNODES, PET_NODE_RANK, PET_MASTER_ADDR and
  PET_MASTER_PORT (node 0's headless-service name); the container runs `harness launch --no_ssh --node_rank
  $PET_NODE_RANK` with a hostfile of labels, as `harness slurm` does: no ssh, no torchrun;
- `harness/run.py ... --resume auto`: a restarted pod reruns the same command and continues from `latest` when the
  run folder (on the claim every node mounts) has one;
- `terminationGracePeriodSeconds` covers what a SIGTERM starts: the ranks finish the step they are in, agree on a
  step, save and exit 75 (checkpoints.md). It is predicted from the recipe: two steps (the one in flight and the
  agreed one) on the hardware profile plus one checkpoint written at --storage-gbps, plus a margin;
- failure policy: the Job's podFailurePolicy fails the Job on exit 75 (rule 0) and on 2/3 (rule 1); JobSet restarts
  the whole set without spending `--max-restarts` when the Job failed by rule 0 (preempted: resume me), fails it for
  rule 1 (bad input, a numeric fault: a rerun would fail the same way), and any other failure (a lost node, a crash)
  restarts it within the retry budget.
No API server runs here: the tests check the manifests against the published Kubeflow Trainer models
(kubeflow-trainer-api, which carry the Kubernetes batch/core and JobSet models too).
"""

from __future__ import annotations

import argparse
import math
import shlex
from pathlib import Path

from harness.commands import job_args
from harness.commands.launch import EXIT_BAD_INPUT
from harness.errors import UsageError
from harness.train.preempt import EXIT_NUMERIC_FAULT, EXIT_PREEMPTED

API = "trainer.kubeflow.org/v1alpha1"
CONTAINER = "node"  # the torch runtime's trainer container: the one that gets the PET_* variables
GRACE_MARGIN_S = 30  # process teardown, the launcher's wait, a slow first write
DEFAULT_HARDWARE = "h100-80gb-sxm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", nargs="?", help="where to write the manifests (default: ./k8s/<name>.yaml)")
    job_args.add_run_arguments(parser, "the run folder inside the pods, on the claim every node mounts "
                                       "(default: /runs/<name>)")
    parser.add_argument("--image", required=True, help="the container image (docker/Dockerfile, TARGET=cuda)")
    parser.add_argument("--pvc", required=True, metavar="CLAIM",
                        help="a ReadWriteMany PersistentVolumeClaim mounted at /runs on every node: checkpoints "
                             "must outlive a pod")
    parser.add_argument("--name", help="the TrainJob's name (default dsharness-RECIPE)")
    parser.add_argument("--namespace", default="default", help="namespace of both objects (default: default)")
    parser.add_argument("--max-restarts", type=int, default=3, metavar="K",
                        help="restarts after a lost node or a crash (preemption, exit 75, does not count; "
                             "default 3)")
    parser.add_argument("--grace-period", type=int, metavar="S",
                        help="terminationGracePeriodSeconds (default: predicted from the recipe, see --hardware)")
    parser.add_argument("--hardware", default=DEFAULT_HARDWARE,
                        help=f"profile the step time is predicted on (default {DEFAULT_HARDWARE})")
    parser.add_argument("--storage-gbps", type=float, default=1.0, metavar="GB_PER_S",
                        help="write bandwidth of the claim's storage, GB/s (default 1.0)")


def grace(spec, args) -> dict:
    """{"grace_s", "step_s", "save_s", "checkpoint_bytes"}: what a SIGTERM must leave time for (module doc)."""
    from harness.config.run_model import RunModel, optimizer_states
    from harness.planner import hardware, layouts, memory
    from harness.planner.params import count_params
    from harness.planner.prediction import evaluate

    if args.storage_gbps <= 0:
        raise UsageError(f"harness k8s --storage-gbps {args.storage_gbps}: must be > 0\n"
                         "    fix: the claim's sustained write bandwidth, e.g. --storage-gbps 1")
    profile = hardware.load(args.hardware)
    cluster = layouts.hardware(args.gpus_per_node, args.nodes, profile["gpu_mem_bytes"], None, None)
    run = RunModel.from_resolved(spec.recipe, spec.ds_config, spec.world_size, spec.model_config)
    try:
        step_s = evaluate(run, cluster, profile).time["step_time_s"]
    except Exception as e:  # an architecture the planner cannot price: the user must say
        raise UsageError(f"harness k8s: the step time of {run.model} cannot be predicted ({e}), so the grace "
                         "period cannot be\n    fix: --grace-period S, at least two steps and one checkpoint "
                         "save") from None
    nbytes = memory.checkpoint_bytes(count_params(dict(spec.model_config)).total, run.precision,
                                     optimizer_states=optimizer_states(spec.ds_config))
    save_s = nbytes / (args.storage_gbps * 1e9)
    return {"grace_s": math.ceil(2 * step_s + save_s) + GRACE_MARGIN_S, "step_s": step_s, "save_s": save_s,
            "checkpoint_bytes": nbytes}


def container_script(args, run_dir: Path) -> str:
    """The node container's command: a hostfile of labels, then one `harness launch` for this node."""
    run = " ".join(shlex.quote(a) for a in job_args.run_arguments(args, run_dir))
    hostfile = "/tmp/dsharness-hostfile"  # the pod's own: with --no_ssh the names are labels
    return "\n".join([
        "set -euo pipefail",
        f"for i in $(seq 0 $((PET_NNODES - 1))); do echo \"node$i slots={args.gpus_per_node}\"; done > {hostfile}",
        f"exec harness launch --hostfile {hostfile} --no_ssh --node_rank \"$PET_NODE_RANK\" "
        f"--master_addr \"$PET_MASTER_ADDR\" --master_port \"$PET_MASTER_PORT\" harness/run.py {run} --resume auto",
    ])


def pod_failure_policy() -> dict:
    """Rule 0: preempted (75); rule 1: bad input or a numeric fault. Both fail the Job at once (no pod retry: a
    multi-node run restarts as a whole); the JobSet rules below tell them apart by the rule's index."""
    def fail_on(*codes: int) -> dict:
        return {"action": "FailJob",
                "onExitCodes": {"containerName": CONTAINER, "operator": "In", "values": list(codes)}}
    return {"rules": [fail_on(EXIT_PREEMPTED), fail_on(EXIT_BAD_INPUT, EXIT_NUMERIC_FAULT)]}


def jobset_failure_policy(max_restarts: int) -> dict:
    """The Job controller's message for a podFailurePolicy FailJob names the rule: "Container node for pod NS/POD
    failed with exit code 75 matching FailJob rule at index 0"."""
    return {"maxRestarts": max_restarts, "rules": [
        {"name": "preempted", "action": "RestartJobSetAndIgnoreMaxRestarts",
         "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": [f"exit code {EXIT_PREEMPTED} matching FailJob rule at index 0"]},
        {"name": "badInputOrNumericFault", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
         "onJobFailureMessagePatterns": ["matching FailJob rule at index 1"]},
    ]}


def runtime(args, name: str, run_dir: Path, grace_s: int) -> dict:
    per_node = args.gpus_per_node
    limits = {} if args.cpu else {"nvidia.com/gpu": per_node}
    container = {"name": CONTAINER, "image": args.image, "command": ["bash", "-c", container_script(args, run_dir)],
                 "volumeMounts": [{"name": "runs", "mountPath": "/runs"}, {"name": "shm", "mountPath": "/dev/shm"}]}
    if limits:
        container["resources"] = {"limits": limits}
    pod = {"restartPolicy": "Never",  # a podFailurePolicy needs it; the JobSet restarts the whole set
           "terminationGracePeriodSeconds": grace_s, "containers": [container],
           "volumes": [{"name": "runs", "persistentVolumeClaim": {"claimName": args.pvc}},
                       {"name": "shm", "emptyDir": {"medium": "Memory"}}]}  # NCCL and the shm comm op
    job = {"backoffLimit": 0, "podFailurePolicy": pod_failure_policy(), "template": {"spec": pod}}
    node = {"name": "node", "template": {"metadata": {"labels": {"trainer.kubeflow.org/trainjob-ancestor-step":
                                                                 "trainer"}}, "spec": job}}
    return {"apiVersion": API, "kind": "TrainingRuntime",
            "metadata": {"name": name, "namespace": args.namespace,
                         "labels": {"trainer.kubeflow.org/framework": "torch"}},
            "spec": {"mlPolicy": {"numNodes": args.nodes, "torch": {}},
                     "template": {"spec": {"failurePolicy": jobset_failure_policy(args.max_restarts),
                                           "replicatedJobs": [node]}}}}


def train_job(args, name: str) -> dict:
    return {"apiVersion": API, "kind": "TrainJob", "metadata": {"name": name, "namespace": args.namespace},
            "spec": {"runtimeRef": {"name": name, "apiGroup": "trainer.kubeflow.org", "kind": "TrainingRuntime"},
                     "trainer": {"numNodes": args.nodes, "numProcPerNode": args.gpus_per_node}}}


def manifests(args) -> tuple[list[dict], dict]:
    """([TrainingRuntime, TrainJob], the grace period's terms); exit 2 when the recipe does not fit the world."""
    if args.max_restarts < 0:
        raise UsageError(f"harness k8s --max-restarts {args.max_restarts}: must be >= 0")
    name = args.name or f"dsharness-{args.recipe}".replace("_", "-")
    run_dir = Path(args.output_dir or f"/runs/{name}")
    if not run_dir.is_absolute():
        raise UsageError(f"harness k8s --output-dir {run_dir}: the pods need an absolute path on the claim\n"
                         f"    fix: --output-dir /runs/{name}")
    spec, _ = job_args.resolve(args, run_dir, check_folder=False)
    terms = grace(spec, args)
    if args.grace_period is not None:
        if args.grace_period < 1:
            raise UsageError(f"harness k8s --grace-period {args.grace_period}: must be >= 1 s")
        terms = dict(terms, grace_s=args.grace_period, given=True)
    return [runtime(args, name, run_dir, terms["grace_s"]), train_job(args, name)], terms


def _dumper():
    import yaml

    class Dumper(yaml.SafeDumper):
        """The container's script as a literal block (`|`), as a person would write it."""

    def text(dumper, value: str):
        return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)

    Dumper.add_representer(str, text)
    return Dumper


def run(args: argparse.Namespace) -> int:
    import yaml

    docs, terms = manifests(args)
    name = docs[1]["metadata"]["name"]
    out = Path(args.file or Path("k8s") / f"{name}.yaml")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.dump_all(docs, Dumper=_dumper(), sort_keys=False, width=120))
    why = (f"predicted: 2 steps x {terms['step_s']:.3g} s on {args.hardware} + one checkpoint "
           f"({terms['checkpoint_bytes'] / 1e9:.3g} GB at {args.storage_gbps:g} GB/s, {terms['save_s']:.3g} s) + "
           f"{GRACE_MARGIN_S} s")
    if terms.get("given") and terms["grace_s"] < 2 * terms["step_s"] + terms["save_s"]:
        print(f"warning: --grace-period {terms['grace_s']} s is shorter than {why}: a SIGKILL can cut the save "
              "(`latest` then stays at the checkpoint before)")
    print(f"wrote {out}: TrainingRuntime + TrainJob {name}, recipe {args.recipe} on {args.nodes} node(s) x "
          f"{args.gpus_per_node} {'CPU ranks' if args.cpu else 'GPUs'}; grace {terms['grace_s']} s "
          f"({'given' if terms.get('given') else why}); exit 75 restarts without spending --max-restarts "
          f"{args.max_restarts}, exit 2/3 fail the job")
    print(f"apply with: kubectl apply -f {shlex.quote(str(out))}")
    return 0
