"""A finished run folder -> report.md, report.json and PNG plots: measured memory and traffic beside the prediction.

May import: the ground floor, config/, planner/, data/, model/, checkpoint/, profiling/, train/."""

from harness.report.compare import compare_flags, load_run, write_report

__all__ = ["compare_flags", "load_run", "write_report"]
