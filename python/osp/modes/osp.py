"""OSP: two-stage synchronization with exact local-gradient correction (DESIGN.md, "OSP")."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from .. import ops, sidechannel
from ..comm import Handle
from ..correction import Snapshot, corrector_for, hyper, unhooked_step
from ..layout import EditProbe, FlatGroup, Workspace
from ..policy import Budget, select_critical
from .base import Context, Mode, Options, StepInput, check_share, edited_error

_MAX_BLOCK = 1 << 30


class OSP(Options):
    """Two-stage synchronization. Each step the ``critical`` share of gradient blocks (the most
    important by ``metric``) is averaged before the update; the rest is averaged in the background
    while the next forward/backward runs, moved meanwhile by this rank's own gradient and corrected
    exactly when the average arrives (LGP).

    Args:
        critical: share of blocks averaged in stage 1, in [0, 1], or ``"auto"``: defer as much as the
            measured bandwidth can move in the measured time stage 2 has before the next step waits
            for it (the next forward/backward and the rest of this step). ``1.0`` is BSP.
        min_critical: floor on the critical share (the most important blocks always go first);
            default 0.05 with ``"auto"``, none with a fixed share.
        metric: block importance, ``"l2"``, ``"l1"``, ``"max"`` or ``"relative"`` (|g| / |w|).
        block_size: elements per block.
        warmup: with ``"auto"``, steps run fully critical first to measure the network.
    """

    name = "osp"

    def __init__(self, critical=0.25, min_critical: Optional[float] = None, metric: str = "l2",
                 block_size: int = 4096, warmup: int = 2):
        if critical != "auto":
            if isinstance(critical, bool) or not isinstance(critical, (int, float)) or not (
                    0.0 <= float(critical) <= 1.0):
                raise ValueError(f"osp: OSP(critical) must be a number in [0, 1] or 'auto', got {critical!r}")
            critical = float(critical)
        self.critical = critical
        if min_critical is None:  # a floor for "auto"; a fixed share is taken as given
            min_critical = 0.05 if critical == "auto" else 0.0
        self.min_critical = check_share("OSP", "min_critical", min_critical)
        if metric not in ops.METRICS:
            raise ValueError(f"osp: OSP(metric) must be one of {sorted(ops.METRICS)}, got {metric!r}")
        self.metric = metric
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= _MAX_BLOCK:
            raise ValueError(f"osp: OSP(block_size) must be an integer in [1, 2**30], got {block_size!r}")
        self.block_size = block_size
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"osp: OSP(warmup) must be a non-negative integer, got {warmup!r}")
        self.warmup = warmup

    def __repr__(self):
        return (f"OSP(critical={self.critical!r}, min_critical={self.min_critical:g}, "
                f"metric={self.metric!r}, block_size={self.block_size}, warmup={self.warmup})")

    def build(self, ctx: Context) -> "OSPMode":
        return OSPMode(self, ctx)


@dataclass
class _Split:
    """One flat group's share of a step: its critical blocks (stage 1) and deferred ones (stage 2)."""
    fg: FlatGroup
    lo: int  # its first block in the score vector
    mask: torch.Tensor  # its critical blocks
    ncrit: int
    crit: torch.Tensor  # packed critical gradient, averaged by stage 1
    deferred: torch.Tensor  # packed deferred gradient (this rank's), averaged by stage 2
    handle: Optional[Handle] = None  # stage 1 in flight


@dataclass
class _Deferred:
    """Stage 2 of one flat group in flight, and what its exact update needs."""
    snap: Snapshot
    lo: int
    handle: Optional[Handle]  # None: no deferred block in this group (it is here for clipping)
    avg: torch.Tensor  # the deferred blocks, packed: averaged in place by ``handle``
    mask: torch.Tensor  # the group's critical blocks of that step
    absent: set  # its parameters without a gradient on any rank that step: left alone
    full: Optional[torch.Tensor] = None  # with clipping: the whole gradient (critical blocks averaged)


