"""OSP: two-stage synchronization with exact local-gradient correction (docs/design.md, "OSP")."""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .. import ops
from ..agreement import Agreement, any_rank
from ..buckets import Buckets
from ..comm import Handle
from ..compression import Compressor, fits, resolve, wire_dtype
from ..correction import Snapshot, corrector_for, hyper, unhooked_step
from ..layout import EditProbe, Workspace
from ..meter import Meter
from ..split import Plan, Split
from ..timing import span, traced
from .base import Context, Mode, Options, StepInput, check_positive, check_share, edited_error, warn_grad_edits
from .bsp import BSP, BSPMode

_MAX_BLOCK = 1 << 30


class OSP(Options):
    """Two-stage synchronization. Each step the ``critical`` share of gradient blocks (the most
    important by ``metric``) is averaged before the update; the rest is averaged in the background
    while the next forward/backward runs, moved meanwhile by this rank's own gradient and corrected
    exactly when the average arrives (LGP).

    Args:
        critical: share of blocks averaged in stage 1, in [0, 1], or ``"auto"`` (the default, the choice the
            docs advise): run BSP's code while measuring the step (when each bucket is ready, the link's achieved
            rate, the step's own work), then every step choose the share of ``osp.stepmodel.GRID`` whose step the
            model predicts shortest (the model ``osp.plan`` predicts with), leaving the current share only for a
            gain above the measured noise, checking a new share against the old by measured steps, and deciding
            again when the link or the compute changes. On a fast link it stays on BSP's code. A fixed share,
            e.g. ``0.25``, averages that share first and defers the rest whatever the link; ``1.0`` is BSP.
        min_critical: floor on the critical share (the most important blocks always go first);
            default 0.05 with ``"auto"``, none with a fixed share.
        metric: block importance, ``"l2"``, ``"l1"``, ``"max"`` or ``"relative"`` (|g| / |w|).
        block_size: elements per block.
        warmup: with ``"auto"``, steps of BSP's code before the first decision (the figures of at least one
            step with a known start are needed; with 2 the first decision comes by step 3).
        stage2_compression: what the deferred blocks travel as (``osp.Compression.fp16`` / ``bf16`` / ``none``,
            or Horovod's); None: as the optimizer's ``compression=``. The critical blocks always keep the
            optimizer's: importance-aware precision on the wire.
        bucket_mb: stage 1 starts during backward in buckets of about this many MiB of gradient (as
            BSP's and DDP's do): each bucket's critical blocks are averaged as soon as its gradients
            are ready.
    """

    name = "osp"

    def __init__(self, critical="auto", min_critical: Optional[float] = None, metric: str = "l2",
                 block_size: int = 4096, warmup: int = 2, bucket_mb: float = 25.0, stage2_compression=None):
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
        self.bucket_mb = check_positive("OSP", "bucket_mb", bucket_mb)
        self.stage2_compression: Optional[Compressor] = (None if stage2_compression is None
                                                         else resolve(stage2_compression))

    def __repr__(self):
        s2 = "" if self.stage2_compression is None else f", stage2_compression={self.stage2_compression!r}"
        return (f"OSP(critical={self.critical!r}, min_critical={self.min_critical:g}, "
                f"metric={self.metric!r}, block_size={self.block_size}, warmup={self.warmup}, "
                f"bucket_mb={self.bucket_mb:g}{s2})")

    def build(self, ctx: Context) -> "OSPMode":
        return OSPMode(self, ctx)


@dataclass
class _Stage1:
    """Stage 1 of the step being taken: its averages in flight and their timing."""
    stale: bool  # a gradient changed after backward packed it (here)
    scaled: bool  # buckets packed in backward hold the gradients scaled (GradScaler): unscale them
    handles: List[Handle] = field(default_factory=list)
    t0: float = 0.0  # when stage 1 became the step's wait (its launch at step(), less the corrections)


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
    ndeferred: int = 0  # blocks in ``avg`` (known on the host: checks the kernels' buffers without a sync)
    positions: Optional[torch.Tensor] = None  # ``mask``'s (ops.mask_positions), from the plan


