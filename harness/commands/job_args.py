"""What the commands that write a multi-node job for a scheduler share (`harness slurm`, `harness k8s`): the run's
arguments, the world it is resolved for, and harness/run.py's command line inside the job.

A job is checked here, before anything is written: the recipe is resolved for nodes x ranks-per-node with the
checks `harness/run.py` makes before any rank trains, so a layout that does not fit that world exits 2 on the
login node instead of in the queue.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def count(text: str) -> int:
    """argparse type of --nodes and --gpus-per-node: a whole number >= 1."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a whole number >= 1")
    return int(text)


def add_run_arguments(parser: argparse.ArgumentParser, output_help: str) -> None:
    """The run (recipe, model, data, overrides, run folder) and its world (nodes x ranks per node)."""
    parser.add_argument("--recipe", required=True, help="the recipe harness/run.py trains")
    parser.add_argument("--model", help="harness/run.py --model")
    parser.add_argument("--dataset", help="harness/run.py --dataset")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="harness/run.py --set (repeatable)")
    parser.add_argument("--output-dir", help=output_help)
    parser.add_argument("--nodes", type=count, default=1, help="nodes (default 1)")
    parser.add_argument("--gpus-per-node", type=count, required=True, help="GPUs, one rank each, per node")
    parser.add_argument("--cpu", action="store_true", help="CPU ranks (no GPU request; --gpus-per-node counts ranks)")


def run_arguments(args, run_dir: Path) -> list[str]:
    """harness/run.py's arguments in the job (absolute run folder: the job may run from another directory)."""
    out = ["--recipe", args.recipe]
    out += ["--model", args.model] if args.model else []
    out += ["--dataset", args.dataset] if args.dataset else []
    for item in args.overrides:
        out += ["--set", item]
    return out + ["--output-dir", str(run_dir)]


def resolve(args, run_dir: Path | None, *, check_folder: bool = True):
    """(the recipe resolved for nodes x gpus ranks, "latest" if the folder holds a checkpoint to continue, else
    None); exit 2 with the arithmetic when the layout does not fit that world.

    check_folder False: the run folder lives on the cluster's storage (a Kubernetes volume), not here: resolve as a
    fresh run and leave the folder alone."""
    from harness.dist import Launch
    from harness.train import session

    per_node = args.gpus_per_node
    launch = Launch(world_size=args.nodes * per_node, local_size=per_node)
    here = run_dir if check_folder else None
    resume = session.auto_resume(here) if here is not None else None
    ns = argparse.Namespace(recipe=args.recipe, ds_config=None, output_dir=str(here) if here else None,
                            resume=resume, overwrite=False, overrides=overrides(args))
    return session.resolve_spec(ns, launch), resume


def overrides(args) -> list[str]:
    extra = [f"train.model={args.model}"] if args.model else []
    return list(args.overrides) + extra + ([f"train.dataset={args.dataset}"] if args.dataset else [])
