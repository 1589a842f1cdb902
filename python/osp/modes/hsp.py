"""HSP: ranks that finish early compute extra micro-batches instead of waiting (docs/design.md, "HSP").

``opt.step(closure)``, after the step's first micro-batch ran backward as usual: this rank posts a tiny
non-blocking "ready" collective, and while it has not completed (some rank is still computing its first
micro-batch), fewer than ``max_extra`` extras ran and the others are expected to need at least half an
extra (``_worth_waiting``), calls ``closure()`` (forward and backward of one more micro-batch,
accumulating into ``.grad``) and polls again. When "ready" completes the gradient is synchronized by the
mode HSP composes with (``sync=``); the applied gradient is the mean over every micro-batch any rank
computed. Every rank applies the same averaged gradient, so the replicas stay bitwise equal wherever the
composed mode's are, and no rank waits for another longer than about one micro-batch. Without a closure
HSP is its ``sync`` alone.

- ``sync=osp.BSP()`` (the default): one sum across ranks carries the flat gradients, every rank's
  micro-batch count, failure flag and arrival time, and which parameters have a gradient; the mean is
  the sum times ``passes / total``.
- ``sync=osp.OSP(...)`` or ``osp.DSync(...)``: a tiny sum of every rank's micro-batch count, failure
  flag and arrival first (a failure aborts the step before anything is sent), then each rank scales its
  summed gradient by ``size * passes / total`` (so the composed mode's average is the mean over every
  micro-batch: for OSP's critical blocks now and its deferred blocks at their exact correction, for
  DSync's average when it lands) and hands the step to the composed mode, which starts its
  synchronization at ``step()`` (the gradient is complete only after the extras); its provisional moves
  take this rank's own mean (``StepInput.provisional``).
"""
from __future__ import annotations

import dataclasses
import time
from typing import Optional

import torch

from .. import timing
from ..agreement import Agreement
from ..comm import alone
from ..correction import unhooked_step
from ..timing import span, traced
from .base import Context, Mode, Options, StepInput, check_int, warn_grad_edits
from .bsp import BSP
from .dsync import DSync
from .osp import OSP


class HSP(Options):
    """Hybrid synchronous parallel: synchronized every step, but a rank that would wait for a straggler
    computes up to ``max_extra`` extra micro-batches instead (``opt.step(closure)``); the applied gradient
    is the mean over every micro-batch of every rank. Without a closure, HSP is its ``sync``.

    Args:
        max_extra: extra micro-batches a rank may compute per step.
        sync: how the summed gradient is synchronized once every rank is ready: ``osp.BSP()`` (default:
            averaged before the update), ``osp.OSP(...)`` (two stages: the network hidden behind compute
            as well as the stragglers) or ``osp.DSync(...)``.

    With ``backward_passes_per_step=k`` the step's first micro-batch is its k passes, as under BSP, and
    the applied gradient is k times the mean per backward pass (BSP's scale); an extra may run one or
    more backward passes, each counting as one pass.
    """

    name = "hsp"
    block_size = None  # with BSP the whole gradient moves every step: no blocks

    def __init__(self, max_extra: int = 4, sync: Optional[Options] = None):
        self.max_extra = check_int("HSP", "max_extra", max_extra, 0)
        sync = BSP() if sync is None else sync
        if not isinstance(sync, (BSP, OSP, DSync)):
            raise ValueError(f"osp: HSP(sync) must be osp.BSP(), osp.OSP(...) or osp.DSync(...), got {sync!r}")
        self.sync = sync
        self.block_size = sync.block_size

    def __repr__(self):
        with_ = "" if isinstance(self.sync, BSP) else f", sync={self.sync!r}"
        return f"HSP(max_extra={self.max_extra}{with_})"

    def build(self, ctx: Context) -> "HSPMode":
        return HSPMode(self, ctx)


