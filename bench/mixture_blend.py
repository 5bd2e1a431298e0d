"""A mixture's blend index at scale (harness/data/blend.py, mix_rows.py): build time and memory as the sources and
the rows grow, side by side as ratios. Run alone (`python bench/mixture_blend.py`) or as `python bench/data.py
--mixtures`. In-process, no ranks.

  build    the pattern of one period (Tijdeman's rule, pure Python) for S sources at periods D of 10 .. 10^6
           positions (the period is the weights' common denominator: 0.5/0.3/0.2 -> 10; 4 decimals -> 10^4),
           cold (computed) and warm (read from the .npy cache a launch reads), and the bytes a rank then holds
           (the pattern, 2 bytes a position, and the counts every 4096 positions) with tracemalloc's peak of the
           warm load.
  rows     what a step costs as the run grows: the blend's picks for a global batch of 1024 at step 10 and at step
           10^9 (arithmetic in the position: no growth), and MixPlan.global_rows as the sources grow from 10^4 to
           10^7 rows each (each source's epoch order is a permutation of its rows, 8 bytes a row, as BatchPlan's).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from harness.data import blend as blend_mod  # noqa: E402
from harness.data.blend import Blend, cached_pattern, integer_weights  # noqa: E402
from harness.data.mix_rows import MixPlan  # noqa: E402


def weights_for(num: int, period: int) -> list[float]:
    """num weights whose common denominator is `period` (integers summing to it, as decimals)."""
    ints = [period // num + (1 if i < period % num else 0) for i in range(num)]
    ints[0] += 1 if period % num == 0 and period > num else 0
    ints[-1] -= 1 if period % num == 0 and period > num else 0
    return [w / period for w in ints]


def build(num: int, period: int, cache: Path) -> dict:
    weights = weights_for(num, period)
    ints, _ = integer_weights(weights)
    blend_mod._PATTERNS.clear()
    blend_mod._prefix.cache_clear()
    start = time.perf_counter()  # not under tracemalloc: it slows the pure-Python loop 10-100x
    cached_pattern(ints, cache / f"{num}_{period}.npy")
    Blend.of(weights).counts(10**12)  # the prefix counts
    cold_s = time.perf_counter() - start
    blend_mod._PATTERNS.clear()
    blend_mod._prefix.cache_clear()
    tracemalloc.start()
    start = time.perf_counter()
    assert cached_pattern(ints, cache / f"{num}_{period}.npy")
    Blend.of(weights).counts(10**12)
    warm_s = time.perf_counter() - start
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    held = blend_mod.pattern(ints).nbytes + blend_mod._prefix(ints).nbytes
    return {"period": sum(ints), "cold_s": cold_s, "warm_s": warm_s, "held": held, "peak": peak}


def step_cost(sizes: tuple[int, ...], step: int, global_batch: int = 1024) -> tuple[float, int]:
    plan = MixPlan(sizes=sizes, blend=Blend.of([0.5, 0.3, 0.2]), global_batch=global_batch, micro_batch=global_batch,
                   grad_accum=1)
    blend_mod.epoch_order.cache_clear()
    tracemalloc.start()
    start = time.perf_counter()
    plan.global_rows(step)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    start = time.perf_counter()
    for s in range(step + 1, step + 11):
        plan.global_rows(s)
    return (time.perf_counter() - start) / 10, peak


def pick_cost(blend: Blend, step: int, global_batch: int = 1024) -> float:
    blend.picks(step * global_batch, (step + 1) * global_batch)
    start = time.perf_counter()
    for s in range(step, step + 50):
        blend.picks(s * global_batch, (s + 1) * global_batch)
    return (time.perf_counter() - start) / 50


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--periods", default="10,1000,100000,1000000")
    p.add_argument("--sources", default="2,4,8")
    args = p.parse_args(argv)
    periods, counts = [int(x) for x in args.periods.split(",")], [int(x) for x in args.sources.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        results = {(s, d): build(s, d, Path(tmp)) for s in counts for d in periods}
    print("blend build: sources x period -> cold s, warm (cached) s, bytes held by a rank, tracemalloc peak")
    for (s, d), r in results.items():
        print(f"  S={s} D={r['period']:>9,}: cold {r['cold_s']:.4f}s warm {r['warm_s']:.4f}s held "
              f"{r['held'] / 2**10:,.1f} KiB peak {r['peak'] / 2**20:.2f} MiB")
    for s in counts:
        small, large = results[(s, periods[0])], results[(s, periods[-1])]
        print(f"  S={s}: period x{large['period'] / small['period']:,.0f} -> cold time x"
              f"{large['cold_s'] / max(small['cold_s'], 1e-9):,.0f}, held x{large['held'] / small['held']:,.0f}")
    for d in periods:
        a, b = results[(counts[0], d)], results[(counts[-1], d)]
        print(f"  D={a['period']:,}: sources x{counts[-1] / counts[0]:.0f} -> cold time x{b['cold_s'] / a['cold_s']:.1f},"
              f" held x{b['held'] / a['held']:.2f}")
    blend = Blend.of([0.45, 0.35, 0.2])
    early, late = (pick_cost(blend, step) for step in (10, 10**9))
    print(f"blend picks per step (G=1024, a period of 20): step 10 {early * 1e3:.3f} ms, step 10^9 {late * 1e3:.3f} ms "
          f"(x{late / early:.2f})")
    small, big = step_cost((10**4,) * 3, 10), step_cost((10**7,) * 3, 10)
    print(f"rows per step as sources grow 10^4 -> 10^7 rows each: {small[0] * 1e3:.2f} -> {big[0] * 1e3:.2f} ms "
          f"(x{big[0] / small[0]:.2f}); first step's peak {small[1] / 2**20:.2f} -> {big[1] / 2**20:.1f} MiB "
          f"(x{big[1] / small[1]:,.0f}: the epoch orders, 8 bytes a row, as BatchPlan's)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
