"""`harness slurm [SCRIPT] --recipe NAME --nodes N --gpus-per-node G [--submit]`: a Slurm batch script for a run.

The script (the template harness/assets/slurm.sbatch, filled in) asks for N nodes with one task each, runs
`harness launch --no_ssh --node_rank $SLURM_NODEID` in every task (each node's DeepSpeed launcher starts G
ranks), has Slurm send SIGUSR1 `--signal-lead` seconds before the time limit, forwards it to the ranks (they
checkpoint at one agreed step and exit 75) and then requeues the job, whose rerun resumes from `latest`.
Before writing anything the recipe is resolved for N x G ranks, with the checks `harness/run.py` makes before
any rank trains: a layout that does not fit that world (pipeline stages, tp, batch arithmetic) exits 2 here
instead of in the queue. `--submit` runs sbatch and prints the job id; without it, the sbatch line is printed.
"""

from __future__ import annotations

import argparse
import re
import shlex
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path

from harness.commands import job_args
from harness.errors import UsageError

TEMPLATE = "slurm.sbatch"  # in harness/assets/
FIELD = re.compile(r"\{\{(\w+)\}\}")
SIGNAL_LEAD_S = 120
MAX_SIGNAL_LEAD_S = 65535  # Slurm's limit for --signal=...@S
TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")  # Slurm's --time forms


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("script", nargs="?", help="where to write the batch script (default: RUN_DIR/slurm/job.sbatch)")
    job_args.add_run_arguments(parser, "the run folder, on storage every node shares; a requeued job resumes it "
                                       "(default: <train.output_dir>/<job name>)")
    parser.add_argument("--time", default="24:00:00", help="time limit, Slurm's forms (default 24:00:00)")
    parser.add_argument("--signal-lead", type=int, default=SIGNAL_LEAD_S, metavar="S",
                        help=f"SIGUSR1 this many seconds before the limit: the time to reach a step boundary "
                             f"and save (default {SIGNAL_LEAD_S})")
    parser.add_argument("--partition", help="#SBATCH --partition")
    parser.add_argument("--account", help="#SBATCH --account")
    parser.add_argument("--job-name", help="#SBATCH --job-name (default dsharness-RECIPE)")
    parser.add_argument("--submit", action="store_true", help="run sbatch and print the job id")


def time_limit_s(text: str) -> int:
    """Seconds in a Slurm --time (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S); UsageError if it is none of them."""
    m = TIME.match(text.strip())
    if not m:
        raise UsageError(f"harness slurm --time {text}: not a Slurm time limit\n"
                         "    fix: minutes (90), HH:MM:SS (01:30:00) or D-HH:MM:SS (1-12:00:00)")
    days, a, b, c = (int(g) if g else None for g in m.groups())
    if days is not None:  # D-H, D-H:M, D-H:M:S
        return days * 86400 + a * 3600 + (b or 0) * 60 + (c or 0)
    if c is not None:
        return a * 3600 + b * 60 + c
    return a * 60 + (b or 0)  # M or M:S


def check_timing(args) -> None:
    limit = time_limit_s(args.time)
    lead = args.signal_lead
    if not 0 < lead <= MAX_SIGNAL_LEAD_S or lead >= limit:
        raise UsageError(f"harness slurm --signal-lead {lead} with --time {args.time} ({limit} s): the signal must "
                         f"come after the start and before the limit (1 <= lead < {limit}, at most "
                         f"{MAX_SIGNAL_LEAD_S})\n    fix: a lead that covers one step and one save, e.g. "
                         f"--signal-lead {min(SIGNAL_LEAD_S, max(1, limit // 10))}")


def render(fields: dict[str, str]) -> str:
    text = resources.files("harness").joinpath("assets", TEMPLATE).read_text()
    missing = sorted(set(FIELD.findall(text)) - set(fields))
    if missing:
        raise RuntimeError(f"harness/assets/{TEMPLATE}: no value for {missing}")
    return FIELD.sub(lambda m: fields[m.group(1)], text)


def script_fields(args, run_dir: Path, script: Path, world: int) -> dict[str, str]:
    per_node = args.gpus_per_node
    gpus = (f"# CPU ranks ({per_node} per node): no GPUs requested" if args.cpu
            else f"#SBATCH --gpus-per-node={per_node}")
    extra = [f"#SBATCH --partition={args.partition}"] if args.partition else []
    extra += [f"#SBATCH --account={args.account}"] if args.account else []
    harness_bin = shutil.which("harness") or str(Path(sys.executable).parent / "harness")
    return {"summary": f"recipe {args.recipe}, {world} ranks = {args.nodes} nodes x {per_node}",
            "script": str(script), "job_name": _job_name(args), "nodes": str(args.nodes), "gpus": gpus,
            "time": args.time, "lead": str(args.signal_lead), "log": str(run_dir / "slurm" / "job-%j.log"),
            "root": str(Path.cwd()), "extra": "\n".join(extra), "per_node": str(per_node),
            "run_dir": shlex.quote(str(run_dir)), "harness": shlex.quote(harness_bin),
            "run_py": shlex.quote(str(Path(str(resources.files("harness") / "run.py")).resolve())),
            "run_args": " ".join(shlex.quote(a) for a in job_args.run_arguments(args, run_dir))}


def _job_name(args) -> str:
    return args.job_name or f"dsharness-{args.recipe}"


def submit(script: Path) -> str:
    """sbatch SCRIPT -> the job id."""
    if shutil.which("sbatch") is None:
        raise UsageError(f"harness slurm --submit: no sbatch on PATH (this is not a Slurm login node, or Slurm's "
                         f"client is not installed); the script is written\n    fix: on a login node run "
                         f"`sbatch {script}`, or install slurm-client")
    done = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True)
    if done.returncode != 0:
        raise UsageError(f"sbatch {script} refused the job: {done.stderr.strip() or done.stdout.strip()}\n"
                         "    fix: check --partition/--account/--time against `sinfo` and your association")
    return done.stdout.strip().split(";")[0]


def run(args: argparse.Namespace) -> int:
    check_timing(args)
    run_dir = Path(args.output_dir).resolve() if args.output_dir else None
    spec, resume = job_args.resolve(args, run_dir)
    if run_dir is None:
        run_dir = (Path(spec.recipe["train"]["output_dir"]) / _job_name(args)).resolve()
        spec, resume = job_args.resolve(args, run_dir)  # the default folder may hold an earlier run: the same checks
    world = args.nodes * args.gpus_per_node
    script = Path(args.script).resolve() if args.script else run_dir / "slurm" / "job.sbatch"
    (run_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch needs the log's folder to exist
    script.parent.mkdir(parents=True, exist_ok=True)
    script.write_text(render(script_fields(args, run_dir, script, world)))
    script.chmod(0o755)
    what = f"continues {run_dir} from its latest checkpoint" if resume else f"trains into {run_dir}"
    print(f"wrote {script}: recipe {args.recipe} on {args.nodes} node(s) x {args.gpus_per_node} "
          f"{'CPU ranks' if args.cpu else 'GPUs'} = world {world}; {what}; SIGUSR1 {args.signal_lead} s before "
          f"the --time {args.time} limit, then checkpoint and requeue")
    if args.submit:
        print(f"submitted job {submit(script)} (log: {run_dir / 'slurm'}/job-<id>.log)")
    else:
        print(f"submit with: sbatch {shlex.quote(str(script))}")
    return 0
