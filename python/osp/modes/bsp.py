"""BSP: bulk-synchronous parallel, the baseline (matches ``horovod.torch.DistributedOptimizer``)."""
from __future__ import annotations

import time

from ..buckets import Buckets
from ..correction import unhooked_step
from .base import Context, Mode, Options


class BSP(Options):
    """Bulk-synchronous parallel: every gradient element is averaged before the update (the
    baseline; matches ``horovod.torch.DistributedOptimizer``). Gradients are averaged in buckets of
    about ``bucket_mb`` MiB, each started during backward as soon as its gradients are ready."""

    name = "bsp"
    block_size = None

    def __init__(self, bucket_mb: float = 25.0):
        if isinstance(bucket_mb, bool) or not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"osp: BSP(bucket_mb) must be a positive number, got {bucket_mb!r}")
        self.bucket_mb = float(bucket_mb)

    def __repr__(self):
        return f"BSP(bucket_mb={self.bucket_mb:g})"

    def build(self, ctx: Context) -> "BSPMode":
        return BSPMode(self, ctx)


class BSPMode(Mode):
    def __init__(self, options: BSP, ctx: Context):
        super().__init__(options, ctx)
        self.buckets = Buckets(ctx.groups, options.bucket_mb, ctx.comm, ctx.passes_per_step, "osp.bsp")
        self._synced = None  # seconds synchronize() took, when it ran for the coming step

    def on_grad(self, p):
        self.buckets.on_grad(p)

    @property
    def in_flight(self):
        return self.buckets.in_flight

    def ready_for_zero_grad(self):
        if self.buckets.in_flight:
            raise RuntimeError("osp: zero_grad() while gradient averaging is in flight: call step() "
                               "(or synchronize()) first")

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        handles = self.buckets.launch(force=True)
        self.buckets.wait(handles, self.ctx.timeout, "gradient allreduce")
        self.buckets.reset()
        self._synced = time.perf_counter() - t0

    def step(self, compute_s):
        rec = {"critical_fraction": 1.0, "bytes_stage1": self.ctx.nbytes, "bytes_stage2": 0,
               "stage2_wait_s": 0.0}
        if not (self.ctx.skip_sync and self._synced is not None):
            self.synchronize()
        rec["stage1_s"] = self._synced
        self._synced = None
        self.buckets.reset()
        # after averaging every rank holds the same values, so all ranks decide alike
        if self.ctx.any_nonfinite():
            rec["skipped"] = True
            return rec
        unhooked_step(self.ctx.optimizer)
        return rec
