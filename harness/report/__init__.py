"""A finished run folder -> report.md, report.json and PNG plots: measured memory and traffic beside the prediction."""

from harness.report.compare import compare_flags, load_run, write_report

__all__ = ["compare_flags", "load_run", "write_report"]
