"""What one rank measures of its steps, for OSP's ``auto`` (``osp.policy.Budget``) and ``stats()``: ``Meter``."""
from __future__ import annotations

import math
import time
from typing import List, Optional


class Meter:
    """What one rank measures of its steps for ``auto`` (and ``stats()``), in the terms of ``osp.stepmodel``: from
    the step's start (the end of the previous ``step()``), when each bucket's average was issued and when backward
    ended; the ``step()``'s own work (its time less its waits for the network); the time from one step's end to
    the next; and the link's achieved rate: the gradient bytes of the collectives that completed over the time
    the link had at least one of them in flight (the union of their intervals, so that stage 2 and the next
    stage 1 sharing the link count once). A collective's end is when its engine completed it (a Gloo future's
    callback); where the engine tells nobody (Horovod, NCCL), when osp found it done: a rate then errs low.

    ``figures()`` is this rank's part of the step's agreement (``FIELDS``, milliseconds and MB/s); the sum lands
    identical on every rank and ``Budget.update`` decides from it, so every rank decides alike."""

    def __init__(self, nbuckets: int):
        self.nbuckets = nbuckets
        self.fields = ("compute_ms", "work_ms", "iteration_ms", "rate_mbps", "rate_n", "started") + tuple(
            f"ready{b}_ms" for b in range(nbuckets))
        self._t_end: Optional[float] = None  # the last step's end: this step's start
        self._iteration = 0.0  # the last step's time from the end of the one before it
        self._ready: List[Optional[float]] = [None] * nbuckets
        self._compute: Optional[float] = None
        self._entry: Optional[float] = None
        self._waited = 0.0
        self._work = 0.0  # the last step's own work
        self._flights: List[tuple] = []  # (handle, gradient bytes) of collectives not yet seen complete
        self._done: List[tuple] = []  # (t0, t1, bytes) of the completed ones of the last two samples
        self._marks: List[int] = []  # how many of ``_done`` each of the last samples added
        self.sample_rate: Optional[float] = None  # bytes/s: overrides every sample while set (tests)

    @staticmethod
    def now() -> float:
        return time.monotonic()  # the clock of Handle.t0 / t1 and osp.linkemu

    def _since_start(self) -> float:
        return 0.0 if self._t_end is None else self.now() - self._t_end

    def issued(self, b: int, handle) -> None:
        """Bucket ``b``'s average was issued (its gradient is ready); ``handle``: None where nothing travels."""
        if self._ready[b] is None:
            self._ready[b] = self._since_start()
        if handle is not None:
            self.track(handle)

    def track(self, handle) -> None:
        """A bulk collective whose time measures the link (not the agreement's small sums)."""
        if handle is not None and handle.t0 is not None:  # an empty one never travels
            res = handle.result
            self._flights.append((handle, res.numel() * res.element_size()))

    def backward_end(self) -> None:
        if self._compute is None:
            self._compute = self._since_start()

    def entry(self) -> None:
        """``step()`` was called: backward ended by now (a mode told of no backward pass: its buckets start here)."""
        self.backward_end()
        self._entry, self._waited = self.now(), 0.0

    def waited(self, seconds: float) -> None:
        """``step()`` waited this long for the network (not its own work)."""
        self._waited += seconds

    def end(self) -> None:
        """``step()`` returns: the step's work and iteration; the next step starts now."""
        t = self.now()
        if self._entry is not None:
            self._work = max(0.0, t - self._entry - self._waited)
        self._iteration = 0.0 if self._t_end is None else t - self._t_end
        self._t_end, self._entry = t, None
        self._ready, self._compute = [None] * self.nbuckets, None

    def restart(self) -> None:
        """This step's backward runs again (``no_sync``-less re-entry): its ready times start over."""
        self._ready, self._compute = [None] * self.nbuckets, None

    def _rate(self) -> float:
        """The link's achieved rate over the collectives completed since the last two samples (bytes/s; 0: none)."""
        keep = []
        added = 0
        for h, nbytes in self._flights:
            if h.t1 is None:
                keep.append((h, nbytes))
            else:  # an emulated link (osp.linkemu) ends it no sooner than its booked end
                self._done.append((h.t0, h.t1 if h.due is None else max(h.t1, h.due), nbytes))
                added += 1
        self._flights = keep
        self._marks.append(added)
        if len(self._marks) > 2:
            self._done = self._done[self._marks.pop(0):]
        if not added:
            return 0.0
        union, end, total = 0.0, -math.inf, 0
        for t0, t1, nbytes in sorted(self._done):
            total += nbytes
            if t1 > end:
                union += t1 - max(t0, end)
                end = t1
        return total / union if union > 0 and total > 0 else 0.0

    def figures(self) -> dict:
        """This rank's part of the step's agreement (see ``FIELDS``): this step's compute and ready times, the
        last step's work and iteration, a rate sample (``rate_n`` 1 where there is one), and whether this step's
        start is known (``started``: not on a rank's first step, whose times count from nothing)."""
        rate = self._rate()
        if self.sample_rate is not None:
            rate = self.sample_rate
        compute = self._compute if self._compute is not None else self._since_start()
        out = {"compute_ms": 1e3 * compute, "work_ms": 1e3 * self._work, "iteration_ms": 1e3 * self._iteration,
               "rate_mbps": rate / 1e6, "rate_n": 1.0 if rate > 0 else 0.0,
               "started": 1.0 if self._t_end is not None else 0.0}
        for b, r in enumerate(self._ready):
            out[f"ready{b}_ms"] = 1e3 * (compute if r is None else min(r, compute))
        return out

    def agreed(self, total) -> dict:
        """Every rank's mean of the figures (``total``: the agreement's sum, an ``Agreed``), in seconds and
        bytes/s; ``started``: every rank knew when this step started, so its compute and ready times are real)."""
        n = total.total("rate_n")
        return {"compute": total.mean("compute_ms") * 1e-3, "work": total.mean("work_ms") * 1e-3,
                "iteration": total.mean("iteration_ms") * 1e-3,
                "rate": total.total("rate_mbps") * 1e6 / n if n > 0 else 0.0,
                "ready": [total.mean(f"ready{b}_ms") * 1e-3 for b in range(self.nbuckets)],
                "started": total.mean("started") >= 1.0}
