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
    starts from the backward hooks. ``auto`` decides by measuring, then holds:

    1. ``warmup`` steps fully critical with stage 1 at ``step()`` (nothing else on the network): the
       bandwidth (bytes of stage 1 over its time);
    2. ``probe`` steps fully critical with stage 1 from the backward hooks, which is BSP as DDP does
       it: the iteration time, and the backward window its buckets overlap;
    3. ``probe`` steps at the modelled share ``c = HEADROOM * backward / allreduce`` (stage 1 fits in
       the backward window; stage 2 runs behind the next forward and backward); a share of 1 or more
       means the allreduce hides in backward anyway: no trial, every block stays critical;
    4. ``probe`` steps at ``c / 4`` (at least ``min_critical``): the bucket that is ready last, at the
       end of backward, can only send its critical blocks after backward, where the step waits for
       them; a smaller share shortens that wait (skipped when it equals ``c``);
    5. settled: the fastest of the three by their iterations (the first step of a trial, which waits
       for no stage 2 of its own share, is not counted), where a smaller share must win by ``MARGIN``:
       ``auto`` defers nothing where deferring does not pay (the steps are then BSP's) and no more than
       pays. With ``warmup=2`` and ``probe=2`` it settles at step 10.

    Every rank must reach the same numbers, so the measurements are averaged across ranks by the
    caller (``update`` takes them).
    """

    HEADROOM = 0.8  # share of the backward window stage 1 may fill
    MARGIN = 0.03  # a smaller critical share must make iterations at least this much faster to be kept
    MIN_SAMPLE = 0.25  # a stage 1 moving less than this share of the bytes is too small to time
    TRIALS = ("bsp", "model", "small")

    def __init__(self, critical, min_critical: float, warmup: int = 2, probe: int = 2):
        self.critical, self.min_critical, self.warmup, self.probe = critical, min_critical, warmup, probe
        self.steps = 0
        self.bw: Optional[float] = None  # bytes / s, from the warmup
        self.backward: List[float] = []  # s: the backward windows of phase 2
        self.shares = {"bsp": 1.0}  # the share each trial ran
        self.iterations = {k: [] for k in self.TRIALS}  # s: the counted iterations of each trial
        self._counts_for: Optional[str] = None  # the trial the last step counts for (None: not counted)
        self._in_phase = 0  # steps run in the current phase
        self.model: Optional[float] = None  # the modelled share
        self.phase = "warmup" if critical == "auto" else "fixed"
        self.fraction = 1.0 if critical == "auto" else float(critical)

    def count(self, nblocks: int) -> int:
        frac = 1.0 if self.phase in ("warmup", "bsp") else self.fraction
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

    def update(self, bytes_total: float, bandwidth: float, backward: float, iteration: float) -> None:
        """Feed one step's measurements (already identical on every rank): a bandwidth sample (0: none),
        this step's backward window and the previous iteration's time."""
        self.steps += 1
        if self.critical != "auto" or self.phase == "settled":
            return
        if bandwidth > 0:  # a warmup step's, a step late: the last one's is kept (the first may
            self.bw = bandwidth  # include connection setup)
        # the iteration of the step before arrives with this one: count it for the trial it ran in
        if self._counts_for is not None and iteration > 0:
            self.iterations[self._counts_for].append(iteration)
        # this step counts for its trial, unless it is a deferring trial's first (it waited for no
        # stage 2 of its own share) or the step after the trials
        self._in_phase += 1
        counted = self.phase in self.TRIALS and not (self.phase != "bsp" and self._in_phase == 1)
        self._counts_for = self.phase if counted else None
        done = self._in_phase
        if self.phase == "warmup":
            if self.steps >= self.warmup:
                self._enter("bsp")
            return
        if self.phase == "bsp":
            if backward > 0:
                self.backward.append(backward)
            if done >= self.probe:
                self._model(bytes_total)
            return
        if self.phase == "model" and done >= self.probe:
            small = max(self.min_critical, self.model / 4)
            if small < self.model:
                self.shares["small"] = self.fraction = small
                self._enter("small")
                return
            self._enter("deciding")
            return
        if self.phase == "small" and done >= self.probe:
            self._enter("deciding")
            return
        if self.phase == "deciding":  # the last trial step's iteration just arrived
            self._settle()

    def _model(self, bytes_total: float) -> None:
        allreduce = bytes_total / self.bw if self.bw else 0.0
        window = statistics.median(self.backward) if self.backward else 0.0
        share = self.HEADROOM * window / allreduce if allreduce > 0 else 1.0
        self.model = min(1.0, max(self.min_critical, share))
        if self.model >= 1.0:
            self.fraction, self.phase = 1.0, "settled"
        else:
            self.shares["model"] = self.fraction = self.model
            self._enter("model")

    def _enter(self, phase: str) -> None:
        self.phase, self._in_phase = phase, 0

    def _settle(self) -> None:
        """The largest share whose iterations no smaller share beats by ``MARGIN``."""
        med = {k: statistics.median(v) for k, v in self.iterations.items() if v and k in self.shares}
        if "bsp" not in med:  # no fully critical iteration was counted (a resume loses the last step's
            self.fraction = 1.0  # timing, and the probe is short): measure it again before comparing
            self._enter("bsp")
            return
        best = "bsp"
        for k in ("model", "small"):  # ever smaller shares
            if k in med and med[k] < (1.0 - self.MARGIN) * med[best]:
                best = k
        self.fraction, self.phase = self.shares[best], "settled"

    def state_dict(self):
        return {"steps": self.steps, "bw": self.bw, "fraction": self.fraction, "phase": self.phase,
                "model": self.model, "backward": list(self.backward), "shares": dict(self.shares),
                "iterations": {k: list(v) for k, v in self.iterations.items()},
                "counts_for": self._counts_for, "in_phase": self._in_phase}

    def load_state_dict(self, d):
        if "shares" not in d:  # saved by an osp before these phases: measure again
            return
        self.steps, self.bw, self.fraction, self.phase = d["steps"], d["bw"], d["fraction"], d["phase"]
        self.model, self.backward, self.shares = d["model"], list(d["backward"]), dict(d["shares"])
        self.iterations = {k: list(v) for k, v in d["iterations"].items()}
        self._counts_for, self._in_phase = d["counts_for"], d["in_phase"]
