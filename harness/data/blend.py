"""The blend index of a mixture: which source every row the run reads comes from, and which of its rows.

The run reads rows in one global order: data batch b reads positions [b * G, (b + 1) * G) (G: the global batch).
Position i goes to a source by the blend, and to the source's k-th row read so far, k -> epoch k // n, row
order[k % n] of a seeded permutation per (source, epoch): a source that runs out starts a new epoch in a new order.

The blend keeps every source's count of rows read within one row of weight x rows read, at every position. Megatron's
BlendedDataset (helpers.cpp build_blending_indices) picks, at each position, the source with the largest error
weight * (i + 1) - count; that greedy misses the bound by a few percent of a row for some weights (measured: 1.044
rows at weights 2:32:6:39:2:32). Here the pick is Tijdeman's (the chairman assignment problem, 1980): among the
sources that picking keeps within 1 - 1/(2(S - 1)) of their share, the one whose share would fall behind first.
Its error stays below 1 - 1/(2(S - 1)) < 1 for every weight vector, so with integer weights W (sum D) every count
equals its share exactly at position D, and the blend is one pattern of D positions repeated: a rank holds D
source ids (D <= MAX_PERIOD) and the counts at any position are arithmetic, whatever the run's length.

Weights are exact decimals (0.5, 0.3, 0.2: D = 10; 1, 1, 1: D = 3). Weights whose common denominator exceeds
MAX_PERIOD are rounded to millionths (largest remainder), and `Blend.rounded` says so.

A resume with changed weights starts a new segment at the position it resumes from: the counts carry over, the
new weights hold from there on, and the bound holds for the rows read since (the run says so).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache

import numpy as np

MAX_PERIOD = 1 << 20  # largest exact pattern; beyond it weights are rounded to ROUNDED_DENOMINATOR
ROUNDED_DENOMINATOR = 10**6


def integer_weights(weights) -> tuple[tuple[int, ...], bool]:
    """(integer weights W with the exact proportions, or millionths; whether they were rounded)."""
    if not weights or any(not (w > 0 and math.isfinite(w)) for w in weights):
        raise ValueError(f"weights must be positive and finite, got {list(weights)}")
    exact = [Fraction(repr(float(w))) for w in weights]
    total = sum(exact)
    shares = [w / total for w in exact]
    denominator = math.lcm(*(s.denominator for s in shares))
    if denominator <= MAX_PERIOD:
        return tuple(int(s * denominator) for s in shares), False
    scaled = [s * ROUNDED_DENOMINATOR for s in shares]
    out = [max(1, math.floor(x)) for x in scaled]
    by_remainder = sorted(range(len(out)), key=lambda s: (-(scaled[s] - math.floor(scaled[s])), s))
    for s in by_remainder[:ROUNDED_DENOMINATOR - sum(out)]:
        out[s] += 1
    g = math.gcd(*out)
    return tuple(x // g for x in out), True


_PATTERNS: dict[tuple[int, ...], np.ndarray] = {}  # this process's patterns (a launch uses one or two)


def pattern(weights: tuple[int, ...]) -> np.ndarray:
    """Source ids of one period (sum(weights) positions) of Tijdeman's sequence for integer weights."""
    if weights not in _PATTERNS:
        _PATTERNS[weights] = build_pattern(weights)
    return _PATTERNS[weights]


