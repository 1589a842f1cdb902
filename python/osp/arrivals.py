"""Which rank holds the job back: each rank's arrival at the step's synchronization, from the per-step record.

Every mode's per-step record (``osp.agreement``) carries, per rank, the milliseconds from the end of
that rank's previous step to the moment it posted the record (HSP: to its "ready", before any extra
micro-batch): the rank's own compute, with no collective added. The sum lands identical on every rank,
so every rank keeps the same figures; ``Arrivals`` averages them. ``stats()`` reports each rank's mean
arrival and its mean lag behind the earliest rank, and rank 0 warns once, at the user's line, when one rank
is a straggler: over a full window of ``WINDOW`` steps its median arrival is more than ``FACTOR`` times the
median of the other ranks' medians AND more than ``FLOOR_MS`` behind it, and it arrived after the others in at
least ``PERSIST`` of the window's steps. A median, so that a few slow steps (a checkpoint's, an evaluation's)
do not count; the full window and the persistence, so that scheduling noise and a slow warm-up between
balanced ranks (3 ms against 2 ms for a few steps is 1.5x) is not called a straggler; the floor, so that a
steady sub-millisecond offset is not. The advice in the warning is the mode's (``Mode.straggler_advice``).
"""
from __future__ import annotations

import collections
import statistics
from typing import Deque, List, Optional, Sequence

from .warn import warn


class Arrivals:
    WINDOW = 20  # steps the warning looks back on; it decides only on a full window
    FACTOR = 1.5  # slower than the median of the others by more than this
    FLOOR_MS = 1.5  # and behind it by more than this (below: timer and scheduling noise)
    PERSIST = 0.8  # share of the window's steps where the rank arrived after the others


    def __init__(self, rank: int, advice: str = ""):
        self.rank, self.advice = rank, advice
        self._reset(0)
        self._warned = False
        self._this_step = False  # a record was taken for the current step already

    def _reset(self, size: int) -> None:
        self.size, self.steps = size, 0
        self._sum = [0.0] * size
        self._lag = [0.0] * size
        self._window: Deque[List[float]] = collections.deque(maxlen=self.WINDOW)

    def next_step(self) -> None:
        """The optimizer's step returned: the next record is the next step's."""
        self._this_step = False

    def record(self, ms: Sequence[float]) -> None:
        """Every rank's arrival of one step (ms; identical on every rank). The first record of a step
        counts (a mode may read several); a step where some rank knows no arrival yet (its first, after a
        restart) is not counted."""
        if self._this_step:
            return
        self._this_step = True
        ms = list(ms)
        if len(ms) != self.size:  # the first record, or another world
            self._reset(len(ms))
        if len(ms) < 2 or not all(a > 0 for a in ms):
            return
        first = min(ms)
        self.steps += 1
        for r, a in enumerate(ms):
            self._sum[r] += a
            self._lag[r] += a - first
        self._window.append(ms)
        if self.rank == 0 and not self._warned and self.slow_rank() is not None:  # only rank 0 warns, once
            self._warned = True
            w = self._slowest()
            warn(f"osp: rank {w['rank']} is {w['median_ms'] / w['others_median_ms']:.1f}x slower than the median of "
                 "the other ranks (its median time from one step to the next step's synchronization over the last "
                 f"{w['steps']} steps: {w['median_ms']:.0f} ms, the others' median {w['others_median_ms']:.0f} ms, "
                 f"behind them in {w['persistence']:.0%} of those steps); every synchronous step waits for it. Check "
                 "that rank's host and device (a noisy neighbour, a throttled GPU, a slower input pipeline); "
                 f"{self.advice or 'see stats()'}. This warning is shown once; stats()['arrivals'] has the figures")

    def _median_window(self, r: int) -> float:
        """Rank ``r``'s median arrival over the window."""
        return statistics.median(a[r] for a in self._window)

    def _others_median(self, r: int) -> float:
        return statistics.median(self._median_window(o) for o in range(self.size) if o != r)

    def _slower(self, mine: float, others: float) -> bool:
        """The two tests: more than ``FACTOR`` times, and more than ``FLOOR_MS``, behind ``others``."""
        return mine > self.FACTOR * others and mine - others > self.FLOOR_MS

    def _persistence(self, r: int) -> float:
        """The share of the window's steps where rank ``r`` arrived after the other ranks' median of that step
        (by any amount: a straggler is behind in nearly every step, a balanced rank in about half)."""
        return sum(a[r] > statistics.median(x for o, x in enumerate(a) if o != r)
                   for a in self._window) / max(len(self._window), 1)

    def slow_rank(self) -> Optional[tuple]:
        """``(rank, how many times slower)`` of the slowest rank where it is a straggler over a full window
        (see the module docstring), else None."""
        w = self._slowest() if len(self._window) >= self.WINDOW else None
        if w is None or not (self._slower(w["median_ms"], w["others_median_ms"]) and w["persistence"] >= self.PERSIST):
            return None
        return w["rank"], (w["median_ms"] / w["others_median_ms"] if w["others_median_ms"] > 0 else float("inf"))

    def stats(self) -> dict:
        n = max(self.steps, 1)
        slow = self.slow_rank()
        return {"steps": self.steps, "arrival_ms": [s / n for s in self._sum],
                "lag_ms": [s / n for s in self._lag],
                "slow_rank": None if slow is None else slow[0],
                "slower": None if slow is None else slow[1],
                "window": self._slowest()}

    def _slowest(self) -> Optional[dict]:
        """The window's slowest rank and the figures the rule reads (why it is, or is not, named)."""
        if self.size < 2 or not self._window:
            return None
        r = max(range(self.size), key=self._median_window)
        mine, others = self._median_window(r), self._others_median(r)
        return {"steps": len(self._window), "rank": r, "median_ms": mine, "others_median_ms": others,
                "persistence": self._persistence(r)}
