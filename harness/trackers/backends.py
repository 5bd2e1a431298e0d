"""The two experiment trackers behind one small interface, each through its library's own Python API.

    run = WandbRun(cfg, run_dir, run_name, params)    starts the run (raises when it cannot)
    run.log(step, {name: value})                      one point per metric at that step
    run.summary({name: value}, step)                  the run's end values (wandb: run summary; MLflow: at `step`)
    run.finish(exit_code)                             0 finished, 75 preempted, anything else failed

`problem(cfg, run_dir)` says, without starting anything, why a tracker cannot start here: its package is missing,
wandb online without a login, a tracking server that does not answer. It is asked on rank 0 just before the start.

W&B: offline by default (`monitor.wandb.mode`), into RUN/monitor/wandb/offline-run-*/ (`wandb sync` uploads it
later); the recipe's mode wins over $WANDB_MODE. MLflow: a file store in RUN/monitor/mlruns unless
`monitor.mlflow.tracking_uri` names another. MLflow 3.x keeps the file store in maintenance mode and refuses it
unless MLFLOW_ALLOW_FILE_STORE=true: the harness sets that for a file: URI (and `mlflow ui --backend-store-uri
file:RUN/monitor/mlruns` needs it too). Against a server, MLflow retries a failed request 7 times with a doubling
backoff (minutes): unless the user set them, the harness's process retries twice with a 15 s timeout, so a server
that dies mid-run costs one stall, after which that tracker is off (harness/trackers/__init__.py).
"""

from __future__ import annotations

import importlib.util
import os
import re
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlsplit

PINS = {"wandb": "wandb==0.31.0", "mlflow": "mlflow-skinny==3.18.0"}  # constraints.txt; the `trackers` extra
PROBE_TIMEOUT_S = 5
WANDB_HOST = "https://api.wandb.ai"
MLFLOW_HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "15"}
MLFLOW_BATCH = 100  # params per log_batch call (the tracking server's limit)
MLFLOW_PARAM_CHARS = 6000  # longest param value MLflow stores
MLFLOW_BAD_KEY_CHARS = re.compile(r"[^\w./\- :]")


