"""Compile DeepSpeed's JIT ops ahead of time (`python -m harness.ops`), so runs and tests don't pay for it.

First compile takes minutes per op; the torch extensions cache keeps the result.
"""

from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    accel = get_accelerator()
    for name in OPS:
        builder = accel.create_op_builder(name)
        if builder is None:
            print(f"[ops] {name}: not used on {accel.device_name()}")
            continue
        if not builder.is_compatible(verbose=False):
            print(f"[ops] {name}: not compatible here (for async_io: apt-get install libaio-dev)")
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        print(f"[ops] {name}: ready ({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
