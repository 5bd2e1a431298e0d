"""tests/drivers/jobs.py for the preference tests: several harness jobs in ONE process group, with the stand-in pairs
(tests/helpers/pairs_standin.py) installed as harness.data.preference while that module has not landed."""

from __future__ import annotations

import importlib.util
import os
import sys

DRIVERS = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, DRIVERS)
sys.path.insert(0, os.path.dirname(DRIVERS))  # helpers
sys.path.insert(0, os.path.dirname(os.path.dirname(DRIVERS)))  # the repository (harness)

import jobs  # noqa: E402

from harness.dist import exit_now  # noqa: E402

if importlib.util.find_spec("harness.data.preference") is None:
    from helpers import pairs_standin

    sys.modules["harness.data.preference"] = pairs_standin

if __name__ == "__main__":
    exit_now(jobs.main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