class HSPMode(Mode):
    accepts_closure = True
    synced_in_step = True

    def __init__(self, options: HSP, ctx: Context):
        super().__init__(options, ctx)
        self.size, self.rank = ctx.comm.size, ctx.comm.rank
        self._ready = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        # the mode the summed gradient is synchronized by (None: BSP's, in HSP's own sum). It hears of no
        # backward pass: the gradient is complete only after the extras, so it starts everything at step()
        self.inner: Optional[Mode] = None if isinstance(options.sync, BSP) else options.sync.build(ctx)
        # per rank: backward passes, failed, arrival (ms from the end of the last step's sum to "ready",
        # the per-step records' arrival); with BSP also per parameter: ranks with a gradient for it
        self._meta = Agreement(ctx, "hsp.meta", per_rank=("passes", "failed"), presence=self.inner is None,
                               arrival=True)
        self._totals = {"extras": 0, "wait_s": 0.0, "passes": [0] * self.size}
        self._t_synced: Optional[float] = None  # when the last step's sum completed here
        self._lag = 0.0  # last step: how long after this rank the last one posted "ready" (s)
        self._extra_s: Optional[float] = None  # how long one extra micro-batch took here
        # on a GPU the host only queues the work: every time HSP decides by is the device's (osp.timing)
        self._cuda = ctx.device.type == "cuda"
        self._t_end: Optional[float] = None  # when the last step returned (a GPU's first micro-batch's start)

    # the composed mode's state is the step's state
    def restart(self):
        if self.inner is not None:
            self.inner.restart()

    @property
    def in_flight(self):
        return self.inner is not None and self.inner.in_flight

    @property
    def record_lag(self):
        return self.inner.record_lag if self.inner is not None else 0

    @property
    def exact(self):
        return self.inner is None or self.inner.exact

    def flush(self):
        return self.inner.flush() if self.inner is not None else 0

    def state_dict(self):
        return self.inner.state_dict() if self.inner is not None else {}

    def load_state_dict(self, state):
        if self.inner is not None:
            self.inner.load_state_dict(state)

    def step(self, inp: StepInput) -> dict:
        ctx, comm, size = self.ctx, self.ctx.comm, self.size
        compute_s = inp.compute_s
        if self._cuda:  # "ready" is when this rank's first micro-batch finished on the device, not queued
            timing.wait_here(ctx.device)
            if self._t_end is not None:
                compute_s = time.perf_counter() - self._t_end  # the last step ended synced with the device
        t0 = time.perf_counter()
        ready = comm.allreduce_sum_async_(self._ready.fill_(1.0), f"{ctx.prefix}.hsp.ready")
        arrival = t0 - self._t_synced if self._t_synced is not None else 0.0
        if self.inner is None:  # the composed mode says what it says of an edit
            warn_grad_edits(self, inp.edited)
        # a rank that joined (out of data) adds no micro-batch: the mean is over the others' passes
        passes, extras, extra_s, failure, loss = 0 if ctx.joined else inp.passes, 0, 0.0, None, None
        if inp.closure is not None and size > 1 and not ctx.joined:  # alone, nobody is waited for
            mb = self._extra_s if self._extra_s is not None else compute_s
            while extras < self.options.max_extra and not self._worth_waiting(ready, t0, mb):
                t = time.perf_counter()
                try:
                    n, loss = self._run_extra(inp.closure)
                    passes += n
                except Exception as e:  # every rank must hear of it, or the others would wait forever
                    failure = e
                    break
                finally:
                    extra_s += time.perf_counter() - t  # on a GPU too: _run_extra waits for the device
                extras += 1
        with span("osp.hsp.wait"):
            comm.wait(ready, ctx.timeout, "HSP ready")
        if self.exact:  # every rank has arrived, nothing of this step is applied: replicas equal (a check here
            ctx.on_synced()  # makes no fast rank wait at the step's start, where it would run extras)
        meta = dict(passes=passes, failed=failure is not None, arrival_ms=arrival * 1e3)
        if self.inner is None:
            rec, agreed, t1, t2 = self._sum_step(inp, meta)
        else:
            t1 = time.perf_counter()
            self._meta.post(**meta)
            agreed = self._meta.result("HSP micro-batch counts")
            t2 = time.perf_counter()
        counts = [int(round(c)) for c in agreed.per_rank("passes")]
        failed = [r for r, f in enumerate(agreed.per_rank("failed")) if f > 0]
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(
                f"osp: HSP step aborted on every rank: the closure passed to step() failed on rank(s) {failed} "
                "(see the error on that rank); no update was applied")
        wait_s = (t2 - t0) - extra_s  # in step() outside the closures: waiting for the others, and the sum
        arrivals = agreed.per_rank("arrival_ms")
        if all(a > 0 for a in arrivals):  # known from the second step on, on every rank
            self._lag = max(0.0, max(arrivals) * 1e-3 - arrival)
        if extras:
            self._extra_s = extra_s / extras
        for r, c in enumerate(counts):
            self._totals["passes"][r] += c
        self._totals["extras"] += extras
        self._totals["wait_s"] += wait_s
        hsp = {"micro_batches": counts, "extras": extras, "wait_s": wait_s, "loss": loss}
        if self.inner is None:
            rec.update(hsp, stage1_s=t2 - t1)
            rec = self._bsp_update(inp, rec, agreed)
        else:
            rec = self._composed(inp, counts, passes)
            rec.update(hsp)
            self._t_synced = time.perf_counter()
        self._t_end = time.perf_counter()
        return rec

    def _sum_step(self, inp: StepInput, meta: dict):
        """With BSP: one sum of the flat gradients and the record; the mean per pass at BSP's scale, unscaled
        for a GradScaler, in one pass over the gradients."""
        ctx, comm = self.ctx, self.ctx.comm
        for fg in ctx.groups:
            fg.gather_grads()  # a missing gradient counts as zeros
        handles = [comm.allreduce_sum_async_(fg.grad, f"{ctx.prefix}.hsp.{gi}", wire=ctx.wire(fg))
                   for gi, fg in enumerate(ctx.groups)]
        handles.append(self._meta.post(**meta))
        t1 = time.perf_counter()
        with span("osp.hsp.wait"):
            for h in handles:
                comm.wait(h, ctx.timeout, "HSP gradient allreduce")
        t2 = time.perf_counter()
        self._t_synced = t2
        # The factor is computed on the device from the summed counts (in double, as a number would be), so
        # the step reads the host once: the sum's record with the scaled gradients' non-finite flag
        total = self._meta.per_rank_on_device("passes").double().sum()
        factor = torch.full_like(total, float(inp.passes)).div_(total.clamp(min=1.0))  # 0: every rank joined
        ctx.scale_grads(factor if inp.unscale is None else factor.mul_(inp.unscale.to(factor.device)))
        agreed = self._meta.result("HSP gradient allreduce", extra=[ctx.nonfinite()])
        if self._cuda:  # the waits above only ordered the stream; the read just now synced with the device
            t2 = self._t_synced = time.perf_counter()
        rec = {"critical_fraction": 1.0, "bytes_stage1": ctx.nbytes, "bytes_stage2": 0, "stage2_wait_s": 0.0}
        return rec, agreed, t1, t2

    def _bsp_update(self, inp: StepInput, rec: dict, agreed) -> dict:
        # the sum over ranks is identical everywhere, so every rank scales, checks and steps alike
        ctx = self.ctx
        absent = agreed.absent()
        for fg, a in zip(ctx.groups, absent):
            fg.set_grads(a)
        if agreed.extra[0] > 0:
            rec.update(skipped=True, overflow=True)
            return rec
        if inp.clip is not None:
            ctx.clip_(inp.clip, absent=absent)
        unhooked_step(ctx.optimizer)
        rec["overflow"] = False
        return rec

    def _composed(self, inp: StepInput, counts, passes: int) -> dict:
        """With OSP or DSync: this rank's summed gradient times ``size * passes / total`` (identical on every
        rank), so the composed mode's average is the mean over every micro-batch of every rank; its
        provisional moves take this rank's own mean (``passes / own``). One rank, or no extra anywhere: the
        factors are 1 and the step is the composed mode's own, bitwise."""
        ctx, total = self.ctx, sum(counts)
        factor = self.size * inp.passes / total if total else 1.0
        inner_inp = dataclasses.replace(inp, closure=None)  # the extras ran: the composed mode takes no closure
        # OSP("auto") on BSP's code: the composed mode's average is BSP's, which a GradScaler unscales
        # itself where .grad is the average; here it is not, so the scale goes here, with the factor
        unscale = inp.unscale if self.inner.grad_is_average else None
        if factor != 1.0 or unscale is not None:
            for fg in ctx.groups:
                fg.gather_grads()
            ctx.scale_grads(factor)
            ctx.scale_grads(unscale)
            inner_inp.unscale = None if unscale is not None else inp.unscale
            if passes and factor != 1.0:
                inner_inp.provisional = inp.passes / (passes * factor)
        rec = self.inner.step(inner_inp)
        rec.setdefault("overflow", bool(rec.get("skipped")))
        return rec

    @traced("osp.hsp.extra")
    def _run_extra(self, closure):
        """One call of the user's ``closure`` (an extra micro-batch): its backward passes and its loss. On
        a GPU it returns once the device ran it (polling a CUDA event), so that the next decision and the
        micro-batch's time are the device's: otherwise the host would queue ``max_extra`` extras at once,
        whatever the others do."""
        with self.ctx.extra_passes() as passes, torch.enable_grad(), alone():
            loss = closure()
        if self._cuda:
            timing.wait_here(self.ctx.device)
        if passes() == 0:
            raise RuntimeError(
                f"osp: the closure passed to step() returned without a backward pass reaching this optimizer's "
                f"parameters (e.g. {self.ctx.groups[0].names[0]!r}); under HSP it must compute one more "
                "micro-batch: forward, loss.backward() (no zero_grad), and return the loss")
        return passes(), loss

    def _worth_waiting(self, ready, t0: float, mb: float) -> bool:
        """Whether to wait for "ready" (True once it completed) rather than start an extra micro-batch,
        which takes about ``mb`` seconds here; ``t0``: when this rank posted "ready".

        An extra is worth it while the others are expected to need at least half of it: the last step's
        arrivals (every rank's time from the end of the step before to its "ready") predict how long
        after this rank the last one arrives. Past that prediction, this rank waits a margin of
        max(half a micro-batch, 2 ms; 20 ms before the first prediction) before starting an extra anyway
        (a rank later than predicted). The last rank to arrive predicts no lag and sees "ready" complete
        within the collective's latency (0.5 ms with torch's Gloo here, 1-2 ms with Horovod's), well
        inside that margin, so it starts no extra that every rank would then wait for."""
        comm = self.ctx.comm
        if comm.poll(ready):
            return True
        left = self._lag - (time.perf_counter() - t0)
        if left >= 0.5 * mb:
            return False
        margin = max(0.5 * mb, 2e-3) if self._t_synced is not None else max(0.5 * mb, 2e-2)
        return comm.done_within(ready, max(left, 0.0) + margin, max_pause=1e-4)

    @property
    def straggler_advice(self):
        return (f"HSP already has the other ranks compute up to max_extra={self.options.max_extra} extra "
                "micro-batches while they wait; where stats()['hsp']['passes_per_rank'] shows the fast ranks at "
                "that limit, a larger max_extra "
                "hides more of the wait")

    def stats(self) -> dict:
        t = self._totals
        out = self.inner.stats() if self.inner is not None else {}
        out["hsp"] = {"extras": t["extras"], "wait_s": t["wait_s"], "passes_per_rank": list(t["passes"]),
                      "lag_s": self._lag}
        return out
