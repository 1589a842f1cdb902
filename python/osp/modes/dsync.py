"""DSync(delay=k): delayed synchronization with exact correction (docs/design.md, "DSync").

Step t starts averaging its whole gradient during backward (bucketed from the hooks, as BSP does) and
moves the parameters with this rank's own gradient. Before the update of step t+k the average of step
t is applied exactly: restore the snapshot taken before step t, apply the optimizer's update with the
average, then replay the provisional updates of steps t+1 .. t+k-1 with their kept local gradients.
The applied updates are exactly the averaged ones; gradients are evaluated up to k provisional steps
away from that trajectory. ``DSync(delay=1)`` is ``OSP(critical=0.0)``.
"""
from __future__ import annotations

import collections
import time
from dataclasses import dataclass
from typing import Deque, Dict, List, Optional

import torch

from .. import agreement, ops
from ..agreement import Agreement, any_rank
from ..buckets import Buckets
from ..comm import Handle
from ..correction import Snapshot, corrector_for, hyper, unhooked_step
from ..layout import EditProbe, Workspace
from ..timing import span, traced
from .base import Clip, Context, Mode, Options, StepInput, check_int, check_positive, edited_error


class DSync(Options):
    """Delayed synchronization: the average of each step's whole gradient is applied ``delay`` steps
    later, exactly (the provisional local updates in between are replaced and replayed).

    Args:
        delay: steps an average may take, an integer >= 1, or ``"auto"``: the smallest delay under
            which the averages of the last ``window`` steps arrived before they were needed (each rank
            measures its own; replicas agree whatever delay each uses), at most ``max_delay``.
        max_delay: the largest delay ``"auto"`` may choose.
        bucket_mb: the averages start during backward in buckets of about this many MiB.
        window: with ``"auto"``, the steps it looks back on.

    Memory, in flat gradients of the model's size: ``delay + 1`` averages in flight and ``delay`` kept
    local gradients (none for ``delay=1``); ``max_delay`` for both with ``"auto"``; plus one snapshot of
    the parameters and the optimizer state.
    """

    name = "dsync"
    block_size = None  # the whole gradient moves every step: no blocks

    def __init__(self, delay=2, max_delay: int = 4, bucket_mb: float = 25.0, window: int = 16):
        if isinstance(delay, str):
            if delay != "auto":
                raise ValueError(f"osp: DSync(delay) must be an integer >= 1 or 'auto', got {delay!r}")
        elif isinstance(delay, bool) or not isinstance(delay, int) or delay < 1:
            raise ValueError(f"osp: DSync(delay) must be an integer >= 1 or 'auto', got {delay!r}")
        check_int("DSync", "max_delay", max_delay, 1)
        if delay != "auto" and max_delay < delay:
            raise ValueError(f"osp: DSync(max_delay) must be >= delay={delay}, got {max_delay!r}")
        self.delay, self.max_delay = delay, max_delay
        self.bucket_mb = check_positive("DSync", "bucket_mb", bucket_mb)
        self.window = check_int("DSync", "window", window, 1)

    def __repr__(self):
        return (f"DSync(delay={self.delay!r}, max_delay={self.max_delay}, bucket_mb={self.bucket_mb:g}, "
                f"window={self.window})")

    def build(self, ctx: Context) -> "DSyncMode":
        return DSyncMode(self, ctx)


@dataclass
class _Step:
    """A step whose average is in flight."""
    index: int
    slot: int  # its buffer avg{slot}, being averaged (the name of its collectives too)
    local: int  # its buffer local{local}: this rank's gradient, for replays
    handles: List[Handle]
    hyper: List[dict]  # every param group's hyper-parameters of that step, by value
    finite: bool  # this rank's gradient was finite (else its provisional update was skipped here)
    absent: List[set]  # per flat group, its parameters without a gradient here (the provisional update skips them)
    unscale: Optional[torch.Tensor] = None  # GradScaler: the average is of gradients scaled by 1 / this
    scaled: int = 0  # ... in its first ``scaled`` buckets (the later ones were unscaled when they started)
    clip: Optional[Clip] = None  # clip the average (by its 2-norm or by value)
    arrived: Optional[int] = None  # steps after its own that its average was seen complete


