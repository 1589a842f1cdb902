"""How OSP picks the critical blocks: the budget (a fixed ratio, or "auto"), the selection, and each step's split."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import ops


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

    def wants_sample(self) -> bool:
        """Whether this step's stage 1 (run at ``step()``) is a bandwidth sample: in warmup."""
        return self.phase == "warmup"

    def stage1_sample(self, nbytes: int, seconds: float, total_bytes: int) -> float:
        """The bandwidth sample of a stage 1 that ``wants_sample()`` (0: none)."""
        if seconds > 0 and nbytes >= self.MIN_SAMPLE * total_bytes:
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


@dataclass
class Plan:
    """The split of one step, known before its backward (from the scores of earlier averaged
    gradients): the critical blocks, how many each bucket has, and where each bucket's blocks go in its
    flat group's packed buffers (which keep block order, as ``split_blocks`` of the whole group would)."""
    mask: torch.Tensor
    counts: List[int]  # per bucket: critical blocks
    crit_at: List[int]  # per bucket: its first critical block's index in the group's packed stage 1
    deferred_at: List[int]  # per bucket: likewise in the packed stage 2
    ncrit: List[int]  # per flat group: critical blocks
    positions: Optional[torch.Tensor] = None  # ops.mask_positions(mask), once per plan (kernels take slices)


