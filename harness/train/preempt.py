"""Preemption: SIGTERM or SIGUSR1 on any rank -> every rank stops at the same step boundary, saves, exits 75.

Who gets the signal differs: Slurm (`--signal`), Kubernetes and `kill` on the whole process group reach every
rank at once; DeepSpeed's launcher terminates its ranks one at a time (SIGTERM to rank 0's process tree,
up to 30 s for it to end, then the next rank), so a rank that got nothing must still learn of it from rank 0.

Agreement without a per-step collective: a signalled rank, at its next step boundary d, proposes in the
process group's key-value store (the TCPStore every rank already talks to) to stop after step d + 1; the
first proposal wins (compare_set). Every rank looks the key up at each boundary, one small request to the
store (~40 us here), not a collective. Step d + 1 is safe: no rank can finish step d + 1 before the proposer
starts it (its collectives need the proposer), so every rank sees the proposal at boundary d + 1 at the
latest, and none has passed it. With one rank the stop is at the boundary where the signal is seen.

The handlers are installed only around the training loop: before it there is nothing to save, and after it
the last checkpoint is written, so the default action (terminate) is right there.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on request with a checkpoint; `--resume latest` continues it
# a numeric fault stopped the run (train/faults.py); here, beside the other codes a rank reports, so that
# `harness launch` reads them without importing torch. Not restarted by --max-restarts: the same batch would fault again
EXIT_NUMERIC_FAULT = 3
# a served teacher (distill.teacher_model_server_url) stopped answering after its retries: an outage, not bad input,
# so `harness launch --max-restarts`, Kubernetes, Ray and the Slurm script retry it (resuming from `latest`)
EXIT_TEACHER_UNAVAILABLE = 69  # EX_UNAVAILABLE
EXIT_DIR_ENV = "DSHARNESS_EXIT_DIR"  # set by `harness launch`: where each rank reports its exit code
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
KEY = "harness/preempt_at_step"


def _default_store():
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    return dist.distributed_c10d._get_default_store()


class Preemption:
    def __init__(self):
        self.signum: int | None = None
        self.stop_at: int | None = None
        self.store = _default_store()
        self._saved: dict = {}

    def __enter__(self) -> "Preemption":
        for sig in SIGNALS:
            self._saved[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame) -> None:
        self.signum = self.signum or signum  # only a flag: the loop acts at its next step boundary

    @property
    def reason(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal on another rank"

    def stop_after(self, done: int) -> bool:
        """Called by every rank at every step boundary (`done` steps finished): stop and save here?"""
        if self.stop_at is None:
            if self.store is None:
                self.stop_at = done if self.signum else None
            elif self.signum:
                self.stop_at = int(self.store.compare_set(KEY, "", str(done + 1)))
            elif self.store.check([KEY]):
                self.stop_at = int(self.store.get(KEY))
        if self.stop_at is not None and done > self.stop_at:  # the argument above says this cannot happen
            raise RuntimeError(f"preemption: this rank is past step {self.stop_at}, which the ranks agreed to stop at")
        return self.stop_at == done


def report_exit(code: int, launch) -> None:
    """Tell `harness launch` this rank's exit code: DeepSpeed's launcher exits 1 after a signal whatever its ranks
    return, so the wrapper reads the codes here. Written by rename: a report is whole or absent.
    `launch`: harness.dist.Launch, this rank's and the ranks on its node."""
    folder = os.environ.get(EXIT_DIR_ENV)
    if not folder:
        return
    rank = launch.rank
    tmp = Path(folder) / f".rank{rank}.tmp"
    try:
        tmp.write_text(json.dumps({"rank": rank, "code": code, "local_world_size": launch.local_size}))
        os.replace(tmp, Path(folder) / f"rank{rank}.json")
    except OSError:  # the wrapper is gone or the folder with it: nobody to tell
        pass
