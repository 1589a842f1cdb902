"""How OSP picks the critical blocks: the budget (a fixed ratio, or "auto") and the selection."""
from __future__ import annotations

import math

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
    bytes as the measured bandwidth can move during the measured compute time of a step (forward +
    backward), never fewer critical blocks than ``min_critical``. The first ``warmup`` steps are fully
    critical (BSP) to measure the bandwidth. Every rank must reach the same number, so the
    measurements that drive it are averaged across ranks by the caller (``update`` takes them).
    """

    def __init__(self, critical, min_critical: float, warmup: int = 2, headroom: float = 0.8):
        self.critical, self.min_critical = critical, min_critical
        self.warmup, self.headroom = warmup, headroom
        self.steps = 0
        self.bw = None  # bytes / s, smoothed
        self.compute = None  # s, smoothed
        self.fraction = 1.0 if critical == "auto" else float(critical)

    def count(self, nblocks: int) -> int:
        if self.critical == "auto" and self.steps < self.warmup:
            frac = 1.0
        else:
            frac = max(self.fraction, self.min_critical)
        return min(nblocks, max(math.ceil(frac * nblocks), math.ceil(self.min_critical * nblocks), 1))

    def update(self, bytes_total: float, bw_sample: float, compute_s: float) -> None:
        """Feed one step's measurements (already identical on every rank)."""
        self.steps += 1
        if self.critical != "auto":
            return
        ema = lambda old, new: new if old is None else 0.7 * old + 0.3 * new
        if bw_sample > 0:
            self.bw = ema(self.bw, bw_sample)
        if compute_s > 0:
            self.compute = ema(self.compute, compute_s)
        if self.bw and self.compute and bytes_total > 0:
            hideable = self.headroom * self.bw * self.compute
            self.fraction = min(1.0, max(self.min_critical, 1.0 - hideable / bytes_total))

    def state_dict(self):
        return {"steps": self.steps, "bw": self.bw, "compute": self.compute, "fraction": self.fraction}

    def load_state_dict(self, d):
        self.steps, self.bw, self.compute, self.fraction = d["steps"], d["bw"], d["compute"], d["fraction"]
