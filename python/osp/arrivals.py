"""Which rank holds the job back: each rank's arrival at the step's synchronization, from the per-step record.

Every mode's per-step record (``osp.agreement``) carries, per rank, the milliseconds from the end of
that rank's previous step to the moment it posted the record (HSP: to its "ready", before any extra
micro-batch): the rank's own compute, with no collective added. The sum lands identical on every rank,
so every rank keeps the same figures; ``Arrivals`` averages them. ``stats()`` reports each rank's mean
arrival and its mean lag behind the earliest rank, and rank 0 warns once when one rank's median arrival
over the last ``WINDOW`` steps is more than ``FACTOR`` times the median of the other ranks' medians (a
rank persistently slower: a noisy neighbour, a throttled device, longer inputs; a median, so that a few
slow steps, a checkpoint's or an evaluation's, do not count).
"""
from __future__ import annotations

import collections
import statistics
import warnings
from typing import Deque, List, Optional, Sequence


class Arrivals:
    WINDOW = 20  # steps the warning looks back on
    MIN_STEPS = 5  # steps recorded before it may fire
    FACTOR = 1.5  # slower than the median of the others by more than this

    def __init__(self, rank: int):
        self.rank = rank
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
        slow = self.slow_rank()
        if slow is not None and not self._warned:
            self._warned = True
            if self.rank == 0:
                r, ratio = slow
                warnings.warn(
                    f"osp: rank {r} is {ratio:.1f}x slower than the median of the other ranks (its median time "
                    f"from one step to the next step's synchronization over the last {len(self._window)} steps: "
                    f"{self._median_window(r):.0f} ms, the others' median {self._others_median(r):.0f} ms); every "
                    "synchronous step waits for it. Check that rank's host and device (a noisy neighbour, a "
                    "throttled GPU, a slower input pipeline); osp.HSP(max_extra=...) has the other ranks compute "
                    "extra micro-batches meanwhile. This warning is shown once; stats()['arrivals'] has the figures",
                    RuntimeWarning, stacklevel=2)

    def _median_window(self, r: int) -> float:
        """Rank ``r``'s median arrival over the window."""
        return statistics.median(a[r] for a in self._window)

    def _others_median(self, r: int) -> float:
        return statistics.median(self._median_window(o) for o in range(self.size) if o != r)

    def slow_rank(self) -> Optional[tuple]:
        """``(rank, how many times slower)`` of the slowest rank where it is persistently more than
        ``FACTOR`` times slower than the median of the others over the window, else None."""
        if self.size < 2 or len(self._window) < self.MIN_STEPS:
            return None
        r = max(range(self.size), key=self._median_window)
        others = self._others_median(r)
        ratio = self._median_window(r) / others if others > 0 else float("inf")
        return (r, ratio) if ratio > self.FACTOR else None

    def stats(self) -> dict:
        n = max(self.steps, 1)
        slow = self.slow_rank()
        return {"steps": self.steps, "arrival_ms": [s / n for s in self._sum],
                "lag_ms": [s / n for s in self._lag],
                "slow_rank": None if slow is None else slow[0],
                "slower": None if slow is None else slow[1]}
