"""Run many `harness/run.py` invocations in ONE interpreter: python tests/drivers/catalogue.py CASES.json RESULTS.json.

Each case is {"argv": [...], "env": {...}, "needs": None | "no_libaio" | "cpu_accelerator"}; its result is
{"rc", "stderr", "stdout"}, with the process's file descriptors 1 and 2 captured (so logging handlers and C++ output are seen too). The interpreter's start-up
(torch, deepspeed, transformers: ~8 s here) is paid once instead of once per case. Cases that fail before
init leave nothing behind; a case that reaches init must come last, as it sets the single-process
environment (RANK, MASTER_PORT); the environment is restored before every case anyway. A case whose "needs"
this machine does not meet (libaio missing, DeepSpeed on its CPU accelerator) is not run at all: on a machine
with libaio the NVMe case would otherwise train. Those needs are found out after the cases without needs have
run. Cases that set an HF_* variable run first of all: huggingface_hub reads HF_HUB_OFFLINE once, when it is
imported, and many cases import it (DeepSpeed does).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

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


def conditions() -> dict[str, bool]:
    from deepspeed.accelerator import get_accelerator

    from harness.ops import op_problem

    return {"no_libaio": op_problem("async_io") is not None, "cpu_accelerator": get_accelerator().device_name() == "cpu"}


def main_driver(cases_path: str, results_path: str) -> int:
    cases = json.loads(open(cases_path).read())
    first = [c for c in cases if not c.get("needs") and not c.get("post_init")]
    first.sort(key=lambda c: not any(key.startswith("HF_") for key in c["env"]))  # stable: HF_* ones first
    cases = first + [c for c in cases if c not in first]  # in given order: post-init ones stay last
    base = dict(os.environ)

    def environment(env: dict) -> None:
        os.environ.clear()
        os.environ.update(base)
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value

    results, met = {}, None
    for case in cases:
        if case.get("needs") and met is None:
            environment({})
            met = conditions()
        if case.get("needs") and not met[case["needs"]]:
            results[case["id"]] = {"skipped": case["needs"]}
            continue
        environment(case["env"])
        start = time.perf_counter()
        results[case["id"]] = run_case(case["argv"], case["env"])
        results[case["id"]]["seconds"] = round(time.perf_counter() - start, 2)
    if met is None:
        environment({})
        met = conditions()
    results.update(async_io_loads=not met["no_libaio"], accelerator="cpu" if met["cpu_accelerator"] else "other")
    with open(results_path, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main_driver(*sys.argv[1:3]))
