"""Profiling hooks (communication per collective, memory per rank, throughput).

Contract with harness/job.py:
  ds_overrides(spec, run_dir) -> dict   DeepSpeed keys merged into the config before initialize
                                        (comms_logger only when a profile window is set; monitors)
  make_hooks(spec, engine, dist, run_dir, log) -> list of objects with
      before_step(step: int) -> None
      after_step(step: int) -> dict | None   fields merged into that step's metrics record
      close() -> dict | None                  fields merged into summary.json
"""

from __future__ import annotations


def ds_overrides(spec, run_dir) -> dict:
    return {}


def make_hooks(spec, engine, dist, run_dir, log) -> list:
    return []
