"""Experiment trackers (monitor.wandb, monitor.mlflow) with the real libraries, offline: W&B in offline mode and an
MLflow file store in the run folder, read back with the libraries' own pieces (tests/helpers/tracker_files.py). Real ranks
train the tiny built-in model; nothing reaches the network (the only server addresses are closed ports on
127.0.0.1). Fake credentials sit in the environment of every launch here and must show up nowhere."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest

from harness.dist import free_port
from harness.errors import Problem
from harness import trackers
from harness.trackers import backends as tracker_backends
from helpers.launch import ROOT, launch, records
from helpers.tracker_files import mlflow_client, wandb_run

FAKE_WANDB_KEY = "fakeWandbKey" + "0123456789" * 4  # the form wandb accepts (40+ word characters)
FAKE_MLFLOW_TOKEN = "fakeMlflowToken-0123456789abcdef"
PROFILE = ROOT / "harness" / "planner" / "profiles" / "h100-80gb-sxm.json"  # a step-time prediction on CPU too
STEPS = 6


def closed_url() -> str:
    return f"http://127.0.0.1:{free_port()}"  # nothing listens there


def compiled_ops() -> str:
    """The torch extensions folder DeepSpeed's compiled ops sit in, whatever HOME says: under a fresh HOME the
    ranks would compile the shm all-reduce and the optimizer's op again (minutes on 2 cores)."""
    from torch.utils.cpp_extension import get_default_build_root

    return os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()


