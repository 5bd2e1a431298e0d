"""Run many `harness/run.py` invocations in ONE interpreter: python catalogue_driver.py CASES.json RESULTS.json.

Each case is {"argv": [...], "env": {...}}; its result is {"rc", "stderr", "stdout"}, with the process's file
descriptors 1 and 2 captured (so logging handlers and C++ output are seen too). The interpreter's start-up
(torch, deepspeed, transformers: ~8 s here) is paid once instead of once per case. Cases that fail before
init leave nothing behind; a case that reaches init must come last, as it sets the single-process
environment (RANK, MASTER_PORT); the environment is restored before every case anyway.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from harness.run import main  # noqa: E402


def run_case(argv: list[str], env: dict) -> dict:
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            rc = main(argv)
        except BaseException:  # an escaped exception is what the catalogue exists to catch
            traceback.print_exc()
            rc = -1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
        out.seek(0), err.seek(0)
        return {"rc": rc, "stdout": out.read(), "stderr": err.read(), "env": sorted(env)}


def main_driver(cases_path: str, results_path: str) -> int:
    cases = json.loads(open(cases_path).read())
    base = dict(os.environ)
    results = {}
    for case in cases:
        os.environ.clear()
        os.environ.update(base)
        for key, value in case["env"].items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        start = time.perf_counter()
        results[case["id"]] = run_case(case["argv"], case["env"])
        results[case["id"]]["seconds"] = round(time.perf_counter() - start, 2)
    from harness.ops import op_problem

    from deepspeed.accelerator import get_accelerator

    results["async_io_loads"] = op_problem("async_io") is None  # some cases expect libaio to be missing
    results["accelerator"] = get_accelerator().device_name()
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main_driver(*sys.argv[1:3]))
