"""Log lines in the design's format (`[tag]   text`), printed through tqdm so they do not break a progress bar.

Ground floor: every room may print a line (rank 0 only; callers check). Also the two DeepSpeed 0.19.8 lines a
rank prints that no user can act on, each silenced where it starts and nowhere else."""

from __future__ import annotations

import contextlib
import sys

ALL_GATHER_DEPRECATED = r"`torch\.distributed\.all_gather_into_tensor` is deprecated"  # a regex, as warnings take it
SCHEDULER_NOT_STARTED = "Attempting to get learning rate from scheduler before it has started"


def say(tag: str, text: str) -> None:
    """A log line in the design's format: `[tag]   text` (rank 0 only; callers check)."""
    from tqdm import tqdm

    tqdm.write(f"[{tag}]{' ' * max(1, 8 - len(tag))}{text}", file=sys.stdout)


def quiet_deprecated_all_gather() -> None:
    """DeepSpeed's comm backend (deepspeed/comm/torch.py) calls torch.distributed.all_gather_into_tensor, which
    torch deprecates for all_gather_single: a FutureWarning on each rank's first ZeRO all-gather, about code no
    recipe can change. Only that message is ignored."""
    import warnings

    warnings.filterwarnings("ignore", message=ALL_GATHER_DEPRECATED, category=FutureWarning)


@contextlib.contextmanager
def quiet_scheduler_construction():
    """For deepspeed.initialize: DeepSpeed's WarmupLR and WarmupDecayLR constructors read their own learning rate
    before their first step, and get_lr warns about that read on every rank (runtime/lr_schedules.py). Only that
    line and only while the engine is built: a read before the first step anywhere else still warns."""
    import logging

    from deepspeed.utils import logger

    class NotStarted(logging.Filter):
        def filter(self, record: logging.LogRecord) -> bool:
            return record.getMessage() != SCHEDULER_NOT_STARTED

    quiet = NotStarted()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
