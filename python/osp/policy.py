"""How OSP picks the critical blocks: the budget (a fixed ratio, or "auto") and the selection."""
from __future__ import annotations

import math
import time
from typing import Optional

import torch


def select_critical(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` highest-scoring blocks. Deterministic for the same input, so ranks that hold
    the same (allreduced) scores pick the same set; ties go to the lower block index."""
    n = scores.numel()
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    if k >= n:
        mask.fill_(True)
    elif k > 0:
        # stable descending sort: equal scores keep index order, whatever topk's internals do
        order = torch.sort(scores, descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask


class Budget:
    """The number of critical blocks per step.

    Fixed: ``ceil(critical * nblocks)``, at least ``min_critical * nblocks``. ``auto``: defer as many
    bytes as the measured bandwidth can move in the measured window stage 2 has before the next step
    waits for it (the next forward/backward plus the rest of the step; the compute time between
    steps until a stage 2 has run), never fewer critical blocks than ``min_critical``. The first
    ``warmup`` steps are fully critical (BSP) to measure the bandwidth. That model is then corrected by
    feedback: while stage 2 arrives before it is awaited, the estimate of what can hide grows; when
    the step has to wait for it, it shrinks. Every rank must reach the same number, so the
    measurements that drive it are averaged across ranks by the caller (``update`` takes them); this
    rank's own ones come from ``stage1_done``, ``stage2_launched`` and ``stage2_awaited``.
    """

    HEADROOM = 0.8  # share of the modelled hideable bytes actually deferred
    SMOOTHING = 0.5  # weight of the newest measurement in the running averages
    HIDDEN = 0.02  # a wait below this share of the window: stage 2 hid, defer more
    EXPOSED = 0.1  # a wait above this share of the window: stage 2 showed, defer less
    GAIN_UP, GAIN_DOWN = 1.15, 0.8  # feedback steps of the model's gain
    GAIN_MIN, GAIN_MAX = 0.25, 4.0
    MIN_SAMPLE = 0.25  # a stage 1 moving less than this share of the bytes is too small to time

    def __init__(self, critical, min_critical: float, warmup: int = 2):
        self.critical, self.min_critical, self.warmup = critical, min_critical, warmup
        self.steps = 0
        self.bw = None  # bytes / s, smoothed
        self.compute = None  # s, smoothed: the window stage 2 can hide in
        self.gain = 1.0  # feedback correction of the model
        self.fraction = 1.0 if critical == "auto" else float(critical)
        # this rank's measurements, fed to every rank through the side channel
        self.bw_sample = 0.0
        self.window: Optional[float] = None  # seconds the last stage 2 had before it was awaited
        self._launched = 0.0

    def count(self, nblocks: int) -> int:
        if self.critical == "auto" and self.steps < self.warmup:
            frac = 1.0
        else:
            frac = max(self.fraction, self.min_critical)
        return min(nblocks, max(math.ceil(frac * nblocks), math.ceil(self.min_critical * nblocks)))

    # -- this rank's measurements ----------------------------------------------------------------
    def stage1_done(self, nbytes: int, seconds: float, total_bytes: int) -> None:
        if seconds > 0 and nbytes >= self.MIN_SAMPLE * total_bytes:
            self.bw_sample = nbytes / seconds

    def stage2_launched(self) -> None:
        self._launched = time.perf_counter()

    def stage2_awaited(self) -> None:
        self.window = time.perf_counter() - self._launched

    # -- the shared model --------------------------------------------------------------------------
    def update(self, bytes_total: float, bw_sample: float, window_s: float, wait_s: float = 0.0) -> None:
        """Feed one step's measurements (already identical on every rank): a bandwidth sample, the
        window the last stage 2 had to hide in, and how long the step waited for it."""
        self.steps += 1
        if self.critical != "auto":
            return
        a = self.SMOOTHING
        ema = lambda old, new: new if old is None else (1 - a) * old + a * new  # noqa: E731
        if bw_sample > 0:
            self.bw = ema(self.bw, bw_sample)
        if window_s > 0:
            self.compute = ema(self.compute, window_s)
            if self.steps > self.warmup:
                if wait_s < self.HIDDEN * window_s:
                    self.gain = min(self.gain * self.GAIN_UP, self.GAIN_MAX)
                elif wait_s > self.EXPOSED * window_s:
                    self.gain = max(self.gain * self.GAIN_DOWN, self.GAIN_MIN)
        if self.bw and self.compute and bytes_total > 0:
            hideable = self.gain * self.HEADROOM * self.bw * self.compute
            self.fraction = min(1.0, max(self.min_critical, 1.0 - hideable / bytes_total))

    def state_dict(self):
        return {"steps": self.steps, "bw": self.bw, "compute": self.compute, "fraction": self.fraction,
                "gain": self.gain}

    def load_state_dict(self, d):
        self.steps, self.bw, self.compute, self.fraction = d["steps"], d["bw"], d["compute"], d["fraction"]
        self.gain = d.get("gain", 1.0)
