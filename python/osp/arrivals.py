"""Which rank holds the job back: each rank's arrival at the step's synchronization, from the per-step record.

Every mode's per-step record (``osp.agreement``) carries, per rank, the milliseconds from the end of
that rank's previous step to the moment it posted the record (HSP: to its "ready", before any extra
micro-batch): the rank's own compute, with no collective added. The sum lands identical on every rank,
so every rank keeps the same figures; ``Arrivals`` averages them. ``stats()`` reports each rank's mean
arrival and its mean lag behind the earliest rank.

A rank is **named** a straggler when, at each of ``HOLD`` consecutive steps, the window of the last ``WINDOW``
steps shows it slow: its median arrival more than ``FACTOR`` times the median of the other ranks' medians AND more
than ``FLOOR_MS`` behind it, and after the others in at least ``PERSIST`` of the window's steps. A median, so that
a few slow steps (a checkpoint's, an evaluation's) do not count; the persistence, so that scheduling noise between
balanced ranks is not called a straggler; the floor, so that a steady sub-millisecond offset is not; and the hold
(the rule met over ``WINDOW + HOLD - 1`` steps running), so that a spell of a busy host, which puts first one rank
behind and then another for a window or so, is not either (20-step windows alone named one in 2 of 4 balanced
runs on a 2-core host with a third process computing; the summary, judging the last window, then said "no slow
rank"). Once named, a rank stays named: ``stats()`` reports the verdict with the figures it was named on
(``named``) beside the last window's (``window``), so the warning and any summary of the run say the same thing.
Rank 0 warns once, at the user's ``step()`` line (``DistributedOptimizer.step`` emits it, whichever mode read the
record inside backward). The advice in the warning is the mode's (``Mode.straggler_advice``).
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
    HOLD = 20  # consecutive steps whose windows must each show the rank slow before it is named


    def __init__(self, rank: int, advice: str = ""):
        self.rank, self.advice = rank, advice
        self._reset(0)
        self._warned = False
        self._pending: Optional[str] = None  # the warning, until the step() that read the record returns
        self._this_step = False  # a record was taken for the current step already

    def _reset(self, size: int) -> None:
        self.size, self.steps = size, 0
        self._sum = [0.0] * size
        self._lag = [0.0] * size
        self._window: Deque[List[float]] = collections.deque(maxlen=self.WINDOW)
        self._held = 0  # consecutive steps whose window showed the same slow rank
        self._held_rank: Optional[int] = None
        self.named: Optional[dict] = None  # the verdict, once a rank is named (it stays named in this world)

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
        slow = self._slow_now()
        if slow is None:
            self._held, self._held_rank = 0, None
        else:  # one more step showing this rank slow (the same rank as the steps before, or it starts over)
            self._held = self._held + 1 if slow == self._held_rank else 1
            self._held_rank = slow
        if self.named is None and self._held >= self.HOLD:
            w = self._slowest()
            self.named = {**w, "slower": self._slow_factor(w), "at_step": self.steps,
                          "held_steps": self.WINDOW + self.HOLD - 1}
            if self.rank == 0 and not self._warned:  # only rank 0 warns, once
                self._warned = True
                self._pending = self._message(self.named)

    def warn_pending(self) -> None:
        """Emit the warning a record raised, at the user's line: called by ``DistributedOptimizer.step()`` (and
        ``flush()``) once the mode's step returned, so it names the ``step()`` call even where the mode read the
        record inside backward."""
        if self._pending is not None:
            msg, self._pending = self._pending, None
            warn(msg)

    def _message(self, w: dict) -> str:
        return (f"osp: rank {w['rank']} is {w['slower']:.1f}x slower than the median of the other ranks (its median "
                f"time from one step to the next step's synchronization over the last {w['steps']} steps: "
                f"{w['median_ms']:.1f} ms, the others' median {w['others_median_ms']:.1f} ms, behind them in "
                f"{w['persistence']:.0%} of those steps; and slow so in every {w['steps']}-step window of the last "
                f"{w['held_steps']} steps); every "
                "synchronous step waits for it. Check that rank's host and device (a noisy neighbour, a throttled "
                f"GPU, a slower input pipeline); {self.advice or 'see stats()'}. This warning is shown once; "
                "stats()['arrivals'] has the figures")

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

    def _slow_factor(self, w: dict) -> float:
        return w["median_ms"] / w["others_median_ms"] if w["others_median_ms"] > 0 else float("inf")

    def _slow_now(self) -> Optional[int]:
        """The rank the last full window shows slow (factor, floor and persistence), else None."""
        w = self._slowest() if len(self._window) >= self.WINDOW else None
        if w is None or not (self._slower(w["median_ms"], w["others_median_ms"]) and w["persistence"] >= self.PERSIST):
            return None
        return w["rank"]

    def slow_rank(self) -> Optional[tuple]:
        """``(rank, how many times slower)`` of the rank named a straggler (see the module docstring; once named it
        stays named, with the factor it was named at), else None."""
        if self.named is None:
            return None
        return self.named["rank"], self.named["slower"]

    def stats(self) -> dict:
        n = max(self.steps, 1)
        slow = self.slow_rank()
        return {"steps": self.steps, "arrival_ms": [s / n for s in self._sum],
                "lag_ms": [s / n for s in self._lag],
                "slow_rank": None if slow is None else slow[0],
                "slower": None if slow is None else slow[1],
                "named": None if self.named is None else dict(self.named),
                "window": self._slowest()}

    def _slowest(self) -> Optional[dict]:
        """The window's slowest rank and the figures the rule reads (why it is, or is not, named)."""
        if self.size < 2 or not self._window:
            return None
        r = max(range(self.size), key=self._median_window)
        mine, others = self._median_window(r), self._others_median(r)
        return {"steps": len(self._window), "rank": r, "median_ms": mine, "others_median_ms": others,
                "persistence": self._persistence(r)}