def cached_pattern(weights: tuple[int, ...], path) -> bool:
    """Read weights' pattern from the .npy file at path, or build it and write it there (atomically); whether it
    was read."""
    import os
    from pathlib import Path

    path = Path(path)
    try:
        ids = np.load(path)
        if len(ids) == sum(weights) and ids.dtype == np.uint16:
            _PATTERNS[weights] = ids
            return True
    except (OSError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.npy")
    np.save(tmp, pattern(weights))
    os.replace(tmp, path)
    return False


def build_pattern(weights: tuple[int, ...]) -> np.ndarray:
    """Tijdeman's sequence over one period, computed."""
    num, period = len(weights), sum(weights)
    if num == 1:
        return np.zeros(period, dtype=np.uint16)
    q = 2 * (num - 1)  # delta = 1 - 1/q: the largest error any count may reach
    counts = [0] * num
    out = np.empty(period, dtype=np.uint16)
    for t in range(1, period + 1):
        best = -1
        for s in range(num):
            # eligible: (counts[s] + 1) - w_s t <= delta, in integers (times q * period)
            if q * period * (counts[s] + 1) - q * weights[s] * t > (q - 1) * period:
                continue
            # the earliest deadline (q c + q - 1) / W: compared crosswise, ties to the lower id
            if best < 0 or (q * counts[s] + q - 1) * weights[best] < (q * counts[best] + q - 1) * weights[s]:
                best = s
        assert best >= 0, f"no eligible source at {t} for {weights}"  # Tijdeman's theorem
        counts[best] += 1
        out[t - 1] = best
    assert counts == list(weights), (counts, weights)  # the bound < 1 makes the period exact
    return out


PREFIX_BLOCK = 4096  # the pattern's counts are kept every PREFIX_BLOCK positions (8 x S bytes each)


@lru_cache(maxsize=16)
def _prefix(weights: tuple[int, ...]) -> np.ndarray:
    """[period // PREFIX_BLOCK + 1, S] int64: each source's count in the pattern's first j * PREFIX_BLOCK positions."""
    ids = pattern(weights)
    blocks = [np.bincount(ids[j:j + PREFIX_BLOCK], minlength=len(weights)) for j in range(0, len(ids), PREFIX_BLOCK)]
    return np.concatenate([np.zeros((1, len(weights)), np.int64), np.cumsum(np.asarray(blocks, np.int64), axis=0)])


def _within(weights: tuple[int, ...], offset: int) -> np.ndarray:
    """[S] counts after `offset` positions of one segment: whole periods, then a block's prefix and the rest."""
    period = sum(weights)
    whole, rest = divmod(int(offset), period)
    block = rest // PREFIX_BLOCK
    tail = np.bincount(pattern(weights)[block * PREFIX_BLOCK:rest], minlength=len(weights))
    return whole * np.asarray(weights, dtype=np.int64) + _prefix(weights)[block] + tail


@dataclass(frozen=True)
class Segment:
    """From global position `start` on, the blend of integer `weights` (counts continue from the earlier segment)."""

    start: int
    weights: tuple[int, ...]


class Blend:
    """The blend over S sources as segments; `rounded`: some weights were rounded to millionths."""

    def __init__(self, segments: list[Segment], rounded: bool = False):
        if not segments or segments[0].start != 0:
            raise ValueError("a blend's first segment starts at position 0")
        if any(b.start <= a.start for a, b in zip(segments, segments[1:])):
            raise ValueError(f"segments must start at increasing positions: {[s.start for s in segments]}")
        if len({len(s.weights) for s in segments}) != 1:
            raise ValueError("every segment weighs the same sources")
        self.segments, self.rounded = list(segments), rounded
        self.num_sources = len(segments[0].weights)
        base = np.zeros(self.num_sources, dtype=np.int64)
        self._bases = []  # counts at each segment's start
        for i, seg in enumerate(self.segments):
            self._bases.append(base)
            if i + 1 < len(self.segments):
                base = base + _within(seg.weights, self.segments[i + 1].start - seg.start)

    @classmethod
    def of(cls, weights) -> "Blend":
        ints, rounded = integer_weights(weights)
        return cls([Segment(0, ints)], rounded)

    def reweighted(self, position: int, weights) -> "Blend":
        """This blend up to `position`, then the new weights (a resume with changed weights)."""
        ints, rounded = integer_weights(weights)
        kept = [s for s in self.segments if s.start < position]
        if kept[-1].weights == ints:
            return self
        return Blend(kept + [Segment(position, ints)], self.rounded or rounded)

    def _segment_at(self, position: int) -> int:
        return max(i for i, s in enumerate(self.segments) if s.start <= position)

    def counts(self, position: int) -> np.ndarray:
        """[S] rows of each source read in positions [0, position)."""
        i = self._segment_at(position)
        return self._bases[i] + _within(self.segments[i].weights, position - self.segments[i].start)

    def picks(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray]:
        """(source id, k: how many rows of that source were read before it) of every position in [lo, hi)."""
        ids, ks = np.empty(hi - lo, dtype=np.int64), np.empty(hi - lo, dtype=np.int64)
        for i, seg in enumerate(self.segments):
            end = self.segments[i + 1].start if i + 1 < len(self.segments) else hi
            a, b = max(lo, seg.start), min(hi, end)
            if a >= b:
                continue
            offsets = np.arange(a - seg.start, b - seg.start, dtype=np.int64)
            src = pattern(seg.weights)[offsets % sum(seg.weights)].astype(np.int64)
            onehot = np.zeros((len(src), self.num_sources), dtype=np.int64)
            onehot[np.arange(len(src)), src] = 1
            before = self.counts(a) + np.cumsum(onehot, axis=0) - onehot  # counts before each position, [n, S]
            ids[a - lo:b - lo], ks[a - lo:b - lo] = src, before[np.arange(len(src)), src]
        return ids, ks

    def state(self) -> list[dict]:
        """What a checkpoint keeps to continue this blend (JSON)."""
        return [{"start": s.start, "weights": list(s.weights)} for s in self.segments]

    @classmethod
    def from_state(cls, state: list[dict], rounded: bool = False) -> "Blend":
        return cls([Segment(int(s["start"]), tuple(int(w) for w in s["weights"])) for s in state], rounded)


def epoch_seed(seed: int, source: int, epoch: int) -> int:
    return int(np.random.SeedSequence([seed, source, epoch]).generate_state(1)[0])


@lru_cache(maxsize=8)
def epoch_order(num_rows: int, seed: int, source: int, epoch: int) -> np.ndarray:
    """Row order of one source's epoch (callers must not mutate it)."""
    return np.random.default_rng(epoch_seed(seed, source, epoch)).permutation(num_rows)