@pytest.fixture
def secrets_env(monkeypatch, tmp_path):
    """Fake credentials in the environment, no ~/.netrc or wandb settings of this machine's user."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", compiled_ops())
    monkeypatch.setenv("WANDB_API_KEY", FAKE_WANDB_KEY)
    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", FAKE_MLFLOW_TOKEN)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    for name in ("WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "WANDB_DIR"):
        monkeypatch.delenv(name, raising=False)


def expected_params(tree: dict, prefix: str = "") -> dict[str, str]:
    """How MLflow must hold a block: one dotted key per leaf, strings as written, other values as JSON ("$schema",
    a reference to the schema file, is no setting)."""
    out = {}
    for key, value in tree.items():
        if key == "$schema":
            continue
        if isinstance(value, dict) and value:
            out.update(expected_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def leaks(run_dir: Path, *texts: str) -> list[str]:
    """Files under run_dir (every one, binary too) holding any of `texts`."""
    needles = [t.encode() for t in texts]
    return [str(p) for p in run_dir.rglob("*") if p.is_file() and any(n in p.read_bytes() for n in needles)]


# ---------------------------------------------------------------- unit: what is logged, guarded calls, refusals

def test_records_become_the_same_names_for_both_trackers():
    record = {"loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens_per_s": 900.0, "samples_per_s": 7.0,
              "step_time_s": 0.5, "tflops_per_gpu": 0.01, "mfu": None, "fwd_ms": 3.0, "profiled": True,
              "memory": {"rss_bytes": 10}, "memory_per_rank": [{"rss_bytes": 10}, {"rss_bytes": 12}]}
    got = trackers.step_metrics("train", record, predicted_step_s=0.25)
    assert got == {"train/loss": 2.5, "train/lr": 1e-3, "train/grad_norm": 0.7, "train/tokens_per_s": 900.0,
                   "train/samples_per_s": 7.0, "train/step_time_s": 0.5, "train/tflops_per_gpu": 0.01,
                   "timers/fwd_ms": 3.0, "train/step_time_predicted_s": 0.25,
                   "memory/rank0/rss_bytes": 10.0, "memory/rank1/rss_bytes": 12.0}  # mfu null on CPU: left out
    assert trackers.step_metrics("train", {"loss": 1.0, "memory": {"rss_bytes": 5}}, None) == {
        "train/loss": 1.0, "memory/rank0/rss_bytes": 5.0}  # outside the window: rank 0's own memory
    assert trackers.step_metrics("eval", {"eval_loss": 3.0}, None) == {"eval/loss": 3.0}
    assert trackers.step_metrics("eval", {"eval_loss": math.nan}, None) == {}
    mixture = trackers.step_metrics("train", {"loss": 1.0, "loss/web": 2.5, "rows/web": 6, "loss/chat": None}, None)
    assert mixture == {"train/loss": 1.0, "train/loss/web": 2.5, "train/rows/web": 6.0}  # a source with no target: left out
    assert trackers.step_metrics("eval", {"eval_loss": 3.0, "eval_loss/web": 2.0}, None) == {"eval/loss": 3.0,
                                                                                           "eval/loss/web": 2.0}
    summary = {"first_loss": 3.0, "last_loss": 2.0, "eval_loss": None,
               "throughput": {"tokens_per_s_median": 100.0, "mfu": 0.4,
                              "step_time": {"step_time_s": 0.2, "measured_median_s_per_rank": [0.3, 0.31], "ratio": 1.5}},
               "memory": {"peak_per_rank": [{"peak_rss_bytes": 7}, {"peak_rss_bytes": 8}],
                          "predicted_peak_total_per_rank": [6, 6]}}
    assert trackers.summary_metrics(summary) == {
        "summary/first_loss": 3.0, "summary/last_loss": 2.0, "summary/tokens_per_s_median": 100.0, "summary/mfu": 0.4,
        "step_time/predicted_s": 0.2, "step_time/ratio": 1.5, "step_time/measured_median_s/rank0": 0.3,
        "step_time/measured_median_s/rank1": 0.31, "memory/peak/rank0/peak_rss_bytes": 7.0,
        "memory/peak/rank1/peak_rss_bytes": 8.0, "memory/predicted_peak_total_bytes/rank0": 6.0,
        "memory/predicted_peak_total_bytes/rank1": 6.0}


class Recording:
    """A started tracker as trackers.Trackers sees one (the interface of tracker_backends' runs)."""

    def __init__(self, name: str, fail_at: int | None = None):
        self.name, self.fail_at, self.logged, self.finished = name, fail_at, [], None

    def log(self, step, metrics):
        if step == self.fail_at:
            raise RuntimeError(f"server said no to {os.environ['MLFLOW_TRACKING_TOKEN']}")
        self.logged.append(step)

    def finish(self, exit_code):
        self.finished = exit_code


def test_a_tracker_that_raises_mid_run_is_dropped_with_one_warning(secrets_env, capsys):
    broken, fine = Recording("mlflow", fail_at=2), Recording("wandb")
    group = trackers.Trackers([broken, fine])
    group.wandb_started = False  # nothing of wandb's to tear down here
    for step in (1, 2, 3, 4):
        group.log(step, {"train/loss": 1.0})
    group.finish(0)
    assert broken.logged == [1] and broken.finished is None  # off after its failure, not finished
    assert fine.logged == [1, 2, 3, 4] and fine.finished == 0
    out = capsys.readouterr().out
    assert out.count("warning:") == 1 and "mlflow logging at step 2 failed (RuntimeError" in out
    assert "mlflow is off for the rest of this run, training goes on" in out
    assert FAKE_MLFLOW_TOKEN not in out and "<$MLFLOW_TRACKING_TOKEN>" in out


def test_what_stops_a_tracker_from_starting(secrets_env, monkeypatch, tmp_path):
    wandb_cfg = {"mode": "online"}
    url = closed_url()
    monkeypatch.setenv("WANDB_BASE_URL", url)
    path, message, fix = tracker_backends.WandbRun.problem(wandb_cfg, tmp_path)
    assert path == "monitor.wandb.mode" and f"the W&B server {url} does not answer" in message
    assert "--set monitor.wandb.mode=offline" in fix
    monkeypatch.delenv("WANDB_API_KEY")
    path, message, fix = tracker_backends.WandbRun.problem(wandb_cfg, tmp_path)
    assert path == "monitor.wandb.mode" and "no W&B login" in message and "wandb login" in fix
    assert tracker_backends.WandbRun.problem({"mode": "offline"}, tmp_path) is None  # offline needs no login
    path, message, fix = tracker_backends.MlflowRun.problem({"tracking_uri": url.replace("//", "//bob:pw@")},
                                                            tmp_path)
    assert path == "monitor.mlflow.tracking_uri" and "does not answer (ConnectionRefusedError" in message
    assert "bob" not in message and "pw@" not in message and "leave tracking_uri empty" in fix
    assert tracker_backends.MlflowRun.problem({"tracking_uri": ""}, tmp_path) is None  # the run folder's store
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as if not installed
    path, message, fix = tracker_backends.MlflowRun.problem({"tracking_uri": ""}, tmp_path)
    assert (path, message) == ("monitor.mlflow.enabled", "mlflow is on but its package is not installed")
    assert "pip install mlflow-skinny==" in fix and "--set monitor.mlflow.enabled=false" in fix


def test_recipe_keys_and_parameters(tmp_path):
    from harness.config.recipes import load_recipe

    recipe, _ = load_recipe("ddp", ["monitor.wandb.enabled=true", "monitor.mlflow.tracking_uri=https://u:pw@h:5000"])
    assert list(trackers.enabled(recipe)) == ["wandb"] and recipe["monitor"]["wandb"]["mode"] == "offline"
    spec = type("Spec", (), {"recipe": recipe, "ds_config": {"zero_optimization": {"stage": 0}}, "recipe_name": "ddp",
                             "world_size": 2, "dp": 2, "tp": 1, "pp": 1})()
    params = trackers.run_params(spec, tmp_path)
    assert params["recipe"]["monitor"]["mlflow"]["tracking_uri"] == "https://***@h:5000"  # no password logged
    assert params["run"] == {"recipe_name": "ddp", "world_size": 2, "dp": 2, "tp": 1, "pp": 1,
                             "run_dir": str(tmp_path.absolute())}
    flat = tracker_backends.flatten(params)
    assert flat["recipe.train.steps"] == "100" and flat["recipe.adapter.lr_B_ratio"] == "null"
    assert flat["recipe.train.model"] == "tiny-llama" and json.loads(flat["recipe.adapter.target_modules"])[0] == "q_proj"


# ---------------------------------------------------------------- real ranks

def train_args(run_dir: Path, *extra: str) -> list[str]:
    return ["--recipe", "zero2", "--output-dir", str(run_dir), "--set", f"train.steps={STEPS}",
            "--set", "train.log_every=2", "--set", "train.eval_every=3", "--profile-steps", "3-4", *extra]


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """One 2-rank run with both trackers on, fake credentials in its environment."""
    base = tmp_path_factory.mktemp("tracked")
    run_dir = base / "run"
    env = {"WANDB_API_KEY": FAKE_WANDB_KEY, "MLFLOW_TRACKING_TOKEN": FAKE_MLFLOW_TOKEN, "HARNESS_HARDWARE": str(PROFILE),
           "HOME": str(base / "home"), "WANDB_CONFIG_DIR": str(base / "home" / "wandb"),
           "TORCH_EXTENSIONS_DIR": compiled_ops()}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        for name in ("WANDB_MODE", "WANDB_BASE_URL", "MLFLOW_TRACKING_URI", "WANDB_DIR"):
            mp.delenv(name, raising=False)
        proc = launch(*train_args(run_dir, "--set", "monitor.wandb.enabled=true", "--set", "monitor.mlflow.enabled=true"))
    return run_dir, proc


@pytest.mark.multirank
def test_mlflow_holds_every_metric_and_the_resolved_config(tracked):
    run_dir, _ = tracked
    client, run = mlflow_client(run_dir)
    assert run.info.status == "FINISHED" and run.info.run_name == run_dir.name
    recipe = json.loads((run_dir / "recipe.json").read_text())
    ds_config = json.loads((run_dir / "ds_config.json").read_text())
    params = run.data.params
    assert {k: v for k, v in params.items() if k.startswith("recipe.")} == expected_params(recipe, "recipe.")
    assert {k: v for k, v in params.items() if k.startswith("ds_config.")} == expected_params(ds_config, "ds_config.")
    assert params["run.world_size"] == "2" and params["run.dp"] == "2"

    def history(key):
        return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}

    train = records(run_dir, "train")
    steps = list(range(1, STEPS + 1))
    assert history("train/loss") == {r["step"]: r["loss"] for r in train}  # one point per step, the same losses
    assert sorted(history("train/loss")) == steps
    for field in ("lr", "grad_norm", "tokens_per_s", "step_time_s", "tflops_per_gpu"):
        assert history(f"train/{field}") == {r["step"]: r[field] for r in train}, field
    assert history("eval/loss") == {r["step"]: r["eval_loss"] for r in records(run_dir, "eval")}
    assert sorted(history("eval/loss")) == [3, 6]
    summary = json.loads((run_dir / "summary.json").read_text())
    step_time = summary["throughput"]["step_time"]
    assert step_time["step_time_s"] > 0  # predicted on $HARNESS_HARDWARE
    assert set(history("train/step_time_predicted_s").values()) == {step_time["step_time_s"]}
    assert history("memory/rank0/peak_rss_bytes") == {r["step"]: r["memory"]["peak_rss_bytes"] for r in train}
    assert history("memory/rank1/peak_rss_bytes") == {r["step"]: r["memory_per_rank"][1]["peak_rss_bytes"]
                                                      for r in train if r.get("profiled")}
    assert sorted(history("memory/rank1/peak_rss_bytes")) == [3, 4]  # gathered in the profile window only
    end = run.data.metrics  # the last value of each: the summary's, logged at the last step
    assert end["step_time/predicted_s"] == step_time["step_time_s"]
    for rank in (0, 1):
        assert end[f"step_time/measured_median_s/rank{rank}"] == step_time["measured_median_s_per_rank"][rank]
        assert end[f"memory/peak/rank{rank}/peak_rss_bytes"] == summary["memory"]["peak_per_rank"][rank]["peak_rss_bytes"]
    assert end["summary/last_loss"] == summary["last_loss"] and "train/mfu" not in end  # CPU: no peak, no MFU