class Deferral:
    """OSP's stage 2: the last step's deferred blocks in flight, and their exact correction. ``snapshot`` keeps
    what each group's exact update needs before the local update moves the blocks provisionally; ``wait`` lets
    the averages land; ``correct`` replaces the provisional update by the exact one (the corrector redoes it from
    the snapshot with the averaged gradient), after which every rank holds bitwise the same parameters and
    state. ``masks`` says which blocks a pending correction will rewrite (the edit probe's business)."""

    def __init__(self, ctx: Context, corrector, split: Split, comm2, probe: EditProbe, ws: Dict[int, Workspace],
                 none: List[torch.Tensor]):
        self.ctx, self.corrector, self.split, self.comm2, self.probe = ctx, corrector, split, comm2, probe
        self._ws, self._none = ws, none
        # per bucket, its parameters with an element in its blocks (a block may reach into the next bucket's)
        self._bucket_params = [[i for i, (s0, s1) in enumerate(ctx.groups[gi].block_span) if s0 < b1 and s1 >= b0]
                               for gi, b0, b1 in split.geo]
        self._none_pos = [ops.mask_positions(m) for m in none]
        self.pending: List[_Deferred] = []
        # clipping of the averaged gradient, pending on stage 2: the step's update is redone for every block
        # (of every group) once the deferred part is known (by norm: the factor needs all of it)
        self.clip = None  # the step's Clip

    def snapshot(self, launch2, deferreds, h2, absent, clip: bool, plan: Plan) -> None:
        """What the exact update of each group in stage 2 needs, taken before the local update."""
        ctx = self.ctx
        for gi in launch2:
            fg = ctx.groups[gi]
            group = ctx.optimizer.param_groups[fg.group_index]
            mask = self.split.group_mask(gi)
            if clip:  # the whole step is redone once the norm is known
                snap = self.corrector.snapshot(fg, self._none[gi], fg.padded, hyper(group),
                                               positions=self._none_pos[gi])
                full = self._ws[id(fg)]("full").copy_(fg.grad)
            else:
                snap = self.corrector.snapshot(fg, mask, deferreds[gi].numel(), hyper(group),
                                               params=self._params(gi, plan),
                                               positions=self.split.group_positions(gi))
                full = None
            self.pending.append(_Deferred(snap=snap, lo=self.split.group_lo[gi], handle=h2.get(gi),
                                           avg=deferreds[gi], mask=mask, absent=absent[gi], full=full,
                                           positions=self.split.group_positions(gi),
                                           ndeferred=fg.nblocks - plan.ncrit[gi]))

    def _params(self, gi: int, plan: Plan) -> List[int]:
        """Flat group ``gi``'s parameters with an element in a block ``plan`` defers, known on the host from
        its counts per bucket (a superset: the buckets' parameters), so no correction reads the mask."""
        out = set()
        for b, (g, b0, b1) in enumerate(self.split.geo):
            if g == gi and plan.counts[b] < b1 - b0:
                out.update(self._bucket_params[b])
        return sorted(out)

    def masks(self) -> List[Optional[torch.Tensor]]:
        """Per flat group, the blocks its pending correction rewrites (a change elsewhere is kept: those
        blocks are exact already); None where nothing is pending. With clipping every block is redone."""
        by_group = {id(d.snap.fg): d.mask for d in self.pending}
        out = []
        for fg in self.ctx.groups:
            m = by_group.get(id(fg))
            out.append(None if m is None else torch.ones_like(m) if self.clip is not None else ~m)
        return out

    @traced("osp.stage2.wait")
    def wait(self) -> float:
        """Wait for the previous step's stage 2 (the averages land in place); returns the wait."""
        self.probe.clear()
        t0 = time.perf_counter()
        for d in self.pending:
            if d.handle is not None:
                self.comm2.wait(d.handle, self.ctx.timeout, "stage-2 allreduce")
                d.avg.div_(self.ctx.comm.size)
                d.handle = None  # landed and divided
        return time.perf_counter() - t0 if self.pending else 0.0

    @traced("osp.correction")
    def correct(self, step: int) -> None:
        """Replace the provisional update of the previous step's deferred blocks (their averages
        landed) by the exact one. Afterwards every rank holds bitwise the same parameters and state."""
        if not self.pending:
            return
        if self.ctx.any_nonfinite([d.avg for d in self.pending]):
            # each rank's deferred gradient was finite, their sum is not (float16): identical on every rank.
            # The step's critical blocks are applied already, so it cannot be skipped: put the deferred
            # blocks back as they were before it (replicas stay equal) and stop on every rank alike
            self.corrector.restore([d.snap for d in self.pending])
            self.pending, self.clip = [], None
            raise FloatingPointError(
                f"osp: OSP's averaged deferred gradient of step {step} is not finite on every rank, though "
                "each rank's own gradient was (their sum overflowed, e.g. float16 gradients); its critical blocks "
                "are applied and its deferred blocks are left as before that step. Use float32 or bfloat16 "
                "parameters, scale the loss down, or osp.BSP() / osp.DSync(), which skip such a step whole")
        items = [(d.snap, d.avg) for d in self.pending]
        if self.clip is not None:  # the exact factor, from the whole averaged gradient (every group's)
            for d in self.pending:
                ops.merge_blocks(None, d.avg, d.mask, d.snap.fg.block_size, d.full, d.ndeferred,
                                 positions=d.positions)
            self.ctx.clip_(self.clip, [d.full for d in self.pending], [d.absent for d in self.pending])
            items = [(d.snap, d.full) for d in self.pending]
        for d in self.pending:
            d.snap.absent = d.absent
        self.corrector.correct(items)
        # scored after the corrections: with "relative", |w| must be the exact (shared) parameters,
        # not this rank's provisional ones, or ranks would pick different blocks next step
        for d in self.pending:
            self.split.score(d.avg, d.snap.fg, ~d.mask, d.lo)
        self.pending = []
        self.clip = None

    def flush(self, step: int) -> float:
        """Finish stage 2 exactly (an edit since the last step raises on every rank); returns the wait."""
        edited = self.probe.edited(self.masks()) if self.pending else None
        wait = self.wait()
        self.correct(step)
        if any_rank(self.ctx, edited, "osp.edited"):
            raise edited_error("OSP")
        self.ctx.on_synced()
        return wait


