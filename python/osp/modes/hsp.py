"""HSP: ranks that finish early compute extra micro-batches instead of waiting (DESIGN.md, "HSP").

``opt.step(closure)``, after the step's first micro-batch ran backward as usual: this rank posts a tiny
non-blocking "ready" collective, and while it has not completed (some rank is still computing its first
micro-batch) and fewer than ``max_extra`` extras ran, calls ``closure()`` (forward and backward of one
more micro-batch, accumulating into ``.grad``) and polls again. When "ready" completes, one sum across
ranks carries the flat gradients, every rank's micro-batch count and failure flag, and which parameters
have a gradient; the applied gradient is the mean over every micro-batch any rank computed. Every rank
applies the same averaged gradient, so the replicas stay bitwise equal after every step, and no rank
waits for another longer than the micro-batch the other one is in. Without a closure HSP is BSP.
"""
from __future__ import annotations

import statistics
import time
from typing import List

import torch

from .. import sidechannel
from ..correction import unhooked_step
from .base import Context, Mode, Options, StepInput, check_int


class HSP(Options):
    """Hybrid synchronous parallel: synchronized every step, but a rank that would wait for a straggler
    computes up to ``max_extra`` extra micro-batches instead (``opt.step(closure)``); the applied gradient
    is the mean over every micro-batch of every rank. Without a closure, HSP is BSP.

    With ``backward_passes_per_step=k`` the step's first micro-batch is its k passes, as under BSP, and
    the applied gradient is k times the mean per backward pass (BSP's scale); an extra may run one or
    more backward passes, each counting as one pass.
    """

    name = "hsp"
    block_size = None  # the whole gradient moves every step: no blocks

    def __init__(self, max_extra: int = 4):
        self.max_extra = check_int("HSP", "max_extra", max_extra, 0)

    def __repr__(self):
        return f"HSP(max_extra={self.max_extra})"

    def build(self, ctx: Context) -> "HSPMode":
        return HSPMode(self, ctx)