@pytest.mark.multirank
def test_wandb_offline_run_holds_every_metric_and_the_resolved_config(tracked):
    run_dir, proc = tracked
    got = wandb_run(run_dir)
    assert got["exit_code"] == 0 and f"[track]   wandb: {got['path'].parent}" in proc.stdout
    recipe = json.loads((run_dir / "recipe.json").read_text())
    assert got["config"]["recipe"] == {k: v for k, v in recipe.items() if k != "$schema"}
    assert got["config"]["ds_config"] == json.loads((run_dir / "ds_config.json").read_text())
    history = got["history"]
    train = records(run_dir, "train")
    assert sorted(history) == list(range(1, STEPS + 1))
    for r in train:
        row = history[r["step"]]
        assert row["train/loss"] == r["loss"] and row["train/lr"] == r["lr"] and row["train/grad_norm"] == r["grad_norm"]
        assert row["train/tokens_per_s"] == r["tokens_per_s"] and row["memory/rank0/rss_bytes"] == r["memory"]["rss_bytes"]
        assert ("memory/rank1/rss_bytes" in row) == bool(r.get("profiled"))
    assert {s: history[s]["eval/loss"] for s in (3, 6)} == {r["step"]: r["eval_loss"] for r in records(run_dir, "eval")}
    summary = json.loads((run_dir / "summary.json").read_text())
    assert got["summary"]["step_time/predicted_s"] == summary["throughput"]["step_time"]["step_time_s"]
    assert got["summary"]["memory/peak/rank1/peak_rss_bytes"] == summary["memory"]["peak_per_rank"][1]["peak_rss_bytes"]


