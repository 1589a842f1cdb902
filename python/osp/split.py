"""Which blocks OSP sends in stage 1, step by step: the selection by score (``select_critical``), and each step's
``Plan`` of the critical and deferred blocks per bucket, made by ``Split`` from the budget (``osp.policy``) and
the scores of the last averaged gradients."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

from . import ops
from .policy import Budget
from .warn import warn


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
        self._warn_if_nothing_deferred()

    def _warn_if_nothing_deferred(self) -> None:
        """A fixed share below 1 whose per-bucket rounding up keeps every block critical (a model of fewer blocks
        than its buckets need: ``ceil(share x blocks)`` of one block is that block) runs BSP's steps: warned once
        here, naming the blocks and the block size, rather than found in ``stats()``'s critical_fraction 1.0."""
        share = self.options.critical
        if share == "auto" or share >= 1.0 or sum(self._quotas()) < self.nblocks:
            return
        sizes = [b1 - b0 for _, b0, b1 in self.geo]
        need = math.floor(1.0 / (1.0 - share)) + 1  # blocks a bucket needs for ceil(share x blocks) to leave one
        warn(f"osp: {self.options!r} defers nothing here: the gradients make {self.nblocks} block(s) (block_size="
             f"{self.options.block_size}) in {len(sizes)} bucket(s) (at most {max(sizes)} in one), and "
             f"ceil({share:g} x a bucket's blocks) keeps every block critical, so every step is BSP's. Pass a "
             f"smaller block_size (a bucket needs {need} blocks or more for one to be deferred)")

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
