"""`harness k8s`: the Kubeflow Trainer manifests it writes, checked against the published Kubeflow Trainer models
(kubeflow-trainer-api: TrainingRuntime, TrainJob, and the JobSet and Kubernetes batch/core models inside them; no
API server can run here), the failure policy evaluated as the Job and JobSet controllers evaluate it, the grace
period against the recipe's predicted step and save, the refusals, and the node container's own command run for
real: two CPU ranks, then the same command again, as a restarted pod would (`--resume auto`)."""

from __future__ import annotations

import math
import re
import subprocess

import pytest
import yaml

from harness.cli import main
from harness.commands import k8s
from harness.commands.launch import EXIT_BAD_INPUT
from harness.dist import free_port
from harness.train.preempt import EXIT_NUMERIC_FAULT, EXIT_PREEMPTED, EXIT_TEACHER_UNAVAILABLE
from helpers.launch import ROOT, env, losses

trainer_api = pytest.importorskip("kubeflow_trainer_api", reason="kubeflow-trainer-api is not installed (the test "
                                                                 "extra installs it: pip install -e '.[test]')")


def write(tmp_path, *extra: str, name: str = "job.yaml") -> tuple[int, list[dict]]:
    out = tmp_path / name
    code = main(["k8s", str(out), "--recipe", "zero3", "--image", "registry.example/dsharness:cuda", "--pvc", "runs",
                 *extra])
    return code, (list(yaml.safe_load_all(out.read_text())) if code == 0 else [])


def node_job(runtime: dict) -> dict:
    (node,) = runtime["spec"]["template"]["spec"]["replicatedJobs"]
    return node["template"]["spec"]