class OSPMode(Mode):
    """Stage 1 starts from the backward hooks: when a bucket's gradients are ready its blocks are packed,
    the critical ones into the stage-1 buffer, whose part is averaged at once, the deferred ones into
    the stage-2 buffer, which ``step()`` averages in one piece as soon as the side channel says the step
    goes ahead. Two stage-2 buffers alternate: the next backward packs into one while the other is
    averaged."""

    options: OSP
    ready_unreached_early = True  # a bucket whose gradient changed after it was packed is packed again (_stale)

    def __init__(self, options: OSP, ctx: Context):
        super().__init__(options, ctx)
        self.corrector = corrector_for(ctx.optimizer)
        for gi in range(len(ctx.groups)):
            if self._wire2(gi) is not None:
                ctx.comm.check_dtype(self._wire2(gi), f"the wire of stage2_compression={options.stage2_compression!r}")
        # stage 2 on a communicator of its own: an engine that runs a communicator's collectives in issue
        # order (NCCL) must not queue the next step's stage-1 buckets behind this step's stage 2
        self.comm2 = ctx.comm.late(ctx.timeout, ctx.device)
        dev = ctx.device
        self.nblocks = ctx.nblocks
        # the side channel: what every rank must agree on before the step's update. On stage 2's communicator,
        # which is idle when it starts (the last stage 2 landed): on an in-order engine it would otherwise
        # queue behind this step's stage-1 buckets, and stage 2 could not start before all of stage 1 ended
        self.buckets = Buckets(ctx.groups, options.bucket_mb, ctx.comm, f"{ctx.prefix}.s1", start=self._start)
        # what auto decides by (and stats() reports): when each bucket is issued, the link's rate, the step's work
        self.meter = self.buckets.meter = Meter(len(self.buckets.buckets))
        self._bucket_bytes = [(hi - lo) * fg.grad.element_size() for fg, lo, hi, _ in self.buckets.buckets]
        self._side = Agreement(ctx, "side", fields=("nonfinite", "edited", "stale") + self.meter.fields,
                               mask_blocks=self.nblocks, comm=self.comm2)
        self._ws: Dict[int, Workspace] = {id(fg): Workspace(fg) for fg in ctx.groups}
        self._none = [torch.zeros(fg.nblocks, dtype=torch.bool, device=dev) for fg in ctx.groups]
        self._probe = EditProbe(ctx.groups)
        self._steps = 0
        # the buckets, as block ranges of their flat group (the blocks that start in the bucket's
        # elements: a block reaching into the next bucket up is ready, as that bucket started earlier)
        self.split = Split(options, ctx.groups, self.buckets.buckets, ctx.comm.size)
        self._cur = 0  # the stage-2 buffer this step's backward packs into
        self._packed: Dict[int, int] = {}  # bucket -> its gradients' versions when packed (their sum)
        self._held = False  # a sparse gradient came: nothing starts in backward until step() raises
        # per bucket, its parameters' gradient aliases: to tell whether one changed after packing
        self._views = [[fg.grad_views[fg.index[id(p)]] for p in ps] for fg, _, _, ps in self.buckets.buckets]
        self.stage2 = Deferral(ctx, self.corrector, self.split, self.comm2, self._probe, self._ws, self._none)
        # every block critical (critical=1.0, or "auto" at 1.0 for now): BSP's own machinery
        self._bsp: Optional[BSPMode] = None
        self._follow_budget()

    @property
    def in_flight(self):
        return bool(self.stage2.pending) or (self._bsp is not None and self._bsp.in_flight)

    @property
    def exact(self):
        return not self.stage2.pending

    @property
    def grad_is_average(self):
        return self._bsp is not None

    @property
    def may_defer(self):
        return self.split.budget.critical == "auto"  # on BSP's code now, deferring from any later step

    def _follow_budget(self) -> None:
        """Hand the steps to BSP once no block can be deferred any more (nothing is scored, split,
        packed or corrected then): in-backward BSP, as DDP does it, with ``.grad`` the average after
        backward. A stage 2 still in flight is finished first, by the next ``step()``."""
        if self.split.budget.needs_scores:
            self._bsp = None
        elif self._bsp is None:
            self._bsp = BSPMode(BSP(self.options.bucket_mb), self.ctx, meter=self.meter)

    def synchronize(self) -> None:  # while BSP has the steps (grad_is_average)
        self._bsp.synchronize()

    # -- stage 1 from the backward hooks ----------------------------------------------------------
    def _crit(self, gi: int) -> torch.Tensor:
        fg = self.ctx.groups[gi]
        return self._ws[id(fg)]("crit", self.split.plan().ncrit[gi] * fg.block_size)

    def _deferred(self, gi: int) -> torch.Tensor:
        fg = self.ctx.groups[gi]
        n = (fg.nblocks - self.split.plan().ncrit[gi]) * fg.block_size
        return self._ws[id(fg)](f"deferred{self._cur}", n)

    @traced("osp.stage1.bucket")
    def _start(self, b: int) -> Optional[Handle]:
        """Bucket ``b``'s gradients are gathered: pack its blocks and start averaging the critical ones."""
        plan, (gi, b0, b1) = self.split.plan(), self.split.geo[b]
        fg = self.ctx.groups[gi]
        bs, k, lo = fg.block_size, plan.counts[b], self.split.group_lo[gi]
        crit = self._crit(gi)[plan.crit_at[b] * bs:(plan.crit_at[b] + k) * bs]
        deferred = self._deferred(gi)[plan.deferred_at[b] * bs:(plan.deferred_at[b] + b1 - b0 - k) * bs]
        ops.split_blocks(fg.grad[b0 * bs:b1 * bs], plan.mask[lo + b0:lo + b1], bs, crit, deferred, b1 - b0 - k,
                         positions=plan.positions[lo + b0:lo + b1])
        self._packed[b] = self._grad_version(b)
        if not k:
            return None
        return self.ctx.comm.allreduce_avg_async_(crit, f"{self.ctx.prefix}.s1.{b}", wire=self.ctx.wire(fg))

    def _grad_version(self, b: int) -> int:
        return sum(v._version for v in self._views[b])

    def _stale(self) -> bool:
        """Whether a gradient changed after its bucket was packed (replaced, unscaled or clipped in
        place between backward and step): stage 1 and 2 must then be packed again from ``.grad``."""
        for b, version in self._packed.items():
            params = self.buckets.buckets[b][3]
            if any(p.grad is not None and p.grad is not v for p, v in zip(params, self._views[b])) \
                    or self._grad_version(b) != version:
                return True
        return False

    def on_ready(self, p):
        if p.grad is not None and p.grad.layout != torch.strided:
            self._held = True  # step() raises, naming the parameter; nothing more starts in backward
        if self._held:
            return
        if self._bsp is not None:
            return self._bsp.on_ready(p)
        self.buckets.on_ready(p)

    def end_backward(self):
        self.meter.backward_end()
        if self._held:
            return
        if self._bsp is not None:
            return self._bsp.end_backward()
        self.buckets.launch(force=True)  # the rest: a missing gradient counts as zeros

    def restart(self):
        self.meter.restart()
        if self._bsp is not None:
            return self._bsp.restart()
        self._drop_stage1()
        self._held = False

    def _drop_stage1(self) -> None:
        """Wait for this step's stage-1 averages started so far (every rank started them) and forget them."""
        self.buckets.wait(self.buckets.launched, self.ctx.timeout, "stage-1 allreduce")
        self.buckets.reset()
        self._packed = {}

    # -- the step -------------------------------------------------------------------------------
    def step(self, inp: StepInput):
        self.meter.entry()
        if self._bsp is not None:
            return self._bsp_step(inp)
        warn_grad_edits(self, inp.edited)
        ctx, plan = self.ctx, self.split.plan()
        crits = [self._crit(gi) for gi in range(len(ctx.groups))]
        deferreds = [self._deferred(gi) for gi in range(len(ctx.groups))]  # before _cur flips
        # 1. pack: this rank's whole gradient, unscaled; the buckets not packed in backward are packed now
        s1 = _Stage1(stale=inp.grads_changed or self._stale(), scaled=bool(self._packed))
        self._gather(inp.unscale)
        # parameters changed since the last step where a correction is pending: refused on every rank
        # (after the corrections, so the ranks stay equal), as the correction overwrites such a change
        edited = self._probe.edited(self.stage2.masks())
        wait_s = self.stage2.wait()  # the last stage 2 landed before the side channel starts
        self.meter.waited(wait_s)  # the network's time, not step()'s own work (auto's model has it on the link)
        self._launch_stage1(s1)
        if s1.scaled:  # packed in backward from the gradients as backward left them
            ctx.scale_grads(inp.unscale, deferreds)
        # 2. the side channel, while the last stage 2's exact update runs
        side = self._agree(s1, plan, edited, deferreds, correct=True)
        if side.any("stale"):  # a gradient changed after backward packed it (on some rank): pack again
            self._drop_stage1()
            s1.scaled = s1.stale = False
            self._launch_stage1(s1)
            side = self._agree(s1, plan, edited, deferreds, correct=False)
        self._steps += 1
        if side.any("edited"):
            self.buckets.wait(s1.handles, ctx.timeout, "stage-1 allreduce")
            raise edited_error("OSP")
        # 3. stage 2: the deferred blocks, averaged behind the next forward and backward
        absent = side.absent()
        deferring = any(d.numel() for d in deferreds)
        clip = inp.clip is not None
        # with clipping, or an optimizer that reads every parameter (the corrector's ``whole``), the
        # correction redoes the update of every group, not only of those with deferred blocks
        redo_all = deferring and (clip or self.corrector.whole)
        nonfinite = side.any("nonfinite")
        launch2 = [] if nonfinite else [gi for gi, d in enumerate(deferreds) if d.numel() or redo_all]
        # a sum, divided when it lands: Horovod never fuses it with stage 1's averages (their scale
        # factors differ), which start from the backward hooks while it runs; a fusion would make the
        # reduction order, hence the rounding, depend on timing
        with span("osp.stage2.launch"):
            h2 = {gi: self.comm2.allreduce_sum_async_(deferreds[gi], f"{ctx.prefix}.s2.{gi}", wire=self._wire2(gi))
                  for gi in launch2 if deferreds[gi].numel()}
        for h in h2.values():
            self.meter.track(h)
        rec = self._finish_stage1(s1, crits, wait_s)
        rec["bytes_stage2"] = ctx.nbytes - rec["bytes_stage1"] if h2 else 0
        # each rank's own gradient was finite, but the sum of the critical blocks may not be (float16):
        # the averages are identical on every rank, so every rank skips alike; stage 2 is dropped
        if not nonfinite and ctx.any_nonfinite(crits):
            for h in h2.values():
                self.comm2.wait(h, ctx.timeout, "stage-2 allreduce")
            nonfinite = True
        if nonfinite:
            rec.update(critical_fraction=0.0, bytes_stage2=0, skipped=True, overflow=True)
            self._end_step()
            return rec
        self._decide(side)
        scoring = self.split.budget.needs_scores or self.split.scores is not None and deferring
        ctx.scale_grads(inp.provisional)  # this rank's own gradient, where it moves the deferred blocks
        for gi, (fg, crit) in enumerate(zip(ctx.groups, crits)):
            mask = self.split.group_mask(gi)
            if s1.scaled:
                ctx.scale_grads(inp.unscale, [crit])
            ops.merge_blocks(crit, None, mask, fg.block_size, fg.grad, fg.nblocks - plan.ncrit[gi],
                             positions=self.split.group_positions(gi))
            if scoring:
                self.split.score(crit, fg, mask, self.split.group_lo[gi])
        if clip:  # the exact factor is applied when stage 2 lands
            self.stage2.clip = inp.clip if deferring else None
        self.stage2.snapshot(launch2, deferreds, h2, absent, clip, plan)
        if launch2:
            self._cur ^= 1  # the next backward packs into the other stage-2 buffer
        # 4. LGP's local update with the provisional gradient (averaged on critical blocks, this rank's
        # own on deferred ones); parameters without a gradient on any rank are left alone
        if clip:  # provisionally by the norm of this gradient (the average's on one rank, bitwise torch's)
            ctx.clip_(inp.clip, absent=absent)
        for fg, a in zip(ctx.groups, absent):
            fg.set_grads(a)
        unhooked_step(ctx.optimizer)
        self.corrector.adopt(ctx.groups)
        if self.stage2.pending:
            self._probe.record()
        rec["overflow"] = False
        self._end_step()
        return rec

    def _gather(self, unscale: Optional[float]) -> None:
        try:
            for fg in self.ctx.groups:
                fg.gather_grads()
        except ValueError:  # e.g. a sparse gradient: the same on every rank that has one
            self._drop_stage1()
            self._held = False
            raise
        self.ctx.scale_grads(unscale)

    @traced("osp.stage1.launch")
    def _launch_stage1(self, s1: "_Stage1") -> None:
        """Pack and start the buckets not started in backward (all of them when no backward pass was heard of,
        or when packed again): from the gradients as they are now, unscaled."""
        s1.t0 = time.perf_counter()
        s1.handles = list(self.buckets.launch(force=True))

    def _decide(self, agreed) -> None:
        """Feed the budget the step's agreed figures (``auto`` decides the coming steps' share from them)."""
        fig = self.meter.agreed(agreed)
        if self.ctx.comm.size == 1 and self.meter.sample_rate is None:  # nothing travels: nothing to defer
            fig["rate"] = math.inf
        self.split.budget.update(fig, self._bucket_bytes)

    @traced("osp.side_channel")
    def _wire2(self, gi: int) -> Optional[torch.dtype]:
        """What flat group ``gi``'s deferred blocks travel as (``OSP(stage2_compression)``, else the optimizer's)."""
        c = self.options.stage2_compression
        return self.ctx.wire(self.ctx.groups[gi]) if c is None else wire_dtype(c, self.ctx.groups[gi].dtype)

    def _agree(self, s1: "_Stage1", plan: Plan, edited, deferreds, correct: bool):
        """Post this rank's side channel, and read every rank's sum. With ``correct``, the previous step's
        exact update runs while it is in flight (its time does not count as stage 1's). A deferred gradient
        beyond its wire's range (float16) counts as non-finite: the step is skipped on every rank before
        stage 2 starts, which could not be undone once its critical blocks are applied."""
        ctx = self.ctx
        nonfinite = ctx.nonfinite()
        for gi, d in enumerate(deferreds):
            wire = self._wire2(gi)
            if wire is not None:
                nonfinite = nonfinite + (~fits(d, wire)).to(nonfinite.dtype)
        self._side.post(plan.mask, nonfinite=nonfinite, edited=edited, stale=s1.stale, **self.meter.figures())
        if correct:
            t0 = time.perf_counter()
            self.stage2.correct(self._steps)
            ctx.on_synced()
            s1.t0 += time.perf_counter() - t0  # stage1_s: the step's time on stage 1, not on corrections
        t0 = time.perf_counter()
        out = self._side.result("stage-1 allreduce", step=self._steps + 1)
        self.meter.waited(time.perf_counter() - t0)
        return out

    @traced("osp.stage1.wait")
    def _finish_stage1(self, s1: "_Stage1", crits: List[torch.Tensor], wait_s: float) -> dict:
        """Wait for stage 1's averages; the step's record so far."""
        ctx = self.ctx
        t1 = time.perf_counter()
        self.buckets.wait(s1.handles, ctx.timeout, "stage-1 allreduce")
        t2 = time.perf_counter()
        self.meter.waited(t2 - t1)
        b1 = sum(c.numel() * c.element_size() for c in crits)
        self.buckets.reset()
        self._packed = {}
        return {"stage2_wait_s": wait_s, "stage1_s": t2 - s1.t0, "bytes_stage1": b1,
                "critical_fraction": b1 / max(ctx.nbytes, 1)}

    def _bsp_step(self, inp: StepInput) -> dict:
        """A step handed to BSP; the last stage 2 (from before the handover) is finished first."""
        if self._held:  # a sparse gradient: what started in backward is waited for, then the gather raises
            self._held = False
            self._bsp.restart()
            for fg in self.ctx.groups:
                fg.gather_grads()
        # calls on_synced where OSP's own steps do: replicas equal, before the update
        wait_s = self.stage2.flush(self._steps)
        self.meter.waited(wait_s)
        rec = self._bsp.step(inp)
        rec["stage2_wait_s"] = wait_s
        if self._bsp.agreed is not None and not rec.get("skipped"):
            self._decide(self._bsp.agreed)
            if self.split.budget.needs_scores:  # auto leaves BSP: the next split is chosen from this average,
                self.corrector.adopt(self.ctx.groups)  # and corrected in the state BSP's steps left (flat views)
                for gi, fg in enumerate(self.ctx.groups):
                    self.split.score(fg.grad, fg, ~self._none[gi], self.split.group_lo[gi])
        self._steps += 1
        self._end_step()
        return rec

    def _end_step(self) -> None:
        self.split.forget_plan()  # the next step's, from the scores as they are now (made on first use)
        self.meter.end()
        self._follow_budget()

    def flush(self):
        self.stage2.flush(self._steps)

    def stats(self):
        return {"budget": self.split.budget.stats()}  # what the budget measured and decided

    # -- checkpoints ----------------------------------------------------------------------------
    def state_dict(self):
        return self.split.state_dict()

    def load_state_dict(self, state):
        self.corrector.adopt(self.ctx.groups)  # the optimizer's state, in flat buffers
        if "budget" in state:
            self.split.load_state_dict(state, self.ctx.device)
            self._follow_budget()
