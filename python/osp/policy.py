"""How OSP picks the critical blocks: the budget (a fixed ratio, or "auto") and the selection."""
from __future__ import annotations

import math
import statistics
from typing import List, Optional

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
    """The number of critical blocks per step, and whether stage 1 starts during backward.

    Fixed: ``ceil(critical * nblocks)`` per bucket, at least ``min_critical * nblocks``; stage 1 always
    starts from the backward hooks. ``auto`` decides by measuring, in four phases, and then holds:

    1. ``warmup`` steps fully critical with stage 1 at ``step()`` (nothing else on the network): the
       bandwidth (bytes of stage 1 over its time) and the compute between steps;
    2. ``probe`` steps fully critical with stage 1 from the backward hooks, which is BSP as DDP does
       it: the iteration time, and the backward window its buckets overlap;
    3. ``probe`` steps at the modelled share ``c = HEADROOM * backward / allreduce``: stage 1 (``c`` of
       the bytes) fits in the backward window, stage 2 runs behind the next forward and backward; a
       share of 1 or more means the allreduce hides in backward anyway, and phase 3 is skipped;
    4. settled: ``c`` if its iterations were at least ``MARGIN`` faster than BSP's, else fully
       critical (in-backward BSP: ``auto`` never runs slower than BSP for long, and defers nothing
       where deferring does not pay). With ``warmup=2`` and ``probe=3`` it settles at step 10.

    Every rank must reach the same numbers, so the measurements are averaged across ranks by the
    caller (``update`` takes them).
    """

    HEADROOM = 0.8  # share of the backward window stage 1 may fill
    MARGIN = 0.03  # deferring must make iterations at least this much faster than BSP to be kept
    MIN_SAMPLE = 0.25  # a stage 1 moving less than this share of the bytes is too small to time

    def __init__(self, critical, min_critical: float, warmup: int = 2, probe: int = 3):
        self.critical, self.min_critical, self.warmup, self.probe = critical, min_critical, warmup, probe
        self.steps = 0
        self.bw: Optional[float] = None  # bytes / s, from the warmup
        self.compute: Optional[float] = None  # s between steps, from the warmup
        self.backward: List[float] = []  # s: the backward windows of phase 2
        self.iterations = {"bsp": [], "osp": []}  # s: iterations of phases 2 and 3
        self.model: Optional[float] = None  # the modelled share of phase 3
        self.phase = "warmup" if critical == "auto" else "fixed"
        self.fraction = 1.0 if critical == "auto" else float(critical)

    def count(self, nblocks: int) -> int:
        frac = self.fraction if self.phase in ("fixed", "osp", "settled") else 1.0
        if self.phase == "fixed" or frac < 1.0:
            frac = max(frac, self.min_critical)
        return min(nblocks, max(math.ceil(frac * nblocks), math.ceil(self.min_critical * nblocks)))

    @property
    def in_backward(self) -> bool:
        """Whether stage 1 starts from the backward hooks (not while ``auto`` times the network)."""
        return self.phase != "warmup"

    @property
    def needs_scores(self) -> bool:
        """Whether block scores can still matter (not once every block stays critical for good)."""
        return not (self.phase in ("fixed", "settled") and self.fraction >= 1.0)

    def stage1_sample(self, nbytes: int, seconds: float, total_bytes: int) -> float:
        """This rank's bandwidth sample from a stage 1 run at ``step()`` (0: none)."""
        if self.phase == "warmup" and seconds > 0 and nbytes >= self.MIN_SAMPLE * total_bytes:
            return nbytes / seconds
        return 0.0

    def update(self, bytes_total: float, bandwidth: float, compute: float, backward: float,
               iteration: float) -> None:
        """Feed one step's measurements (already identical on every rank): a bandwidth sample (0: none),
        the compute before this step, this step's backward window and the previous iteration's time."""
        self.steps += 1
        if self.critical != "auto":
            return
        s, w, p = self.steps, self.warmup, self.probe
        if bandwidth > 0:  # a warmup step's, a step late: the last one's is kept (the first may
            self.bw = bandwidth  # include connection setup)
        if self.phase == "warmup":
            if compute > 0:
                self.compute = compute
            if s >= w:
                self.phase = "bsp"
            return
        # iteration() of step s-1 arrives with step s
        if self.phase == "bsp":
            if backward > 0:
                self.backward.append(backward)
            if s > w + 1:
                self.iterations["bsp"].append(iteration)
            if s == w + p:
                self._model(bytes_total)
            return
        if self.phase == "osp":
            if s == w + p + 1:
                self.iterations["bsp"].append(iteration)  # the last one of phase 2
            elif s > w + p + 2:  # phase 3's first step waits for no stage 2: not typical
                self.iterations["osp"].append(iteration)
            if s == w + 2 * p + 1:
                osp_s = statistics.median(self.iterations["osp"])
                bsp_s = statistics.median(self.iterations["bsp"])
                self.fraction = self.model if osp_s < (1.0 - self.MARGIN) * bsp_s else 1.0
                self.phase = "settled"

    def _model(self, bytes_total: float) -> None:
        allreduce = bytes_total / self.bw if self.bw else 0.0
        window = statistics.median(self.backward) if self.backward else 0.0
        share = self.HEADROOM * window / allreduce if allreduce > 0 else 1.0
        self.model = min(1.0, max(self.min_critical, share))
        if self.model >= 1.0:
            self.fraction, self.phase = 1.0, "settled"
        else:
            self.fraction, self.phase = self.model, "osp"

    def state_dict(self):
        return {"steps": self.steps, "bw": self.bw, "compute": self.compute, "fraction": self.fraction,
                "phase": self.phase, "model": self.model, "backward": list(self.backward),
                "iterations": {k: list(v) for k, v in self.iterations.items()}}

    def load_state_dict(self, d):
        if "phase" not in d:  # saved by an osp before the phases: measure again
            return
        self.steps, self.bw, self.compute, self.fraction = d["steps"], d["bw"], d["compute"], d["fraction"]
        self.phase, self.model = d["phase"], d["model"]
        self.backward = list(d["backward"])
        self.iterations = {k: list(v) for k, v in d["iterations"].items()}
