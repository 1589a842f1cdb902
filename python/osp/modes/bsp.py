"""BSP: bulk-synchronous parallel, the baseline (matches ``horovod.torch.DistributedOptimizer``)."""
from __future__ import annotations

import time

from ..agreement import Agreement
from ..buckets import Buckets
from ..correction import unhooked_step
from ..timing import traced
from .base import Context, Mode, Options, StepInput, check_positive


class BSP(Options):
    """Bulk-synchronous parallel: every gradient element is averaged before the update (the
    baseline; matches ``horovod.torch.DistributedOptimizer``). Gradients are averaged in buckets of
    about ``bucket_mb`` MiB, each started during backward as soon as its gradients are ready; when
    the step's last backward pass returns, ``.grad`` holds the average on every rank (as with DDP)."""

    name = "bsp"
    block_size = None

    def __init__(self, bucket_mb: float = 25.0):
        self.bucket_mb = check_positive("BSP", "bucket_mb", bucket_mb)

    def __repr__(self):
        return f"BSP(bucket_mb={self.bucket_mb:g})"

    def build(self, ctx: Context) -> "BSPMode":
        return BSPMode(self, ctx)


class BSPMode(Mode):
    grad_is_average = True
    ready_unreached_early = True

    def __init__(self, options: BSP, ctx: Context, meter=None):
        """``meter``: an ``osp.meter.Meter`` (OSP's ``auto`` at every block critical runs these steps and keeps
        measuring them): told of the buckets and waits, its figures ride on the step's agreement, and
        ``agreed`` holds the sum."""
        super().__init__(options, ctx)
        self.buckets = Buckets(ctx.groups, options.bucket_mb, ctx.comm, f"{ctx.prefix}.bsp", wire=ctx.wire)
        self.meter, self.agreed = meter, None
        self.buckets.meter = meter
        self._present = Agreement(ctx, "bsp.present", fields=meter.fields if meter is not None else ())
        self._synced = None  # seconds the averaging took, once it finished for the coming step
        self._absent = [set() for _ in ctx.groups]  # per flat group: its parameters without a gradient anywhere

    def on_ready(self, p):
        self.buckets.on_ready(p)

    def end_backward(self):
        self.synchronize()

    def restart(self):
        self.buckets.wait(self.buckets.launched, self.ctx.timeout, "gradient allreduce")
        self.buckets.reset()
        self._synced = None

    @property
    def in_flight(self):
        return self.buckets.in_flight and self._synced is None

    @property
    def exact(self):
        return True  # what is in flight is this step's gradients: the parameters are the last exact update

    @traced("osp.bsp.allreduce")
    def synchronize(self) -> None:
        """Finish averaging (the buckets not started yet count missing gradients as zeros) and learn
        which parameters have a gradient on no rank: those get ``grad = None``, so the update leaves
        them alone, as ``torch.optim`` does."""
        if self._synced is not None:
            return
        t0 = time.perf_counter()
        ctx = self.ctx
        handles = list(self.buckets.launch(force=True))
        handles.append(self._present.post(**(self.meter.figures() if self.meter is not None else {})))
        self.buckets.wait(handles, ctx.timeout, "gradient allreduce")
        ctx.scale_grads(ctx.postscale)  # gradient_predivide_factor: the sum was of gradients / factor
        self.agreed = self._present.result("gradient allreduce")
        self._absent = self.agreed.absent()
        for fg, a in zip(ctx.groups, self._absent):
            fg.set_grads(a)
        self._synced = time.perf_counter() - t0
        if self.meter is not None:
            self.meter.waited(self._synced)

    def step(self, inp: StepInput):
        rec = {"critical_fraction": 1.0, "bytes_stage1": self.ctx.nbytes, "bytes_stage2": 0,
               "stage2_wait_s": 0.0}
        self.synchronize()
        rec["stage1_s"] = self._synced
        self._synced = None
        self.buckets.reset()
        # after averaging every rank holds the same values, so all ranks decide alike
        if self.ctx.any_nonfinite():
            rec["skipped"] = True
            return rec
        if inp.clip is not None:  # osp.HSP(sync=...) hands it here; the optimizer clips the average itself
            self.ctx.clip_(inp.clip, absent=self._absent)
        opt = self.ctx.optimizer
        if inp.amp is not None:  # a fused optimizer unscales (and checks) the average itself
            opt.grad_scale, opt.found_inf = inp.amp
        try:
            unhooked_step(opt)
        finally:
            if inp.amp is not None:
                del opt.grad_scale, opt.found_inf
        return rec
