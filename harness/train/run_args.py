"""Command-line flags of `deepspeed harness/run.py` (pinned by tests/test_run_args.py so they don't sprawl)."""

from __future__ import annotations

import argparse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="harness/run.py",
        description="Train a Hugging Face causal LM with DeepSpeed from a recipe. "
                    "Launch: harness launch --num_gpus N harness/run.py --recipe NAME")
    p.add_argument("--recipe", default=None,
                   help="recipe name from recipes/, a recipe .json path, or auto (the planner picks for this hardware); "
                        "default: zero2_offload")
    p.add_argument("--ds-config", default=None, metavar="FILE",
                   help="a DeepSpeed JSON to use instead of the recipe's (the recipe still gives run settings)")
    p.add_argument("--model", default=None, help="preset, local HF model dir, or hub id (= --set train.model=...)")
    p.add_argument("--dataset", default=None, help="builtin, local file/folder, or hub id (= --set train.dataset=...)")
    p.add_argument("--output-dir", default=None, help="run folder (default: <train.output_dir>/<date>_<recipe>)")
    p.add_argument("--resume", nargs="?", const="latest", default=None, metavar="latest|auto|PATH",
                   help="continue from the latest checkpoint of --output-dir, or from a checkpoint PATH; auto: "
                        "continue if --output-dir holds a complete checkpoint, else start fresh (a rerun of the same "
                        "command: a restarted pod, harness ray's relaunch)")
    p.add_argument("--overwrite", action="store_true", help="replace checkpoints/outputs already in --output-dir")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="typed recipe override, e.g. --set train.steps=20 (see `harness recipes --keys`)")
    p.add_argument("--profile-steps", default=None, metavar="A-B",
                   help="profile steps A..B (comm + memory); '' turns profiling off (= --set profile.steps=A-B)")
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    args = parser().parse_args(argv)
    sugar = {"train.model": args.model, "train.dataset": args.dataset, "profile.steps": args.profile_steps}
    args.overrides = [f"{k}={v}" for k, v in sugar.items() if v is not None] + args.overrides
    return args