def test_manifests_are_valid_kubeflow_trainer_objects(tmp_path):
    from kubeflow_trainer_api.models import TrainerV1alpha1TrainingRuntime, TrainerV1alpha1TrainJob

    code, (runtime, job) = write(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--namespace", "team")
    assert code == 0
    for doc, model in ((runtime, TrainerV1alpha1TrainingRuntime), (job, TrainerV1alpha1TrainJob)):
        parsed = model.from_dict(doc)  # pydantic: types, required fields, enums as the CRDs' OpenAPI models say
        assert parsed.to_dict() == doc, f"{doc['kind']}: a field the published model does not have was dropped"
    assert runtime["metadata"]["labels"]["trainer.kubeflow.org/framework"] == "torch"
    assert runtime["spec"]["mlPolicy"] == {"numNodes": 2, "torch": {}}
    assert job["spec"]["trainer"] == {"numNodes": 2, "numProcPerNode": 8}
    assert job["spec"]["runtimeRef"] == {"name": runtime["metadata"]["name"], "apiGroup": "trainer.kubeflow.org",
                                         "kind": "TrainingRuntime"}
    pod = node_job(runtime)["template"]["spec"]
    (container,) = pod["containers"]
    assert container["name"] == "node" and container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
    assert pod["volumes"][0] == {"name": "runs", "persistentVolumeClaim": {"claimName": "runs"}}
    assert {"name": "runs", "mountPath": "/runs"} in container["volumeMounts"]
    script = container["command"][2]
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    for part in ('--no_ssh --node_rank "$PET_NODE_RANK"', '--master_addr "$PET_MASTER_ADDR"',
                 "harness/run.py --recipe zero3 --output-dir /runs/dsharness-zero3 --resume auto"):
        assert part in script, part


def controller_action(runtime: dict, exit_code: int) -> str:
    """What happens to the JobSet when the node container exits with `exit_code`: the Job controller's
    podFailurePolicy (first matching rule; its FailJob message names the rule's index), then the JobSet
    controller's failurePolicy (first rule whose reason and message pattern match; none: RestartJobSet)."""
    job = node_job(runtime)
    assert job["backoffLimit"] == 0 and job["template"]["spec"]["restartPolicy"] == "Never"
    reason, message = "BackoffLimitExceeded", "Job has reached the specified backoff limit"
    for index, rule in enumerate(job["podFailurePolicy"]["rules"]):
        codes = rule["onExitCodes"]
        if codes["containerName"] == "node" and (exit_code in codes["values"]) == (codes["operator"] == "In"):
            assert rule["action"] == "FailJob"
            reason = "PodFailurePolicy"
            message = (f"Container node for pod default/dsharness-node-0-0-abcde failed with exit code {exit_code} "
                       f"matching FailJob rule at index {index}")
            break
    for rule in runtime["spec"]["template"]["spec"]["failurePolicy"]["rules"]:
        if reason in rule.get("onJobFailureReasons", [reason]) and any(
                re.search(p, message) for p in rule.get("onJobFailureMessagePatterns") or [".*"]):
            return rule["action"]
    return "RestartJobSet"


def test_preemption_restarts_free_bad_input_and_faults_fail_crashes_spend_retries(tmp_path):
    code, (runtime, _) = write(tmp_path, "--nodes", "2", "--gpus-per-node", "8", "--max-restarts", "5")
    assert code == 0
    assert runtime["spec"]["template"]["spec"]["failurePolicy"]["maxRestarts"] == 5
    assert controller_action(runtime, EXIT_PREEMPTED) == "RestartJobSetAndIgnoreMaxRestarts"
    assert controller_action(runtime, EXIT_BAD_INPUT) == "FailJobSet"
    assert controller_action(runtime, EXIT_NUMERIC_FAULT) == "FailJobSet"
    for crash in (1, 137, 143, EXIT_TEACHER_UNAVAILABLE):  # an exception, SIGKILL (a lost node, OOM), SIGTERM
        # unhandled, a served teacher's outage (69)
        assert controller_action(runtime, crash) == "RestartJobSet"


def test_grace_period_covers_two_predicted_steps_and_one_save(tmp_path, capsys):
    from harness.planner import memory
    from harness.planner.params import count_params
    from harness.model_shapes import load_model_config

    code, (small, _) = write(tmp_path, "--gpus-per-node", "8", name="small.yaml")
    assert code == 0
    code, (big, _) = write(tmp_path, "--model", "llama-2-7b", "--nodes", "2", "--gpus-per-node", "8",
                           "--storage-gbps", "0.5", name="big.yaml")
    out = capsys.readouterr().out
    assert code == 0
    grace = {n: node_job(r)["template"]["spec"]["terminationGracePeriodSeconds"] for n, r in (("s", small),
                                                                                              ("b", big))}
    # llama-2-7b's checkpoint: bf16 weights + fp32 master + Adam's two moments = 14 B/param, written at 0.5 GB/s
    ckpt = memory.checkpoint_bytes(count_params(load_model_config("llama-2-7b")).total, "bf16")
    step_s = float(re.search(r"2 steps x ([\d.]+) s", out.splitlines()[-2]).group(1))
    assert grace["b"] >= math.ceil(2 * step_s + ckpt / 0.5e9) + k8s.GRACE_MARGIN_S - 1
    assert ckpt / 0.5e9 > 150 and grace["b"] > grace["s"] + 150
    assert grace["s"] < 60  # the tiny built-in model: the margin alone, nearly
    code, (given, _) = write(tmp_path, "--grace-period", "20", "--model", "llama-2-7b", "--nodes", "2",
                             "--gpus-per-node", "8", name="given.yaml")
    assert code == 0 and node_job(given)["template"]["spec"]["terminationGracePeriodSeconds"] == 20
    assert "warning: --grace-period 20 s is shorter than predicted" in capsys.readouterr().out


@pytest.mark.parametrize("extra, message", [
    (("--set", "parallel.pipeline=3", "--gpus-per-node", "2"), "3 pipeline stages"),
    (("--gpus-per-node", "2", "--output-dir", "runs/x"), "the pods need an absolute path"),
    (("--gpus-per-node", "2", "--storage-gbps", "0"), "must be > 0"),
    (("--gpus-per-node", "2", "--max-restarts", "-1"), "must be >= 0"),
])
def test_refusals_before_anything_is_written(tmp_path, capsys, extra, message):
    code, _ = write(tmp_path, *extra)
    assert code == 2 and message in capsys.readouterr().err
    assert not (tmp_path / "job.yaml").exists()


@pytest.mark.multirank
def test_the_node_command_trains_and_a_restarted_pod_continues(tmp_path):
    run_dir = tmp_path / "run"
    code, (runtime, _) = write(tmp_path, "--cpu", "--gpus-per-node", "2", "--output-dir", str(run_dir),
                               "--set", "train.steps=4", "--set", "train.save_every=2", "--set", "train.eval_every=0")
    assert code == 0
    (container,) = node_job(runtime)["template"]["spec"]["containers"]
    assert "resources" not in container  # CPU ranks ask for no GPU
    pod_env = dict(env(), PET_NNODES="1", PET_NODE_RANK="0", PET_MASTER_ADDR="127.0.0.1",
                   PET_MASTER_PORT=str(free_port()))

    def pod() -> subprocess.CompletedProcess:
        return subprocess.run(container["command"], cwd=ROOT, env=pod_env, capture_output=True, text=True,
                              timeout=600)

    first = pod()
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    again = pod()  # the pod restarted after the run ended: --resume auto finds the last step and trains nothing
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sorted(losses(run_dir)) == [1, 2, 3, 4]
    assert "step 4" in again.stdout + again.stderr


def test_skypilot_template_recovers_preemption_and_runs_one_launch_per_node():
    """docker/skypilot/dsharness.yaml: documented, not run (it needs a cloud); its recovery and command checked."""
    task = yaml.safe_load((ROOT / "docker" / "skypilot" / "dsharness.yaml").read_text())
    assert task["num_nodes"] >= 2
    recovery = task["resources"]["job_recovery"]
    assert recovery["recover_on_exit_codes"] == [EXIT_PREEMPTED]
    assert recovery["max_restarts_on_errors"] >= 1
    script = task["run"]
    assert subprocess.run(["bash", "-n", "-c", script]).returncode == 0
    for part in ('--no_ssh --node_rank "$SKYPILOT_NODE_RANK"', "$SKYPILOT_NODE_IPS", "--resume auto",
                 '--output-dir "/runs/$RUN_NAME"'):
        assert part in script, part
    assert "/runs" in task["file_mounts"]
