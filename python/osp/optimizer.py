"""The distributed optimizer: BSP and OSP (two-stage synchronization with exact LGP correction).

See DESIGN.md for the algorithm. ``DistributedOptimizer`` wraps any ``torch.optim`` optimizer the way
``horovod.torch.DistributedOptimizer`` does; switching is two lines::

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = osp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=osp.OSP())
"""
from __future__ import annotations

import time
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from . import ops, sidechannel
from .comm import Comm, get_comm
from .layout import FlatGroup
from .policy import Budget, select_critical

_FAST_KINDS = {torch.optim.SGD: "sgd", torch.optim.Adam: "adam", torch.optim.AdamW: "adam"}
_STATE_KEYS = {"sgd": ("momentum_buffer",), "adam": ("exp_avg", "exp_avg_sq")}
_CHECK_BLOCK = 1 << 16  # elements per block of the non-finite scan (spreads it over threads and CUDA blocks)
_MAX_BLOCK = 1 << 30


class BSP:
    """Bulk-synchronous parallel: every gradient element is averaged before the update (the
    baseline; matches ``horovod.torch.DistributedOptimizer``). Gradients are averaged in buckets of
    about ``bucket_mb`` MiB, each started during backward as soon as its gradients are ready."""

    name = "bsp"

    def __init__(self, bucket_mb: float = 25.0):
        if not (isinstance(bucket_mb, (int, float)) and bucket_mb > 0):
            raise ValueError(f"osp: BSP(bucket_mb) must be a positive number, got {bucket_mb!r}")
        self.bucket_mb = float(bucket_mb)

    def __repr__(self):
        return f"BSP(bucket_mb={self.bucket_mb:g})"


class OSP:
    """Two-stage synchronization. Each step the ``critical`` share of gradient blocks (the most
    important by ``metric``) is averaged before the update; the rest is averaged in the background
    while the next forward/backward runs, moved meanwhile by this rank's own gradient and corrected
    exactly when the average arrives (LGP).

    Args:
        critical: share of blocks averaged in stage 1, in [0, 1], or ``"auto"``: defer as much as the
            measured bandwidth can move in the measured time stage 2 has before the next step waits
            for it (the next forward/backward and the rest of this step). ``1.0`` is BSP.
        min_critical: floor on the critical share (the most important blocks always go first).
        metric: block importance, ``"l2"``, ``"l1"``, ``"max"`` or ``"relative"`` (|g| / |w|).
        block_size: elements per block.
        warmup: with ``"auto"``, steps run fully critical first to measure the network.
    """

    name = "osp"

    def __init__(self, critical=0.25, min_critical: float = 0.05, metric: str = "l2",
                 block_size: int = 4096, warmup: int = 2):
        if critical != "auto":
            if isinstance(critical, bool) or not isinstance(critical, (int, float)) or not (
                    0.0 <= float(critical) <= 1.0):
                raise ValueError(f"osp: OSP(critical) must be a number in [0, 1] or 'auto', got {critical!r}")
            critical = float(critical)
        if isinstance(min_critical, bool) or not isinstance(min_critical, (int, float)) or not (
                0.0 <= float(min_critical) <= 1.0):
            raise ValueError(f"osp: OSP(min_critical) must be a number in [0, 1], got {min_critical!r}")
        if metric not in ops.METRICS:
            raise ValueError(f"osp: OSP(metric) must be one of {sorted(ops.METRICS)}, got {metric!r}")
        if isinstance(block_size, bool) or not isinstance(block_size, int) or not 0 < block_size <= _MAX_BLOCK:
            raise ValueError(f"osp: OSP(block_size) must be an integer in [1, 2**30], got {block_size!r}")
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"osp: OSP(warmup) must be a non-negative integer, got {warmup!r}")
        self.critical, self.min_critical, self.metric = critical, float(min_critical), metric
        self.block_size, self.warmup = block_size, warmup

    def __repr__(self):
        return (f"OSP(critical={self.critical!r}, min_critical={self.min_critical:g}, "
                f"metric={self.metric!r}, block_size={self.block_size}, warmup={self.warmup})")


@dataclass
class _Deferred:
    """Stage 2 of one flat group for one step: what the exact update of its deferred blocks needs."""
    fg: FlatGroup
    mask: torch.Tensor  # critical blocks of that step
    handle: Any  # the in-flight allreduce of the packed deferred gradient
    fast: bool
    lo: int = 0  # first block of this flat group in the optimizer's score vector
    param: Optional[torch.Tensor] = None  # fast path: packed snapshot of the deferred blocks
    state: Dict[str, Optional[torch.Tensor]] = field(default_factory=dict)
    hyper: Dict[str, Any] = field(default_factory=dict)
    # generic path: whole-parameter snapshots and the step's gradient (critical blocks averaged)
    touched: List[int] = field(default_factory=list)
    param_snap: Dict[int, torch.Tensor] = field(default_factory=dict)
    state_snap: Dict[int, Optional[dict]] = field(default_factory=dict)
    grad: Optional[torch.Tensor] = None


