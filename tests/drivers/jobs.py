"""Run several harness jobs in ONE DeepSpeed process group: deepspeed --num_gpus N tests/drivers/jobs.py CASES.json.

CASES.json is a list of harness/run.py argument lists, run in order by every rank (a resume case after the run it
resumes); a case may instead be {"argv": [...], "code": N}, a job expected to end with exit code N (a numeric
fault, a served teacher's outage), or {"call": "drivers.MODULE:FUNCTION", "args": [...]}, a test driver's function
run on every rank in the same process group (it returns 0). Each launch costs ~20 s of start-up and process-group set-up on a loaded 2-core machine; the jobs themselves
take seconds. Every case goes through the same session.prepare -> job.run as harness/run.py, only the
process group is shared (job.main would tear it down after each job). A failing case raises: the launcher then
ends every rank and the test reports the launch's output. Rank 0 marks the start of each case's output on stdout
and stderr, so a test can read one case's share (tests/helpers/launch.py: job_output).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(TESTS))  # the repository (harness)
sys.path.insert(0, TESTS)  # helpers

from harness.dist import exit_now  # noqa: E402
from harness.startup import quick_start  # noqa: E402
from helpers.launch import JOB_MARK  # noqa: E402


def forget_engine_groups() -> None:
    """DeepSpeed keeps the last engine's model-parallel unit (and device mesh) in module globals and overwrites them
    only when the next engine brings its own: a data-parallel case after a tensor- or pipeline-parallel one would
    read the old groups (measured: ZeRO-3 after tp fails in get_model_parallel_rank). A fresh process starts with
    none; so does each case here."""
    from deepspeed.utils import groups

    groups.mpu = None
    groups.mesh_device = None


def main(cases_path: str) -> int:
    from harness.train import job, run_args, session
    from harness import dist as distmod

    cases = json.loads(open(cases_path).read())
    dist = distmod.init(10)
    try:
        for index, case in enumerate(cases):
            argv, expected = (case.get("argv"), case.get("code", 0)) if isinstance(case, dict) else (case, 0)
            if dist.is_main:  # where each case's output starts: the other ranks wrote theirs before the barrier
                for stream in (sys.stdout, sys.stderr):
                    print(f"{JOB_MARK}{index}", file=stream, flush=True)
            if argv is None:  # a driver's function (tests/drivers/teacher_store.py: write)
                module, name = case["call"].split(":")
                argv, code = case, getattr(importlib.import_module(module), name)(*case["args"])
            else:
                code = job.run(session.prepare(run_args.parse(argv), distmod.launched()), dist)
            if code != expected:
                raise SystemExit(f"case {argv} exited {code}, expected {expected}")
            forget_engine_groups()
            distmod.barrier()
    finally:
        distmod.teardown()
    return 0


if __name__ == "__main__":
    quick_start()  # harness/run.py's start-up, before DeepSpeed is imported
    exit_now(main(next(a for a in sys.argv[1:] if not a.startswith("--local_rank"))))