class Split:
    """OSP's choice of the critical blocks, step by step: the budget (how many), the block scores of the
    last averaged gradients (which: every rank holds them bitwise alike, so no collective decides),
    and the coming step's ``Plan``, per bucket of ``buckets`` (``Buckets.buckets``: flat group and
    element range). ``size``: the world the budget measures in."""

    def __init__(self, options, groups, buckets, size: int):
        self.options, self.groups, self.size = options, groups, size
        self.budget = self._new_budget()
        self.nblocks = sum(fg.nblocks for fg in groups)
        self.scores: Optional[torch.Tensor] = None
        # the buckets, as block ranges of their flat group (the blocks that start in the bucket's
        # elements: a block reaching into the next bucket up is ready, as that bucket started earlier)
        gindex = {id(fg): gi for gi, fg in enumerate(groups)}
        self.geo = [(gindex[id(fg)], -(-lo // fg.block_size), -(-hi // fg.block_size)) for fg, lo, hi, _ in buckets]
        self.group_lo, lo = [], 0  # each flat group's first block in the score vector
        for fg in groups:
            self.group_lo.append(lo)
            lo += fg.nblocks
        self._plan: Optional[Plan] = None

    def _new_budget(self) -> Budget:
        return Budget(self.options.critical, self.options.min_critical, warmup=self.options.warmup)

    def plan(self) -> Plan:
        """The coming step's plan (made on first use)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def forget_plan(self) -> None:
        self._plan = None

    def group_mask(self, gi: int) -> torch.Tensor:
        lo = self.group_lo[gi]
        return self.plan().mask[lo:lo + self.groups[gi].nblocks]

    def group_positions(self, gi: int) -> torch.Tensor:
        """``group_mask(gi)``'s positions (a slice of the plan's: the kernels count from its first entry)."""
        lo = self.group_lo[gi]
        return self.plan().positions[lo:lo + self.groups[gi].nblocks]

    def _make_plan(self) -> Plan:
        """The coming step's critical blocks: per bucket the ``budget.count`` best by the scores of the
        last averaged gradients (until there are scores, every block is critical, unless none is to be).
        Each bucket gets its own quota, so every count is known on the host without a device sync. With
        ``critical=0.0`` every step, the first too, defers everything (``DSync(delay=1)``)."""
        counts = self._quotas()
        mask = torch.ones(self.nblocks, dtype=torch.bool, device=self.groups[0].device)
        if self.scores is None:
            if not any(counts):
                mask.fill_(False)
            else:
                counts = [b1 - b0 for _, b0, b1 in self.geo]
        else:
            for (gi, b0, b1), k in zip(self.geo, counts):
                if k < b1 - b0:
                    lo = self.group_lo[gi]
                    mask[lo + b0:lo + b1] = select_critical(self.scores[lo + b0:lo + b1], k)
        crit_at, deferred_at = [0] * len(self.geo), [0] * len(self.geo)
        ncrit = [0] * len(self.groups)
        ndef = [0] * len(self.groups)
        for b in sorted(range(len(self.geo)), key=lambda b: self.geo[b][1:]):  # block order
            gi, b0, b1 = self.geo[b]
            crit_at[b], deferred_at[b] = ncrit[gi], ndef[gi]
            ncrit[gi] += counts[b]
            ndef[gi] += b1 - b0 - counts[b]
        return Plan(mask=mask, counts=counts, crit_at=crit_at, deferred_at=deferred_at, ncrit=ncrit,
                    positions=ops.mask_positions(mask))

    def _quotas(self) -> List[int]:
        """Critical blocks per bucket. The bucket ready last (the first layers, at the very end of
        backward) can only send its critical blocks after backward, where the step waits for them: it
        keeps only the ``min_critical`` floor, and the blocks it gives up go to the buckets ready
        earlier (by size, those ready first first), whose averages run while backward still computes.
        The total is what the budget's share gives every bucket alike."""
        sizes = [b1 - b0 for _, b0, b1 in self.geo]
        counts = [self.budget.count(n) for n in sizes]
        if len(sizes) < 2 or not sum(sizes[:-1]):
            return counts
        last = len(sizes) - 1
        floor = min(counts[last], math.ceil(self.options.min_critical * sizes[last]))
        extra = given = counts[last] - floor
        counts[last] = floor
        earlier = sum(sizes[:last])
        for rounding in (True, False):  # by size, then whatever rounding left over
            for b in range(last):
                if extra <= 0:
                    break
                add = min(sizes[b] - counts[b], extra, -(-given * sizes[b] // earlier) if rounding else extra)
                counts[b] += add
                extra -= add
        counts[last] += extra  # no room ready earlier: it stays with the last bucket
        return counts

    def score(self, buf: torch.Tensor, fg, mask: torch.Tensor, lo: int) -> None:
        """Score the blocks packed in ``buf`` (those where ``mask`` is set) and store them in their
        places of the score vector (from block ``lo``; a merge with one-element blocks: no device sync).
        With ``relative``, |w| is read from the parameters as they are now, which must be bitwise equal
        on every rank: call only where the replicas are."""
        if self.scores is None:
            self.scores = torch.zeros(self.nblocks, dtype=torch.float32, device=mask.device)
        w = None
        if self.options.metric == "relative":
            w = torch.empty_like(buf)
            ops.split_blocks(fg.param, mask, fg.block_size, w, None)
        scores = ops.score_blocks(buf, fg.block_size, self.options.metric, param=w)[0]
        ops.merge_blocks(scores, None, mask, 1, self.scores[lo:lo + fg.nblocks])

    def state_dict(self) -> dict:
        # the next split is chosen from the scores: needed to resume bitwise; the budget's figures hold
        # for the world size they were measured in
        return {"budget": self.budget.state_dict(), "size": self.size,
                "scores": None if self.scores is None else self.scores.detach().cpu().clone()}

    def load_state_dict(self, state: dict, device) -> None:
        if state.get("size", self.size) == self.size:
            self.budget.load_state_dict(state["budget"])
        else:  # measured in a world of another size: measure again
            self.budget = self._new_budget()
        scores = state.get("scores")
        if scores is not None and scores.numel() != self.nblocks:
            raise ValueError(f"osp: the checkpoint's scores cover {scores.numel()} blocks, this "
                             f"optimizer has {self.nblocks} (another model or block_size?)")
        self.scores = None if scores is None else scores.to(device)
        self._plan = None