class DSyncMode(Mode):
    options: DSync

    def __init__(self, options: DSync, ctx: Context):
        super().__init__(options, ctx)
        self.delay = 1 if options.delay == "auto" else options.delay
        longest = options.max_delay if options.delay == "auto" else options.delay
        self.slots = longest + 1  # averages in flight at most (during a backward)
        self.kept = longest if longest > 1 else 0  # local gradients kept for replays
        self.corrector = corrector_for(ctx.optimizer)
        self.buckets = Buckets(ctx.groups, options.bucket_mb, ctx.comm, f"{ctx.prefix}.ds", wire=ctx.wire)
        # per slot: whether some rank's gradients were changed after backward, whether its parameters
        # were changed while a correction was pending, and which parameters have a gradient on some rank;
        # summed with the slot's average
        self._agree = [Agreement(ctx, f"ds.{slot}.present", fields=("grads_edited", "params_edited"))
                       for slot in range(self.slots)]
        self._probe = EditProbe(ctx.groups, chunk=4096)
        self._ws: Dict[int, Workspace] = {id(fg): Workspace(fg) for fg in ctx.groups}
        self._inflight: Deque[_Step] = collections.deque()
        self._snap: Optional[List[Snapshot]] = None  # the exact state before the oldest step in flight
        self._ages: Deque[int] = collections.deque(maxlen=options.window)
        # the snapshot covers every block (none is critical)
        self._none = [torch.zeros(fg.nblocks, dtype=torch.bool, device=fg.device) for fg in ctx.groups]
        self._none_pos = [ops.mask_positions(m) for m in self._none]
        self.t = 0
        self._late_overflows = 0  # steps found skipped in flush(), not yet reported to a GradScaler
        self._arm()

    # -- buffers ------------------------------------------------------------------------------
    def _buf(self, fg, kind: str, slot: int) -> torch.Tensor:
        return self._ws[id(fg)](f"{kind}{slot}")

    def _arm(self) -> None:
        """Point the buckets of the coming backward at its slot."""
        slot = self.t % self.slots
        self.buckets.reset(dest=lambda fg, slot=slot: self._buf(fg, "avg", slot), tag=f".{slot}")

    def on_ready(self, p):
        self.buckets.on_ready(p)

    def restart(self):
        self.buckets.wait(self.buckets.launched, self.ctx.timeout, "delayed gradient allreduce")
        self._arm()

    @property
    def in_flight(self):
        return bool(self._inflight)

    synced_in_step = True  # see step(): its buckets are all started only there

    @property
    def record_lag(self):
        # step t's record is read at step t + delay; with "auto" each rank has its own delay, at most max_delay
        return self.options.max_delay if self.options.delay == "auto" else self.options.delay

    # -- the step -------------------------------------------------------------------------------
    def step(self, inp: StepInput):
        ctx = self.ctx
        if inp.backward_scale is not None and self.options.delay == "auto":
            # every rank with the scaler refuses here: finish the buckets backward started first, so that no
            # collective is left in flight (a peer still in its backward would otherwise meet a rank that
            # has moved on, or shut down)
            self.buckets.launch(force=True)
            self.restart()
            raise ValueError(
                "osp: DSync(delay='auto') cannot take a GradScaler: each rank picks its own delay, so ranks "
                "would learn of an overflow at different steps and their loss scales would drift apart. Use "
                "a fixed delay, e.g. osp.DSync(delay=2)")
        # a bucket without gradients averages zeros; the buckets launched from here on carry gradients
        # a GradScaler's unscale_() already unscaled (those launched in backward are still scaled)
        scaled = len(self.buckets.launched) if inp.grads_changed else len(self.buckets.buckets)
        handles = list(self.buckets.launch(force=True))
        if not self._inflight and (self.options.delay != "auto" or self.t == 0):
            # nothing in flight: the replicas are exact, and every rank has started this step's buckets (a
            # rank whose backward missed a parameter starts its bucket only just now: a check at the step's
            # start would meet the others' bucket there)
            ctx.on_synced()
        slot = self.t % self.slots
        handles.append(self._agree[slot].post(grads_edited=bool(inp.edited), params_edited=self._probe.edited()))
        # the provisional update uses this rank's own gradient, unscaled and clipped (by its own norm)
        ctx.scale_grads(inp.unscale)
        ctx.scale_grads(inp.provisional)
        if inp.clip is not None:
            ctx.clip_(inp.clip, absent=[fg.absent for fg in ctx.groups])
        own_nonfinite = ctx.nonfinite()  # read with the first due average's record: one read per step
        self._observe()
        if self.options.delay == "auto":
            self.delay = self._auto_delay()
        due = [s for s in self._inflight if self.t - s.index >= self.delay]
        rec = {"critical_fraction": 0.0, "bytes_stage1": 0, "bytes_stage2": ctx.nbytes, "stage1_s": 0.0,
               "delay": self.delay}
        t0 = time.perf_counter()
        for s in due:
            with span("osp.dsync.wait"):
                self.buckets.wait(s.handles, ctx.timeout, "delayed gradient allreduce")
            if s.arrived is None:  # it had to be waited for: a longer delay would have hidden it
                self._ages.append(self.t - s.index + (1 if time.perf_counter() - t0 > 1e-4 else 0))
        rec["stage2_wait_s"] = time.perf_counter() - t0
        skipped, own = self._apply(due, own_nonfinite) if due else (0, None)
        finite = not (own if own is not None else agreement.read(own_nonfinite.reshape(1))[0])
        # a GradScaler backs off once per step that reports an overflow: one skipped step each
        pending = self._late_overflows + skipped
        rec.update(skipped=skipped, overflow=pending > 0)
        self._late_overflows = max(0, pending - 1)
        t1 = time.perf_counter()
        replayed = self._replay() if due else 0
        rec["replay_s"] = time.perf_counter() - t1
        rec["replayed"] = replayed
        if self._snap is None:  # nothing in flight: the state is exact
            self._take_snapshot()
        # the provisional update with this rank's own gradient; a parameter without one here is left
        # alone, as torch.optim leaves it (its average may still bring a gradient from other ranks)
        absent = [set(fg.absent) for fg in ctx.groups]
        if finite:
            for fg, a in zip(ctx.groups, absent):
                fg.set_grads(a)  # and stays None after the step, as torch.optim leaves it
            unhooked_step(ctx.optimizer)
            self.corrector.adopt(ctx.groups)
        self._probe.record()
        local = self.t % self.kept if self.kept else -1
        if self.kept:  # the slot's previous step has landed: it was due by now
            for fg in ctx.groups:
                self._buf(fg, "local", local).copy_(fg.grad)
        self._inflight.append(_Step(index=self.t, slot=slot, local=local, handles=handles, finite=finite,
                                    absent=absent,
                                    hyper=[hyper(g) for g in ctx.optimizer.param_groups],
                                    unscale=None if inp.backward_scale is None else inp.backward_scale.reciprocal(),
                                    scaled=scaled,
                                    clip=inp.clip))
        self.t += 1
        self._arm()
        return rec

    def _observe(self) -> None:
        """Note, for ``auto``, how many steps each average took (polled at step boundaries)."""
        for s in self._inflight:
            if s.arrived is None and all(self.ctx.comm.poll(h) for h in s.handles):
                s.arrived = self.t - s.index
                self._ages.append(s.arrived)

    def _auto_delay(self) -> int:
        return max(1, min(self.options.max_delay, max(self._ages, default=1)))

    def _take_snapshot(self) -> None:
        self._snap = [self.corrector.snapshot(fg, m, fg.padded, {}, carry=True, positions=pos)
                      for fg, m, pos in zip(self.ctx.groups, self._none, self._none_pos)]

    @traced("osp.correction")
    def _apply(self, due: List[_Step], extra: Optional[torch.Tensor] = None):
        """Restore the snapshot and apply the exact updates of ``due`` (oldest first); a step whose
        average is not finite is skipped on every rank. Returns how many were skipped, and the host value
        of the device scalar ``extra``, read with the first one's record (None without ``extra``)."""
        ctx, skipped, exact, extra_value = self.ctx, 0, False, None
        for s in due:
            self._inflight.popleft()
            avgs = [self._buf(fg, "avg", s.slot) for fg in ctx.groups]
            if s.unscale is not None:
                ctx.scale_grads(s.unscale, [self._buf(fg, "avg", s.slot)[lo:hi]
                                            for fg, lo, hi, _ in self.buckets.buckets[:s.scaled]])
            # the record, whether the average is finite (and ``extra``): one read
            extras = [ctx.nonfinite(avgs)] + ([extra] if extra is not None and extra_value is None else [])
            total = self._agree[s.slot].result("delayed gradient allreduce", extra=extras, age=self.t - s.index)
            if len(total.extra) > 1:
                extra_value = total.extra[1]
            if total.any("grads_edited"):
                raise RuntimeError(
                    f"osp: under DSync the gradients were changed in place or replaced between backward() and "
                    f"step() on some rank (step {s.index}), e.g. by torch.nn.utils.clip_grad_norm_ or p.grad.mul_(); "
                    "DSync starts averaging them during backward, so the change cannot reach the average and the "
                    "exact update would silently differ. Clip with opt.clip_grad_norm_(max_norm) (exact: by the "
                    "norm of the average), scale the loss instead of the gradients, or use osp.OSP() / osp.BSP()")
            if total.any("params_edited"):
                raise edited_error("DSync")
            if total.extra[0] > 0:
                skipped += 1
                continue
            absent = total.absent()
            if s.clip is not None:
                ctx.clip_(s.clip, avgs, absent)
            for i, (snap, fg) in enumerate(zip(self._snap, ctx.groups)):
                snap.hyper = s.hyper[fg.group_index]
                snap.absent = absent[i]  # without a gradient on any rank: kept as before the step
            self.corrector.correct(list(zip(self._snap, avgs)))
            if not all(snap.carry for snap in self._snap):  # carried on: the exact state before the next step
                self._take_snapshot()
            exact = True
        if not exact:  # the snapshot is still the exact state: put it back
            self.corrector.restore(self._snap)
        if self.options.delay != "auto":  # every rank is at this point of the same step
            ctx.on_synced()
        return skipped, extra_value

    @traced("osp.dsync.replay")
    def _replay(self) -> int:
        """Replay the provisional updates of the steps still in flight, on top of the exact state: each
        one's kept local gradient, under that step's hyper-parameters; a parameter without a gradient
        in that step is left alone, as it was."""
        n = 0
        for s in self._inflight:
            if s.finite:
                items = [(fg, self._buf(fg, "local", s.local)) for fg in self.ctx.groups]
                self.corrector.update(items, s.hyper, s.absent)
                n += 1
        return n

    def flush(self):
        edited = self._probe.edited() if self._inflight else None
        self._probe.clear()
        skipped = 0
        if self._inflight:
            due = list(self._inflight)
            for s in due:
                self.buckets.wait(s.handles, self.ctx.timeout, "delayed gradient allreduce")
            skipped, _ = self._apply(due)
            self._late_overflows += skipped  # a GradScaler hears of them at the next steps
            self._snap = None
            if any_rank(self.ctx, edited, "dsync.edited"):
                raise edited_error("DSync")
            if self.options.delay == "auto":
                self.ctx.on_synced()
        else:
            self.ctx.on_synced()
        return skipped

    def state_dict(self):
        return {"late_overflows": self._late_overflows}  # a checkpoint after flush() keeps them

    def load_state_dict(self, state):
        self.corrector.adopt(self.ctx.groups)  # the optimizer's state, in flat buffers
        self._snap = None
        if "late_overflows" in state:
            self._late_overflows = int(state["late_overflows"])

    def stats(self):
        kept = sum(ws.nbytes() for ws in self._ws.values()) + self.corrector.nbytes()
        return {"delay": self.delay, "kept_bytes": kept}