@pytest.mark.multirank
def test_no_credential_reaches_the_run_folder_or_the_output(tracked):
    run_dir, proc = tracked
    assert sum(1 for p in run_dir.rglob("*") if p.is_file()) > 20  # checkpoints, metrics, both trackers' files
    assert leaks(run_dir, FAKE_WANDB_KEY, FAKE_MLFLOW_TOKEN) == []
    assert FAKE_WANDB_KEY not in proc.stdout + proc.stderr and FAKE_MLFLOW_TOKEN not in proc.stdout + proc.stderr


@pytest.mark.multirank
def test_a_tracker_that_cannot_start_stops_the_launch_before_training(secrets_env, monkeypatch, tmp_path):
    """W&B online and MLflow at servers that do not answer: exit 2 on every rank, both named, nothing trained,
    and the fake credentials in the environment appear in no message."""
    run_dir = tmp_path / "run"
    url = closed_url()
    monkeypatch.setenv("WANDB_BASE_URL", url)
    proc = launch(*train_args(run_dir, "--set", "monitor.wandb.enabled=true", "--set", "monitor.wandb.mode=online",
                              "--set", "monitor.mlflow.enabled=true", "--set", f"monitor.mlflow.tracking_uri={url}"),
                  check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "error: trackers: 2 problems" in out and "Traceback" not in out
    assert f"monitor.wandb.mode: online, but the W&B server {url} does not answer" in out
    assert f"monitor.mlflow.tracking_uri: the MLflow server {url} does not answer" in out
    assert "fix: check the network or WANDB_BASE_URL, or --set monitor.wandb.mode=offline" in out
    assert not (run_dir / "metrics.jsonl").exists()  # no rank trained
    assert FAKE_WANDB_KEY not in out and FAKE_MLFLOW_TOKEN not in out
    assert leaks(run_dir, FAKE_WANDB_KEY, FAKE_MLFLOW_TOKEN) == []


FAULT_DRIVER = '''
import shutil, sys
sys.path.insert(0, {root!r})
from harness.trackers import backends as tracker_backends

real_log = tracker_backends.MlflowRun.log

def log(self, step, metrics):  # the store vanishes at step 3: MLflow's own log_batch then raises
    if step == 3:
        shutil.rmtree({store!r}, ignore_errors=True)
    return real_log(self, step, metrics)

tracker_backends.MlflowRun.log = log
if __name__ == "__main__":  # the token store is prepared in a spawned child, which imports this file again
    from harness.run import main
    from harness.dist import exit_now
    exit_now(main())
'''


@pytest.mark.multirank
def test_best_effort_and_a_failure_mid_run_never_stop_training(secrets_env, monkeypatch, tmp_path):
    """W&B online without a login, best-effort: a warning, and the run trains without it. MLflow's store vanishes
    at step 3: one warning, MLflow is off, every step still trains."""
    monkeypatch.delenv("WANDB_API_KEY")
    run_dir = tmp_path / "run"
    driver = tmp_path / "fault_driver.py"
    driver.write_text(FAULT_DRIVER.format(root=str(ROOT), store=str(run_dir / "monitor" / "mlruns")))
    proc = launch(*train_args(run_dir, "--set", "monitor.wandb.enabled=true", "--set", "monitor.wandb.mode=online",
                              "--set", "monitor.wandb.best_effort=true", "--set", "monitor.mlflow.enabled=true"),
                  script=str(driver))
    out = proc.stdout + proc.stderr
    assert "warning: monitor.wandb.mode: online, but no W&B login" in out
    assert "best_effort: training goes on without it" in out
    store = run_dir / "monitor" / "mlruns"
    assert out.count(f"mlflow logging at step 3 failed (Exception: '{store}' does not exist.)") == 1  # MLflow's own
    assert "mlflow is off for the rest of this run, training goes on" in out
    assert [r["step"] for r in records(run_dir, "train")] == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == STEPS
    assert not (run_dir / "monitor" / "wandb").exists()
    assert FAKE_MLFLOW_TOKEN not in out and leaks(run_dir, FAKE_MLFLOW_TOKEN) == []


def test_problem_severity_follows_best_effort(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)
    cfg = {"enabled": True, "mode": "offline", "best_effort": True, "run_name": ""}
    run, problem = trackers._start_one("wandb", cfg, tmp_path, {})
    assert run is None and problem == Problem("monitor.wandb.enabled", "wandb is on but its package is not installed",
                                              problem.fix, "warning")
    run, problem = trackers._start_one("wandb", dict(cfg, best_effort=False), tmp_path, {})
    assert problem.severity == "error" and "--set monitor.wandb.best_effort=true to train without it" in problem.fix