def _by_value(v):
    if torch.is_tensor(v):
        return v.detach().clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_by_value(x) for x in v)
    return v


def _hyper(group: dict) -> dict:
    """The group's hyper-parameters by value: a tensor lr that a scheduler updates in place must not
    change the snapshot the correction of this step uses."""
    return {k: _by_value(v) for k, v in group.items() if k != "params"}


def _unhooked_step(optimizer: torch.optim.Optimizer) -> None:
    """The wrapped optimizer's own step, without the step hooks torch.optim wraps around it: the hooks
    run once per ``DistributedOptimizer.step()``, not for each local update or correction."""
    step = type(optimizer).step
    if getattr(step, "hooked", False):
        step = step.__wrapped__
    step(optimizer)


def _clone_state(st: Optional[dict]) -> Optional[dict]:
    if not st:
        return None
    return {k: (v.detach().clone() if torch.is_tensor(v) else v) for k, v in st.items()}


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that every step synchronizes gradients across ranks with ``sync``.

    Args:
        optimizer: any ``torch.optim`` optimizer (per-parameter state; LBFGS-style closures are not
            supported). SGD, Adam and AdamW get fused correction kernels; others the generic path.
        named_parameters: ``model.named_parameters()``, for error messages and the cross-rank check;
            every parameter of ``optimizer`` must be named once.
        sync: ``osp.OSP(...)`` (default) or ``osp.BSP()``.
        backend: ``"auto"`` (Horovod when initialized, else torch.distributed), ``"horovod"``,
            ``"torch"`` or a ``osp.comm.Comm``.
        backward_passes_per_step: backward passes accumulated locally before each step.
        timeout: seconds a collective may take before the step raises ``TimeoutError`` (a peer that
            died or stalled), instead of hanging.

    Parameters are moved into one flat buffer per param group and dtype (they become views into it);
    gradients too. All ranks must build the optimizer with the same parameters (checked here).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, sync=None,
                 backend="auto", backward_passes_per_step: int = 1, timeout: float = 600.0):
        # Composition, not Optimizer.__init__: the wrapped optimizer owns param_groups and state.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"osp: expected a torch.optim.Optimizer to wrap, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("osp: the optimizer is already a DistributedOptimizer")
        sync = OSP() if sync is None else sync
        if not isinstance(sync, (BSP, OSP)):
            raise TypeError(f"osp: sync must be osp.BSP() or osp.OSP(...), got {sync!r}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"osp: backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        if not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"osp: timeout must be a positive number of seconds, got {timeout!r}")
        self.optimizer, self.sync, self.timeout = optimizer, sync, float(timeout)
        self.backward_passes_per_step = backward_passes_per_step
        # step hooks registered on either object run once per step() (the wrapper's, with torch.optim's
        # global ones): the wrapper shares the wrapped optimizer's dicts and steps it without hooks
        self._optimizer_step_pre_hooks = optimizer._optimizer_step_pre_hooks
        self._optimizer_step_post_hooks = optimizer._optimizer_step_post_hooks
        for name in ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks",
                     "_optimizer_load_state_dict_pre_hooks", "_optimizer_load_state_dict_post_hooks"):
            setattr(self, name, OrderedDict())
        self._patch_step_function()
        self.comm: Comm = get_comm(backend)
        names = self._names(named_parameters)
        self._check_same_everywhere(names)
        self._build_groups(names)
        self._group_shape = self._param_group_shape()
        self.fast = _FAST_KINDS.get(type(optimizer))
        self._fresh = False  # a backward ran since the last step
        self._passes: Dict[torch.nn.Parameter, int] = {}
        self._pending: List[_Deferred] = []
        self._scores: Optional[torch.Tensor] = None  # block scores of the last averaged gradient
        self._window: Optional[float] = None  # seconds the last stage 2 had before it was awaited
        self._s2_launched = 0.0
        self._t_end: Optional[float] = None
        self._bw_sample = 0.0
        self._skip_sync = False
        self._synced = False
        self._on_synced = None  # test hook: called when replicas must be bitwise equal (I1)
        self._history: List[dict] = []
        self._totals = {"steps": 0, "skipped_steps": 0}
        if isinstance(sync, OSP):
            self.budget = Budget(sync.critical, sync.min_critical, warmup=sync.warmup)
            dev = self.groups[0].param.device
            self._side = torch.zeros(len(sidechannel.FIELDS), dtype=torch.float32, device=dev)
            self._side_own = torch.zeros_like(self._side)
            self._mask = torch.ones(self.nblocks, dtype=torch.bool, device=dev)
            self._checksum = sidechannel.MaskChecksum(self.nblocks, dev)
        else:
            self._make_buckets()
        # the hooks hold the optimizer weakly: a dropped optimizer must not keep reacting to backward
        # (e.g. starting collectives) when the model is wrapped again
        ref = weakref.WeakMethod(self._on_grad)

        def hook(p, ref=ref):
            fn = ref()
            if fn is not None:
                fn(p)

        self._hooks = [p.register_post_accumulate_grad_hook(hook) for fg in self.groups for p in fg.params]

    def __del__(self):
        for h in getattr(self, "_hooks", ()):
            h.remove()

    # -- torch.optim.Optimizer surface (LR schedulers, step hooks) ----------------------------
    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self):
        return self.optimizer.defaults

    def __repr__(self):
        return f"osp.DistributedOptimizer({self.sync!r}, backend={self.comm.name!r}, {self.optimizer!r})"

    def __getstate__(self):
        raise TypeError("osp: a DistributedOptimizer cannot be pickled; save state_dict() instead")

    def add_param_group(self, param_group: dict) -> None:
        raise RuntimeError("osp: add_param_group() after wrapping is not supported: osp moves each param "
                           "group's parameters into flat buffers at construction. Add every group to the "
                           "optimizer before wrapping it")

    def _param_group_shape(self):
        return tuple(len(g["params"]) for g in self.optimizer.param_groups)

    def _check_param_groups(self) -> None:
        # params added to the wrapped optimizer after wrapping would have no flat buffer and no hook
        # and be stepped with this rank's own gradient: the replicas would diverge
        if self._param_group_shape() != self._group_shape:
            raise RuntimeError(
                f"osp: the wrapped optimizer's param groups changed after wrapping (parameters per group "
                f"{list(self._group_shape)} then, {list(self._param_group_shape())} now, e.g. by "
                "add_param_group()); build the optimizer with all its parameters before wrapping it")

    # -- construction -------------------------------------------------------------------------
    def _names(self, named_parameters) -> Dict[torch.nn.Parameter, str]:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if len({id(p) for p in params}) != len(params):
            raise ValueError("osp: a parameter appears more than once in the optimizer's param_groups")
        if named_parameters is None:
            return {p: f"group{gi}.param{i}" for gi, g in enumerate(self.optimizer.param_groups)
                    for i, p in enumerate(g["params"])}
        named = list(named_parameters)
        if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
            raise ValueError("osp: named_parameters must be (name, parameter) pairs, e.g. "
                             "model.named_parameters()")
        seen: Dict[str, int] = {}
        for n, _ in named:
            seen[n] = seen.get(n, 0) + 1
        dups = sorted(n for n, c in seen.items() if c > 1)
        if dups:
            raise ValueError(f"osp: parameter names must be unique, got duplicates {dups}")
        by_id = {id(p): n for n, p in named}
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"osp: {len(missing)} parameter(s) of the optimizer are not in "
                             "named_parameters; pass model.named_parameters() of the same model")
        return {p: by_id[id(p)] for p in params}

    def _check_same_everywhere(self, names) -> None:
        """Every rank must wrap the same parameters with the same options: compare signatures with
        one allgather, and raise the same error on every rank (never hang, never diverge)."""
        sig = {"sync": repr(self.sync), "bpps": self.backward_passes_per_step,
               "params": [(gi, names[p], tuple(p.shape), str(p.dtype), p.requires_grad)
                          for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]]}
        sigs = self.comm.allgather_object(sig)
        for r, other in enumerate(sigs):
            if other == sigs[0]:
                continue
            if other["sync"] != sigs[0]["sync"] or other["bpps"] != sigs[0]["bpps"]:
                raise ValueError(f"osp: ranks disagree on the options: rank 0 has {sigs[0]['sync']}, "
                                 f"rank {r} has {other['sync']}")
            a, b = sigs[0]["params"], other["params"]
            for x, y in zip(a, b):
                if x != y:
                    raise ValueError(f"osp: ranks disagree on the parameters: rank 0 has {x[1]!r} "
                                     f"shape {list(x[2])} {x[3]}, rank {r} has {y[1]!r} shape "
                                     f"{list(y[2])} {y[3]} (group {x[0]})")
            raise ValueError(f"osp: ranks disagree on the parameters: rank 0 has {len(a)} "
                             f"parameters, rank {r} has {len(b)}")

    def _build_groups(self, names) -> None:
        devices = {p.device for g in self.optimizer.param_groups for p in g["params"]}
        if len(devices) > 1:
            raise ValueError(f"osp: all parameters must be on one device, got {sorted(map(str, devices))}")
        bs = self.sync.block_size if isinstance(self.sync, OSP) else None
        self.groups: List[FlatGroup] = []
        for gi, g in enumerate(self.optimizer.param_groups):
            by_dtype: Dict[torch.dtype, list] = {}
            for p in g["params"]:
                if not p.requires_grad:
                    continue
                if p.dtype not in ops.DTYPES:
                    raise ValueError(f"osp: parameter {names[p]!r} is {p.dtype}; osp handles "
                                     "float32, float16 and bfloat16 parameters")
                self.comm.check_dtype(p.dtype, f"parameter {names[p]!r}")
                by_dtype.setdefault(p.dtype, []).append(p)
            for ps in by_dtype.values():
                self.groups.append(FlatGroup(ps, [names[p] for p in ps], gi, bs))
        if not self.groups:
            raise ValueError("osp: the optimizer has no trainable parameter (every parameter has "
                             "requires_grad=False); there is nothing to synchronize")
        self._group_of = {p: fg for fg in self.groups for p in fg.params}
        self.nblocks = sum(fg.nblocks for fg in self.groups)
        self.nbytes = sum(fg.padded * fg.param.element_size() for fg in self.groups)

    def _make_buckets(self) -> None:
        """BSP buckets: runs of consecutive parameters (in reverse order, as backward produces
        them) of about bucket_mb; each is a contiguous slice of its flat gradient."""
        limit = int(self.sync.bucket_mb * (1 << 20))
        self.buckets = []  # (fg, lo, hi, params)
        for fg in self.groups:
            cur, lo, hi = [], None, None
            for i in reversed(range(len(fg.params))):
                p, o = fg.params[i], fg.offsets[i]
                if cur and (hi - o) * p.element_size() > limit:
                    self.buckets.append((fg, lo, hi, cur))
                    cur = []
                if not cur:
                    hi = fg.padded if i == len(fg.params) - 1 else o + p.numel()
                cur.append(p)
                lo = 0 if i == 0 else o
            if cur:
                self.buckets.append((fg, lo, hi, cur))
        self._bucket_of = {p: b for b, (_, _, _, ps) in enumerate(self.buckets) for p in ps}
        self._reset_buckets()

    def _reset_buckets(self):
        self._ready = [0] * len(self.buckets)
        self._launched: List[Any] = []

    # -- backward hooks ---------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        self._fresh = True
        if not isinstance(self.sync, BSP):
            return
        n = self._passes.get(p, 0) + 1
        self._passes[p] = n
        if n > self.backward_passes_per_step:
            # its bucket's allreduce may already be in flight: adding into it would differ per rank
            raise RuntimeError(
                f"osp: gradients were computed {n} times before step(), more than backward_passes_per_step="
                f"{self.backward_passes_per_step}; raise backward_passes_per_step to accumulate gradients "
                "locally, or call step() after each backward")
        if n == self.backward_passes_per_step:
            b = self._bucket_of[p]
            self._ready[b] += 1
            self._launch_ready()

    def _launch_ready(self, force: bool = False) -> None:
        # buckets start strictly in order, so every rank issues the same collectives in the same order
        while len(self._launched) < len(self.buckets):
            b = len(self._launched)
            fg, lo, hi, ps = self.buckets[b]
            if not force and self._ready[b] < len(ps):
                return
            fg.gather_grads(ps)
            self._launched.append(self.comm.allreduce_avg_async_(fg.grad[lo:hi], f"osp.bsp.{b}"))

    # -- public API -------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients. They stay views into the flat gradient buffer (``set_to_none`` is
        accepted for compatibility; a cleared view costs nothing and saves a copy next step)."""
        if isinstance(self.sync, BSP) and self._launched:
            raise RuntimeError("osp: zero_grad() while gradient averaging is in flight: call step() "
                               "(or synchronize()) first")
        for fg in self.groups:
            fg.zero_grad()

    def synchronize(self) -> None:
        """BSP: finish averaging the gradients now (e.g. to clip them), then call ``step()`` inside
        ``skip_synchronize()``. Horovod's contract."""
        if not isinstance(self.sync, BSP):
            raise RuntimeError("osp: synchronize() is for BSP; with OSP the gradient a step applies "
                               "is only known inside step()")
        self._check_fresh()
        t0 = time.perf_counter()
        self._launch_ready(force=True)
        for h in self._launched:
            self.comm.wait(h, self.timeout, "gradient allreduce")
        self._reset_buckets()
        self._passes.clear()
        self._synced = True
        self._sync_s = time.perf_counter() - t0

    @contextmanager
    def skip_synchronize(self):
        self._skip_sync = True
        try:
            yield
        finally:
            self._skip_sync = False

    def _check_fresh(self):
        if not self._fresh:
            raise RuntimeError("osp: step() called without a backward pass since the last step(); "
                               "every step needs new gradients (call loss.backward() first)")

    @torch.no_grad()
    def step(self, closure=None):
        """One synchronized step (see the class docstring). ``closure`` is not supported."""
        if closure is not None:
            raise ValueError("osp: step(closure) is not supported; call loss.backward() then step()")
        self._check_param_groups()
        t0 = time.perf_counter()
        compute = (t0 - self._t_end) if self._t_end is not None else 0.0
        if isinstance(self.sync, BSP):
            rec = self._bsp_step()
        else:
            self._check_fresh()
            rec = self._osp_step(compute)
        self._fresh = False
        self._passes.clear()
        t1 = time.perf_counter()
        rec.update(compute_s=compute, step_s=t1 - t0)
        self._record(rec)
        self._t_end = t1

    def _record(self, rec):
        self._totals["steps"] += 1
        self._totals["skipped_steps"] += int(rec.get("skipped", False))
        self._history.append(rec)
        if len(self._history) > 100000:
            del self._history[:50000]

    def stats(self) -> dict:
        """Per-step records (critical fraction, bytes in each stage, stage-1 time, stage-2 wait,
        compute time between steps, whole step time, skipped) and totals."""
        hist = list(self._history)
        def mean(k):
            vals = [h[k] for h in hist if k in h]
            return sum(vals) / len(vals) if vals else 0.0
        return {"steps": self._totals["steps"], "skipped_steps": self._totals["skipped_steps"],
                "mode": self.sync.name, "history": hist,
                "mean": {k: mean(k) for k in ("critical_fraction", "bytes_stage1", "bytes_stage2",
                                              "stage1_s", "stage2_wait_s", "compute_s", "step_s")}}

    def _nonfinite(self) -> torch.Tensor:
        """How many flat gradients hold an inf or nan (a device tensor: no sync)."""
        return sum(ops.score_blocks(fg.grad, _CHECK_BLOCK, "max")[1].sum() for fg in self.groups)

    def _skip(self, rec):
        warnings.warn("osp: non-finite gradient on some rank; step skipped on every rank",
                      RuntimeWarning, stacklevel=3)
        rec["skipped"] = True
        return rec

    # -- BSP --------------------------------------------------------------------------------------
    def _bsp_step(self) -> dict:
        rec = {"critical_fraction": 1.0, "bytes_stage1": self.nbytes, "bytes_stage2": 0, "stage2_wait_s": 0.0}
        if self._skip_sync and self._synced:
            rec["stage1_s"] = self._sync_s
        else:
            self.synchronize()
            rec["stage1_s"] = self._sync_s
        self._synced = False
        # after averaging every rank holds the same values, so all ranks decide alike
        if sidechannel.read(self._nonfinite().reshape(1))[0]:
            return self._skip(rec)
        _unhooked_step(self.optimizer)
        return rec

    # -- OSP --------------------------------------------------------------------------------------
    def _select(self) -> List[int]:
        """Fill ``self._mask`` with this step's critical blocks and return how many each flat group
        has. The split comes from the block scores of the previous step's averaged gradient, which
        every rank holds bitwise alike (no collective; the first step is fully critical). Each flat
        group gets its own quota, so the counts are known on the host without a device sync."""
        if self._scores is None:
            self._mask.fill_(True)
            return [fg.nblocks for fg in self.groups]
        counts, lo = [], 0
        for fg in self.groups:
            k = self.budget.count(fg.nblocks)
            self._mask[lo:lo + fg.nblocks] = select_critical(self._scores[lo:lo + fg.nblocks], k)
            counts.append(k)
            lo += fg.nblocks
        return counts

    def _osp_step(self, compute: float) -> dict:
        for fg in self.groups:
            fg.gather_grads()
        wait_s = self._finish_deferred()
        if self._on_synced is not None:
            self._on_synced(self)
        counts = self._select()
        # the time stage 2 had to hide in: from its launch to this step's wait for it (the compute
        # between steps plus the rest of the previous step); before any stage 2, the compute alone
        window = self._window if self._window is not None else compute
        sidechannel.encode(self._side, self._nonfinite(), self._bw_sample, window, wait_s,
                           self._checksum(self._mask))
        self._side_own.copy_(self._side)
        # stage 1: the side channel and the critical blocks, averaged before the update
        t1 = time.perf_counter()
        side_h = self.comm.allreduce_sum_async_(self._side, "osp.side")
        work, lo = [], 0
        for gi, (fg, kc) in enumerate(zip(self.groups, counts)):
            m = self._mask[lo:lo + fg.nblocks]
            crit = fg.workspace("crit", kc * fg.block_size)
            deferred = fg.workspace("deferred", (fg.nblocks - kc) * fg.block_size)
            ops.split_blocks(fg.grad, m, fg.block_size, crit, deferred)
            work.append((fg, m, kc, lo, crit, deferred, self.comm.allreduce_avg_async_(crit, f"osp.s1.{gi}")))
            lo += fg.nblocks
        b1 = b2 = 0
        for _, _, _, _, crit, _, h in work:
            self.comm.wait(h, self.timeout, "stage-1 allreduce")
            b1 += crit.numel() * crit.element_size()
        self.comm.wait(side_h, self.timeout, "stage-1 allreduce")
        stage1 = time.perf_counter() - t1
        side = sidechannel.decode(self._side, self._side_own, self.comm.size, self._totals["steps"] + 1)
        rec = {"stage2_wait_s": wait_s, "stage1_s": stage1}
        if side.nonfinite:
            rec.update(critical_fraction=0.0, bytes_stage1=b1, bytes_stage2=0)
            return self._skip(rec)
        self.budget.update(self.nbytes, side.bandwidth, side.window, side.wait)
        if self._scores is None:
            self._scores = torch.zeros(self.nblocks, dtype=torch.float32, device=self._mask.device)
        for fg, m, _, lo, crit, _, _ in work:
            ops.merge_blocks(crit, None, m, fg.block_size, fg.grad)
            self._set_scores(crit, fg, m, lo)
        # stage 2: deferred blocks, averaged in the background; snapshot what their exact update needs
        for gi, (fg, m, kc, lo, _, deferred, _) in enumerate(work):
            if deferred.numel() == 0:
                continue
            b2 += deferred.numel() * deferred.element_size()
            d = self._snapshot(fg, m, kc)
            d.lo = lo
            d.handle = self.comm.allreduce_avg_async_(deferred, f"osp.s2.{gi}")
            self._pending.append(d)
            self._s2_launched = time.perf_counter()
        # LGP: the local update with the provisional gradient (averaged on critical blocks, this
        # rank's own on deferred ones)
        _unhooked_step(self.optimizer)
        if self.fast:
            for fg in self.groups:
                fg.adopt_state(self.optimizer.state, self._state_keys(fg))
        if stage1 > 0 and b1 >= 0.25 * self.nbytes:
            self._bw_sample = b1 / stage1
        rec.update(critical_fraction=b1 / max(self.nbytes, 1), bytes_stage1=b1, bytes_stage2=b2)
        return rec

    def _set_scores(self, buf: torch.Tensor, fg: FlatGroup, mask: torch.Tensor, lo: int) -> None:
        """Score the blocks packed in ``buf`` (those where ``mask`` is set) and store them in their
        places of the score vector (a merge with one-element blocks: no device sync). With
        ``relative``, |w| is read from the parameters as they are now, which must be bitwise equal on
        every rank: call only where the replicas are."""
        w = None
        if self.sync.metric == "relative":
            w = torch.empty_like(buf)
            ops.split_blocks(fg.param, mask, fg.block_size, w, None)
        scores = ops.score_blocks(buf, fg.block_size, self.sync.metric, param=w)[0]
        ops.merge_blocks(scores, None, mask, 1, self._scores[lo:lo + fg.nblocks])

    def _state_keys(self, fg: FlatGroup):
        keys = _STATE_KEYS[self.fast]
        group = self.optimizer.param_groups[fg.group_index]
        if self.fast == "sgd" and not group.get("momentum", 0):
            return ()
        if self.fast == "adam" and group.get("amsgrad", False):
            keys = keys + ("max_exp_avg_sq",)
        return keys

    def _fast_ok(self, fg: FlatGroup) -> bool:
        if not self.fast:
            return False
        group = self.optimizer.param_groups[fg.group_index]
        if group.get("differentiable") or group.get("capturable"):
            return False
        if self.fast == "adam":
            steps = {float(self.state[p]["step"]) if self.state.get(p) else 0.0 for p in fg.params}
            if len(steps) != 1:
                return False
        return True

    def _snapshot(self, fg: FlatGroup, mask: torch.Tensor, ncrit: int) -> _Deferred:
        group = self.optimizer.param_groups[fg.group_index]
        fast = self._fast_ok(fg)
        d = _Deferred(fg=fg, mask=mask, handle=None, fast=fast, hyper=_hyper(group))
        if fast:
            n_def = (fg.nblocks - ncrit) * fg.block_size
            d.param = fg.workspace("snap.param", n_def)
            ops.split_blocks(fg.param, mask, fg.block_size, None, d.param)
            have = all(self.state.get(p) for p in fg.params)
            for key in self._state_keys(fg):
                if have and key in fg.state:
                    buf = fg.workspace("snap." + key, n_def)
                    ops.split_blocks(fg.state[key], mask, fg.block_size, None, buf)
                    d.state[key] = buf
                else:
                    d.state[key] = None  # no state before this step (its first)
            if self.fast == "adam":
                p0 = fg.params[0]
                d.hyper["_step"] = (float(self.state[p0]["step"]) if self.state.get(p0) else 0.0) + 1
        else:
            d.touched = fg.touched(~mask)
            for i in d.touched:
                p = fg.params[i]
                d.param_snap[i] = p.detach().clone()
                d.state_snap[i] = _clone_state(self.state.get(p))
            d.grad = fg.workspace("snap.grad", fg.padded).copy_(fg.grad)
        return d

    def _finish_deferred(self) -> float:
        """Wait for the previous step's stage 2 and replace the provisional update of its deferred
        blocks by the exact one. Afterwards every rank holds bitwise the same parameters and state."""
        if not self._pending:
            return 0.0
        t0 = time.perf_counter()
        self._window = t0 - self._s2_launched
        for d in self._pending:
            self.comm.wait(d.handle, self.timeout, "stage-2 allreduce")
        wait = time.perf_counter() - t0
        generic = [d for d in self._pending if not d.fast]
        for d in self._pending:
            if d.fast:
                self._correct_fast(d)
        if generic:
            self._correct_generic(generic)
        # scored after the corrections: with "relative", |w| must be the exact (shared) parameters,
        # not this rank's provisional ones, or ranks would pick different blocks next step
        for d in self._pending:
            self._set_scores(d.handle.tensor, d.fg, ~d.mask, d.lo)
        self._pending = []
        return wait

    def _correct_fast(self, d: _Deferred) -> None:
        fg, h, avg = d.fg, d.hyper, d.handle.tensor
        bs = fg.block_size
        if self.fast == "sgd":
            mom = d.state.get("momentum_buffer")
            first = h.get("momentum", 0) != 0 and mom is None
            if first:
                mom = torch.empty_like(d.param)
            ops.sgd_step_(d.param, avg, mom if h.get("momentum", 0) else None, lr=float(h["lr"]),
                          momentum=h["momentum"], dampening=h["dampening"],
                          weight_decay=h["weight_decay"], nesterov=h["nesterov"],
                          maximize=h.get("maximize", False), first=first)
            if h.get("momentum", 0):
                ops.merge_blocks(None, mom, d.mask, bs, fg.state["momentum_buffer"])
        else:
            zeros = lambda: torch.zeros_like(d.param)  # noqa: E731 - Adam's state starts at zero
            ea = d.state["exp_avg"] if d.state["exp_avg"] is not None else zeros()
            es = d.state["exp_avg_sq"] if d.state["exp_avg_sq"] is not None else zeros()
            amsgrad = h.get("amsgrad", False)
            mx = None
            if amsgrad:
                mx = d.state["max_exp_avg_sq"] if d.state["max_exp_avg_sq"] is not None else zeros()
            beta1, beta2 = h["betas"]
            decoupled = isinstance(self.optimizer, torch.optim.AdamW) or h.get("decoupled_weight_decay", False)
            ops.adam_step_(d.param, avg, ea, es, mx, step=h["_step"], lr=float(h["lr"]), beta1=float(beta1),
                           beta2=float(beta2), eps=h["eps"], weight_decay=h["weight_decay"],
                           amsgrad=amsgrad, maximize=h.get("maximize", False), decoupled=decoupled)
            ops.merge_blocks(None, ea, d.mask, bs, fg.state["exp_avg"])
            ops.merge_blocks(None, es, d.mask, bs, fg.state["exp_avg_sq"])
            if amsgrad:
                ops.merge_blocks(None, mx, d.mask, bs, fg.state["max_exp_avg_sq"])
        ops.merge_blocks(None, d.param, d.mask, bs, fg.param)

    def _correct_generic(self, pending: List[_Deferred]) -> None:
        """Any optimizer: restore the touched parameters and their state, and step the wrapped
        optimizer again on just those parameters with the exact (fully averaged) gradient, under the
        hyper-parameters of the step being corrected."""
        all_params = [p for g in self.optimizer.param_groups for p in g["params"]]
        saved_grads = [p.grad for p in all_params]
        saved_hyper = [_hyper(g) for g in self.optimizer.param_groups]
        try:
            for p in all_params:
                p.grad = None
            for d in pending:
                fg = d.fg
                ops.merge_blocks(None, d.handle.tensor, d.mask, fg.block_size, d.grad)
                self.optimizer.param_groups[fg.group_index].update(d.hyper)
                for i in d.touched:
                    p = fg.params[i]
                    p.copy_(d.param_snap[i])
                    snap = d.state_snap[i]
                    if snap is None:
                        self.state.pop(p, None)
                    else:
                        st = self.state[p]
                        for k in list(st):
                            if k not in snap:
                                del st[k]
                        for k, v in snap.items():
                            if torch.is_tensor(v) and torch.is_tensor(st.get(k)) and st[k].shape == v.shape:
                                st[k].copy_(v)
                            else:
                                st[k] = v
                    p.grad = fg.view(d.grad, i)
            _unhooked_step(self.optimizer)
        finally:
            for p, g in zip(all_params, saved_grads):
                p.grad = g
            for g, h in zip(self.optimizer.param_groups, saved_hyper):
                g.update(h)

    @torch.no_grad()
    def flush(self) -> None:
        """Finish all in-flight work and apply the exact updates: call on every rank before
        evaluating, checkpointing or stopping. Afterwards replicas are bitwise equal."""
        if isinstance(self.sync, BSP):
            return
        self._finish_deferred()
        if self._on_synced is not None:
            self._on_synced(self)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus osp's own. Call ``flush()`` (on every rank) first."""
        if self._pending:
            raise RuntimeError("osp: state_dict() with stage-2 work in flight: call flush() on every "
                               "rank first, so the state holds exact updates")
        out = {"optimizer": self.optimizer.state_dict(), "osp": {"sync": repr(self.sync)}}
        if isinstance(self.sync, OSP):
            out["osp"]["budget"] = self.budget.state_dict()
            # the next split is chosen from these: needed to resume bitwise
            out["osp"]["scores"] = None if self._scores is None else self._scores.detach().cpu().clone()
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of this class, or a plain state dict of the wrapped optimizer
        (e.g. from a run with ``hvd.DistributedOptimizer``)."""
        if self._pending:
            raise RuntimeError("osp: load_state_dict() with stage-2 work in flight: call flush() first")
        if "optimizer" in state_dict and "osp" in state_dict:
            self.optimizer.load_state_dict(state_dict["optimizer"])
            if isinstance(self.sync, OSP) and "budget" in state_dict["osp"]:
                self.budget.load_state_dict(state_dict["osp"]["budget"])
                scores = state_dict["osp"].get("scores")
                if scores is not None and scores.numel() != self.nblocks:
                    raise ValueError(f"osp: the checkpoint's scores cover {scores.numel()} blocks, this "
                                     f"optimizer has {self.nblocks} (another model or block_size?)")
                self._scores = None if scores is None else scores.to(self.groups[0].param.device)
        else:
            self.optimizer.load_state_dict(state_dict)
        self._adopt_loaded_state()

    def _adopt_loaded_state(self) -> None:
        # loaded state tensors are new tensors: move them into the flat state buffers
        if self.fast:
            for fg in self.groups:
                if all(self.state.get(p) for p in fg.params):
                    fg.adopt_state(self.optimizer.state, self._state_keys(fg))


def broadcast_parameters(params, root_rank: int = 0, backend="auto") -> None:
    """Broadcast ``params`` (a ``state_dict()`` or ``named_parameters()``) from ``root_rank``, in
    place, as ``hvd.broadcast_parameters`` does."""
    comm = get_comm(backend)
    items = sorted(params.items()) if isinstance(params, dict) else list(params)
    for name, t in items:
        if torch.is_tensor(t):
            with torch.no_grad():
                comm.broadcast_(t.data if isinstance(t, torch.nn.Parameter) else t, root_rank,
                                f"osp.bcast.{name}")


def broadcast_optimizer_state(optimizer, root_rank: int = 0, backend="auto") -> None:
    """Make every rank's optimizer state (and hyper-parameters) equal to ``root_rank``'s."""
    comm = get_comm(backend)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    sd = comm.broadcast_object(inner.state_dict(), root_rank)
    inner.load_state_dict(sd)
    if isinstance(optimizer, DistributedOptimizer):
        optimizer._adopt_loaded_state()
