"""`harness report RUN_DIR [RUN_DIR ...]`: report.md with plots, predicted vs measured, in each run folder.

With several run folders each report also flags cross-run surprises (a higher ZeRO stage peaking above
a lower one for the same model and world size).
"""

from __future__ import annotations

import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dirs", nargs="+", metavar="RUN_DIR",
                        help="run folder(s) written by harness/run.py (runs/ID)")


def run(args: argparse.Namespace) -> int:
    from harness.report import write_report

    for run_dir in args.run_dirs:
        others = [d for d in args.run_dirs if d != run_dir]
        path = write_report(run_dir, others)
        print(f"[report]  {path}")
    return 0