def shown(url: str, mask: str = "***@") -> str:
    """A URL fit for a message: user and password (https://user:token@host) replaced by `mask`."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if "@" not in parts.netloc:
        return url
    return parts._replace(netloc=mask + parts.netloc.rsplit("@", 1)[1]).geturl()


def unanswered(url: str) -> str | None:
    """Why nothing answers an HTTP request to `url` within PROBE_TIMEOUT_S, or None when something does (any
    status: a 401 or 404 still is a server). No credentials are sent, not even those inside the URL."""
    try:
        request = urllib.request.Request(shown(url, mask=""), method="GET")
        urllib.request.urlopen(request, timeout=PROBE_TIMEOUT_S).close()
    except urllib.error.HTTPError:
        return None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", e)
        return f"{type(reason).__name__}: {reason}" if not isinstance(reason, str) else reason
    return None


def missing_package(name: str) -> tuple[str, str, str] | None:
    if importlib.util.find_spec(name) is not None:
        return None
    return (f"monitor.{name}.enabled", f"{name} is on but its package is not installed",
            f"pip install {PINS[name]} (or pip install -e '.[trackers]'), or --set monitor.{name}.enabled=false")


class WandbRun:
    name = "wandb"

    @staticmethod
    def problem(cfg: dict, run_dir: Path) -> tuple[str, str, str] | None:
        if found := missing_package("wandb"):
            return found
        if cfg["mode"] != "online":
            return None
        host = os.environ.get("WANDB_BASE_URL") or WANDB_HOST
        offline = ("--set monitor.wandb.mode=offline (written to RUN/monitor/wandb, uploaded later with "
                   "`wandb sync`)")
        why = _wandb_login_problem(host)
        if why:
            return "monitor.wandb.mode", f"online, but {why}", f"`wandb login` (or export WANDB_API_KEY), or {offline}"
        if why := unanswered(host):
            return ("monitor.wandb.mode", f"online, but the W&B server {shown(host)} does not answer ({why})",
                    f"check the network or WANDB_BASE_URL, or {offline}")
        return None

    def __init__(self, cfg: dict, run_dir: Path, run_name: str, params: dict):
        import wandb

        (run_dir / "monitor").mkdir(parents=True, exist_ok=True)  # wandb looks for a git repository from there
        self.run = wandb.init(mode=cfg["mode"], dir=str(run_dir / "monitor"), project=cfg["project"],
                              entity=cfg["entity"] or None, name=run_name, group=cfg["group"] or None,
                              tags=cfg["tags"] or None, config=params, reinit="create_new",
                              settings=wandb.Settings(console="off", quiet=True))
        self.where = str(Path(self.run.dir).parent)  # RUN/monitor/wandb/offline-run-<time>-<id>

    def log(self, step: int, metrics: dict) -> None:
        self.run.log(metrics, step=step)

    def summary(self, values: dict, step: int) -> None:
        self.run.summary.update(values)

    def finish(self, exit_code: int) -> None:
        self.run.finish(exit_code=exit_code)


def _wandb_login_problem(host: str) -> str | None:
    """Why W&B has no credentials for `host` ($WANDB_API_KEY, ~/.netrc, wandb's settings), asked the way wandb.init
    asks, minus its interactive prompt (a rank's stdin may be a terminal) and without the network."""
    try:
        from wandb.sdk.lib.wbauth import authenticate  # wandb 0.31's lookup; older: env and netrc below
    except ImportError:
        import netrc

        try:
            found = netrc.netrc().authenticators(urlsplit(host).hostname or "")
        except (OSError, netrc.NetrcParseError):
            found = None
        return None if os.environ.get("WANDB_API_KEY") or found else f"no W&B login for {shown(host)}"
    try:
        auth = authenticate.authenticate_session(host=host, source="dsharness", prompt=False, update_session=False)
    except Exception as e:  # AuthenticationError: a key of the wrong form (the message never holds the key)
        return f"the W&B login is not usable ({e})"
    return None if auth is not None else f"no W&B login for {shown(host)} (no WANDB_API_KEY, no ~/.netrc entry)"


def mlflow_uri(cfg: dict, run_dir: Path) -> str:
    return cfg["tracking_uri"] or (Path(run_dir).absolute() / "monitor" / "mlruns").as_uri()


class MlflowRun:
    name = "mlflow"

    @staticmethod
    def problem(cfg: dict, run_dir: Path) -> tuple[str, str, str] | None:
        if found := missing_package("mlflow"):
            return found
        uri = mlflow_uri(cfg, run_dir)
        if urlsplit(uri).scheme in ("http", "https") and (why := unanswered(uri)):
            return ("monitor.mlflow.tracking_uri", f"the MLflow server {shown(uri)} does not answer ({why})",
                    "start it (`mlflow server --host ... --port ...`), correct the URI, or leave tracking_uri empty "
                    "for a file store in the run folder (RUN/monitor/mlruns)")
        return None

    def __init__(self, cfg: dict, run_dir: Path, run_name: str, params: dict):
        uri = mlflow_uri(cfg, run_dir)
        if uri.startswith("file:"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        for name, value in MLFLOW_HTTP_DEFAULTS.items():
            os.environ.setdefault(name, value)
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        found = self.client.get_experiment_by_name(cfg["experiment"])
        experiment = found.experiment_id if found else self.client.create_experiment(cfg["experiment"])
        self.run_id = self.client.create_run(experiment, run_name=run_name,
                                             tags={"dsharness.run_dir": str(Path(run_dir).absolute())}).info.run_id
        flat = [Param(mlflow_key(k), v[:MLFLOW_PARAM_CHARS]) for k, v in flatten(params).items()]
        for i in range(0, len(flat), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=flat[i:i + MLFLOW_BATCH])
        self.where = f"{shown(uri)} (experiment {cfg['experiment']!r}, run {self.run_id})"

    def log(self, step: int, metrics: dict) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(mlflow_key(k), v, now_ms, step) for k, v in metrics.items()])

    def summary(self, values: dict, step: int) -> None:
        self.log(step, values)

    def finish(self, exit_code: int) -> None:
        status = "FINISHED" if exit_code == 0 else "KILLED" if exit_code == 75 else "FAILED"
        self.client.set_terminated(self.run_id, status)


def mlflow_key(key: str) -> str:
    """MLflow names allow letters, digits, _ - . / space and colon; anything else (from a raw deepspeed key) -> _."""
    return MLFLOW_BAD_KEY_CHARS.sub("_", key)


def param_text(value) -> str:
    """A parameter as MLflow stores it: strings as they are, everything else as JSON (true, null, [1, 2], 0.001)."""
    import json

    return value if isinstance(value, str) else json.dumps(value)


def flatten(tree: dict, prefix: str = "") -> dict[str, str]:
    """{"recipe": {"train": {"steps": 8}}} -> {"recipe.train.steps": "8"}; an empty block is kept as "{}"."""
    out: dict[str, str] = {}
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, dotted + "."))
        else:
            out[dotted] = param_text(value)
    return out


BACKENDS = {"wandb": WandbRun, "mlflow": MlflowRun}