class HSPMode(Mode):
    accepts_closure = True

    def __init__(self, options: HSP, ctx: Context):
        super().__init__(options, ctx)
        self.size, self.rank = ctx.comm.size, ctx.comm.rank
        self._ready = torch.zeros(1, dtype=torch.float32, device=ctx.device)
        # per rank: backward passes, failed, "ready" latency seen (ms); then per parameter: ranks with a
        # gradient for it
        self._meta = torch.zeros(3 * self.size + ctx.nparams, dtype=torch.float32, device=ctx.device)
        self._latency: List[float] = []  # the last steps' "ready" latency (s), as the last rank to arrive saw it
        self._totals = {"extras": 0, "wait_s": 0.0, "passes": [0] * self.size}
        self._behind = True  # this rank computed the fewest micro-batches last step (or there was none)

    def step(self, inp: StepInput) -> dict:
        ctx, comm, size = self.ctx, self.ctx.comm, self.size
        t0 = time.perf_counter()
        ready = comm.allreduce_sum_async_(self._ready.fill_(1.0), f"{ctx.prefix}.hsp.ready")
        passes, extras, extra_s, failure = inp.passes, 0, 0.0, None
        if inp.extra is not None:
            grace = self._grace(inp.compute_s)
            while extras < self.options.max_extra and not self._ready_within(ready, grace):
                t = time.perf_counter()
                try:
                    passes += inp.extra()
                except Exception as e:  # every rank must hear of it, or the others would wait forever
                    failure = e
                    break
                finally:
                    extra_s += time.perf_counter() - t
                extras += 1
        comm.wait(ready, ctx.timeout, "HSP ready")
        # from posting "ready" to its completion, on a rank that ran no extra: on the last rank to arrive,
        # that is the collective's latency
        seen = time.perf_counter() - t0 if extras == 0 and failure is None else 0.0
        for fg in ctx.groups:
            fg.gather_grads()  # a missing gradient counts as zeros
        meta = self._meta
        meta.zero_()
        meta[self.rank] = float(passes)
        meta[size + self.rank] = 1.0 if failure is not None else 0.0
        meta[2 * size + self.rank] = seen * 1e3
        ctx.presence(meta[3 * size:])
        handles = [comm.allreduce_sum_async_(fg.grad, f"{ctx.prefix}.hsp.{gi}") for gi, fg in enumerate(ctx.groups)]
        handles.append(comm.allreduce_sum_async_(meta, f"{ctx.prefix}.hsp.meta"))
        t1 = time.perf_counter()
        for h in handles:
            comm.wait(h, ctx.timeout, "HSP gradient allreduce")
        t2 = time.perf_counter()
        host = sidechannel.read(meta)
        counts = [int(round(c)) for c in host[:size]]
        failed = [r for r in range(size) if host[size + r] > 0]
        if failure is not None:
            raise failure
        if failed:
            raise RuntimeError(
                f"osp: HSP step aborted on every rank: the closure passed to step() failed on rank(s) {failed} "
                "(see the error on that rank); no update was applied")
        wait_s = (t2 - t0) - extra_s  # in step() outside the closures: waiting for the others, and the sum
        self._behind = counts[self.rank] == min(counts) < max(counts)
        seen_ms = [m for m in host[2 * size:3 * size] if m > 0]
        if seen_ms:  # the smallest is the last rank's to arrive: the others waited for it
            self._latency = (self._latency + [min(seen_ms) * 1e-3])[-8:]
        for r, c in enumerate(counts):
            self._totals["passes"][r] += c
        self._totals["extras"] += extras
        self._totals["wait_s"] += wait_s
        rec = {"critical_fraction": 1.0, "bytes_stage1": ctx.nbytes, "bytes_stage2": 0, "stage1_s": t2 - t1,
               "stage2_wait_s": 0.0, "micro_batches": counts, "extras": extras, "wait_s": wait_s,
               "ready_ms": host[2 * size:3 * size]}
        # the sum over ranks is identical everywhere, so every rank scales, checks and steps alike
        ctx.scale_grads(inp.passes / sum(counts))  # the mean per pass, at BSP's scale
        ctx.scale_grads(inp.unscale)
        for fg, a in zip(ctx.groups, ctx.absent_everywhere(host[3 * size:])):
            fg.set_grads(a)
        if ctx.any_nonfinite():
            rec.update(skipped=True, overflow=True)
            return rec
        if inp.max_norm is not None:
            grads: List[torch.Tensor] = [fg.grad for fg in ctx.groups]
            ctx.scale_grads(ctx.clip_coef(inp.max_norm, ctx.sq_norm(grads)))
        unhooked_step(ctx.optimizer)
        rec["overflow"] = False
        return rec

    def _grace(self, micro_batch_s: float) -> float:
        """How long "ready" may take before this rank starts an extra. The last rank to arrive sees it
        incomplete while it propagates (0.5 ms with torch's Gloo here, 1-2 ms with Horovod's, several on a
        first step): an extra started then would make every rank wait for it. The rank that was behind last
        step (the likely straggler) gives it max(20 ms, half its micro-batch, ``micro_batch_s``); the others
        three times the median latency of the last 8 steps, within [0.3, 20] ms (2 ms before any was
        seen; the median, as the scheduler of a busy host adds outliers of several ms)."""
        if self._behind:
            return max(2e-2, 0.5 * micro_batch_s)
        if not self._latency:
            return 2e-3
        return min(max(3e-4, 3.0 * statistics.median(self._latency)), 2e-2)

    def _ready_within(self, handle, seconds: float) -> bool:
        deadline = time.perf_counter() + seconds
        while not self.ctx.comm.poll(handle):
            if time.perf_counter() >= deadline:
                return False
            time.sleep(1e-4)
        return True

    def stats(self) -> dict:
        t = self._totals
        return {"hsp": {"extras": t["extras"], "wait_s": t["wait_s"], "passes_per_rank": list(t["passes"]),
                        "ready_latency_s": statistics.median(self._latency) if self._latency else None}}