@dataclass
class _Clip:
    """Clipping by the norm of the averaged gradient, pending on stage 2: the step's update is redone
    for every block once the deferred part of the norm is known."""
    max_norm: float
    crit_sq: torch.Tensor  # squared norm of the averaged critical blocks (identical on every rank)


class OSPMode(Mode):
    options: OSP

    def __init__(self, options: OSP, ctx: Context):
        super().__init__(options, ctx)
        self.budget = self._new_budget()
        self._size = ctx.comm.size  # the world the budget measures in
        self.corrector = corrector_for(ctx.optimizer)
        dev = ctx.device
        self.nblocks = ctx.nblocks
        self._side = torch.zeros(len(sidechannel.FIELDS) + ctx.nparams, dtype=torch.float32, device=dev)
        self._side_own = torch.zeros_like(self._side)
        self._mask = torch.ones(self.nblocks, dtype=torch.bool, device=dev)
        self._checksum = sidechannel.MaskChecksum(self.nblocks, dev)
        self._ws: Dict[int, Workspace] = {id(fg): Workspace(fg) for fg in ctx.groups}
        self._none = [torch.zeros(fg.nblocks, dtype=torch.bool, device=dev) for fg in ctx.groups]
        self._probe = EditProbe(ctx.groups)
        self.scores: Optional[torch.Tensor] = None  # block scores of the last averaged gradient
        self._pending: List[_Deferred] = []
        self._clip: Optional[_Clip] = None
        self._steps = 0

    @property
    def in_flight(self):
        return bool(self._pending)

    def _new_budget(self) -> Budget:
        return Budget(self.options.critical, self.options.min_critical, warmup=self.options.warmup)

    # -- the split ------------------------------------------------------------------------------
    def _select(self) -> List[int]:
        """Fill ``self._mask`` with this step's critical blocks and return how many each flat group
        has. The split comes from the block scores of the previous step's averaged gradient, which
        every rank holds bitwise alike (no collective; the first step is fully critical). Each flat
        group gets its own quota, so the counts are known on the host without a device sync. With
        ``critical=0.0`` every step, the first too, defers everything (``DSync(delay=1)``)."""
        counts = [self.budget.count(fg.nblocks) for fg in self.ctx.groups]
        if self.scores is None:  # nothing to rank by yet: all critical, unless none is to be
            defer_all = not any(counts)
            self._mask.fill_(not defer_all)
            return counts if defer_all else [fg.nblocks for fg in self.ctx.groups]
        lo = 0
        for fg, k in zip(self.ctx.groups, counts):
            self._mask[lo:lo + fg.nblocks] = select_critical(self.scores[lo:lo + fg.nblocks], k)
            lo += fg.nblocks
        return counts

    def _set_scores(self, buf: torch.Tensor, fg: FlatGroup, mask: torch.Tensor, lo: int) -> None:
        """Score the blocks packed in ``buf`` (those where ``mask`` is set) and store them in their
        places of the score vector (a merge with one-element blocks: no device sync). With
        ``relative``, |w| is read from the parameters as they are now, which must be bitwise equal on
        every rank: call only where the replicas are."""
        w = None
        if self.options.metric == "relative":
            w = torch.empty_like(buf)
            ops.split_blocks(fg.param, mask, fg.block_size, w, None)
        scores = ops.score_blocks(buf, fg.block_size, self.options.metric, param=w)[0]
        ops.merge_blocks(scores, None, mask, 1, self.scores[lo:lo + fg.nblocks])

    # -- the step -------------------------------------------------------------------------------
    def step(self, inp: StepInput):
        ctx = self.ctx
        for fg in ctx.groups:
            fg.gather_grads()
        ctx.scale_grads(inp.unscale)
        # parameters changed since the last step where a correction is pending: refused on every rank
        # (after the corrections, so the ranks stay equal), as the correction overwrites such a change
        edited = self._probe.edited(self._deferred_masks())
        wait_s = self._finish_deferred()
        ctx.on_synced()
        counts = self._select()
        splits, lo = [], 0
        for fg, kc in zip(ctx.groups, counts):
            ws = self._ws[id(fg)]
            s = _Split(fg=fg, lo=lo, mask=self._mask[lo:lo + fg.nblocks], ncrit=kc,
                       crit=ws("crit", kc * fg.block_size),
                       deferred=ws("deferred", (fg.nblocks - kc) * fg.block_size))
            ops.split_blocks(fg.grad, s.mask, fg.block_size, s.crit, s.deferred)
            splits.append(s)
            lo += fg.nblocks
        deferring = any(s.deferred.numel() for s in splits)
        clip = inp.max_norm is not None
        # the time stage 2 had to hide in: from its launch to this step's wait for it (the compute
        # between steps plus the rest of the previous step); before any stage 2, the compute alone
        window = self.budget.window if self.budget.window is not None else inp.compute_s
        sidechannel.encode(self._side, ctx.nonfinite(), self.budget.bw_sample, window, wait_s,
                           self._checksum(self._mask),
                           ctx.sq_norm([s.deferred for s in splits]) if clip and deferring else 0.0, edited)
        ctx.presence(self._side[len(sidechannel.FIELDS):])
        self._side_own.copy_(self._side)
        # stage 1: the side channel and the critical blocks, averaged before the update
        t1 = time.perf_counter()
        side_h = ctx.comm.allreduce_sum_async_(self._side, f"{ctx.prefix}.side")
        for gi, s in enumerate(splits):
            s.handle = ctx.comm.allreduce_avg_async_(s.crit, f"{ctx.prefix}.s1.{gi}")
        b1 = b2 = 0
        for s in splits:
            ctx.comm.wait(s.handle, ctx.timeout, "stage-1 allreduce")
            b1 += s.crit.numel() * s.crit.element_size()
        ctx.comm.wait(side_h, ctx.timeout, "stage-1 allreduce")
        stage1 = time.perf_counter() - t1
        self._steps += 1
        side = sidechannel.decode(self._side, self._side_own, ctx.comm.size, self._steps)
        if side.edited:
            raise edited_error("OSP")
        rec = {"stage2_wait_s": wait_s, "stage1_s": stage1}
        if side.nonfinite:
            rec.update(critical_fraction=0.0, bytes_stage1=b1, bytes_stage2=0, skipped=True, overflow=True)
            return rec
        absent = ctx.absent_everywhere(side.presence)
        self.budget.update(ctx.nbytes, side.bandwidth, side.window, side.wait)
        if self.scores is None:
            self.scores = torch.zeros(self.nblocks, dtype=torch.float32, device=self._mask.device)
        for s in splits:
            ops.merge_blocks(s.crit, None, s.mask, s.fg.block_size, s.fg.grad)
            self._set_scores(s.crit, s.fg, s.mask, s.lo)
        coef = None
        if clip:
            crit_sq = ctx.sq_norm([s.crit for s in splits])
            # the provisional factor: the deferred part of the norm is estimated by the mean of the
            # ranks' own deferred norms; the exact factor is applied when stage 2 lands
            coef = ctx.clip_coef(inp.max_norm, crit_sq + side.deferred_sq)
            self._clip = _Clip(inp.max_norm, crit_sq) if deferring else None
        # stage 2: deferred blocks, averaged in the background; snapshot what their exact update needs
        for gi, (s, a) in enumerate(zip(splits, absent)):
            if s.deferred.numel() == 0 and not (clip and deferring):
                continue
            b2 += s.deferred.numel() * s.deferred.element_size()
            group = ctx.optimizer.param_groups[s.fg.group_index]
            if clip:  # the whole step is redone once the norm is known
                snap = self.corrector.snapshot(s.fg, self._none[gi], s.fg.padded, hyper(group))
                full = self._ws[id(s.fg)]("full").copy_(s.fg.grad)
            else:
                snap, full = self.corrector.snapshot(s.fg, s.mask, s.deferred.numel(), hyper(group)), None
            h = ctx.comm.allreduce_avg_async_(s.deferred, f"{ctx.prefix}.s2.{gi}") if s.deferred.numel() else None
            self._pending.append(_Deferred(snap=snap, lo=s.lo, handle=h, avg=s.deferred, mask=s.mask.clone(),
                                           absent=a, full=full))
            self.budget.stage2_launched()
        # LGP: the local update with the provisional gradient (averaged on critical blocks, this
        # rank's own on deferred ones); parameters without a gradient on any rank are left alone
        ctx.scale_grads(coef)
        for fg, a in zip(ctx.groups, absent):
            fg.set_grads(a)
        unhooked_step(ctx.optimizer)
        self.corrector.adopt(ctx.groups)
        if self._pending:
            self._probe.record()
        self.budget.stage1_done(b1, stage1, ctx.nbytes)
        rec.update(critical_fraction=b1 / max(ctx.nbytes, 1), bytes_stage1=b1, bytes_stage2=b2, overflow=False)
        return rec

    def _deferred_masks(self) -> List[Optional[torch.Tensor]]:
        """Per flat group, the blocks its pending correction rewrites (a change elsewhere is kept: those
        blocks are exact already); None where nothing is pending. With clipping every block is redone."""
        by_group = {id(d.snap.fg): d.mask for d in self._pending}
        out = []
        for fg in self.ctx.groups:
            m = by_group.get(id(fg))
            out.append(None if m is None else torch.ones_like(m) if self._clip is not None else ~m)
        return out

    def _finish_deferred(self) -> float:
        """Wait for the previous step's stage 2 and replace the provisional update of its deferred
        blocks by the exact one. Afterwards every rank holds bitwise the same parameters and state."""
        self._probe.clear()
        if not self._pending:
            return 0.0
        t0 = time.perf_counter()
        self.budget.stage2_awaited()
        for d in self._pending:
            if d.handle is not None:
                self.ctx.comm.wait(d.handle, self.ctx.timeout, "stage-2 allreduce")
        wait = time.perf_counter() - t0
        items = [(d.snap, d.avg) for d in self._pending]
        if self._clip is not None:  # the exact factor, from the whole averaged gradient's norm
            sq = self._clip.crit_sq + self.ctx.sq_norm([d.avg for d in self._pending])
            coef = self.ctx.clip_coef(self._clip.max_norm, sq)
            for d in self._pending:
                ops.merge_blocks(None, d.avg, d.mask, d.snap.fg.block_size, d.full)
                d.full.mul_(coef)
            items = [(d.snap, d.full) for d in self._pending]
        held = [self.corrector.hold(d.snap.fg, d.absent) for d in self._pending if d.absent]
        self.corrector.correct(items)
        self.corrector.restore(held)
        # scored after the corrections: with "relative", |w| must be the exact (shared) parameters,
        # not this rank's provisional ones, or ranks would pick different blocks next step
        for d in self._pending:
            self._set_scores(d.avg, d.snap.fg, ~d.mask, d.lo)
        self._pending = []
        self._clip = None
        return wait

    def flush(self):
        edited = self._probe.edited(self._deferred_masks()) if self._pending else None
        self._finish_deferred()
        if self.ctx.any_edited(edited, "osp"):
            raise edited_error("OSP")
        self.ctx.on_synced()

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self):
        # the next split is chosen from the scores: needed to resume bitwise; the budget's figures hold
        # for the world size they were measured in
        return {"budget": self.budget.state_dict(), "size": self._size,
                "scores": None if self.scores is None else self.scores.detach().cpu().clone()}

    def load_state_dict(self, state):
        if "budget" not in state:
            return
        if state.get("size", self._size) == self._size:
            self.budget.load_state_dict(state["budget"])
        else:  # measured in a world of another size: measure again
            self.budget = self._new_budget()
        scores = state.get("scores")
        if scores is not None and scores.numel() != self.nblocks:
            raise ValueError(f"osp: the checkpoint's scores cover {scores.numel()} blocks, this "
                             f"optimizer has {self.nblocks} (another model or block_size?)")
        self.scores = None if scores is None else scores.to(self.ctx.device)

    def after_load(self):
        self.corrector.adopt(self.ctx.groups)
