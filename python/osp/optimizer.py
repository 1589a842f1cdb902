"""The distributed optimizer: one ``torch.optim``-shaped wrapper, the synchronization in its mode.

See DESIGN.md for the algorithms. ``DistributedOptimizer`` wraps any ``torch.optim`` optimizer the way
``horovod.torch.DistributedOptimizer`` does; switching is two lines::

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = osp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=osp.OSP())

This module holds the surface (construction checks, flat groups, backward hooks, ``stats()``, the
checkpoint envelope); each mode's logic lives in ``osp/modes/<mode>.py``.
"""
from __future__ import annotations

import functools
import itertools
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Dict, List, Optional

import torch

from . import ops, teardown
from .comm import Comm, get_comm
from .layout import FlatGroup
from .modes.base import Context, Mode, Options, StepInput
from .modes.osp import OSP

_UIDS = itertools.count()  # optimizers built in this process: names their collectives apart


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` so that every step synchronizes gradients across ranks with ``sync``.

    Args:
        optimizer: any ``torch.optim`` optimizer (per-parameter state; LBFGS-style closures are not
            supported). SGD, Adam and AdamW get fused correction kernels; others the generic path.
        named_parameters: ``model.named_parameters()``, for error messages and the cross-rank check;
            every parameter of ``optimizer`` must be named once.
        sync: the mode and its options: ``osp.OSP(...)`` (default), ``osp.BSP()``, ``osp.DSync(...)`` or
            ``osp.HSP(...)``.
        backend: ``"auto"`` (Horovod when initialized, else torch.distributed), ``"horovod"``,
            ``"torch"`` or a ``osp.comm.Comm``.
        backward_passes_per_step: backward passes accumulated locally before each step.
        timeout: seconds a collective may take before the step raises ``TimeoutError`` (a peer that
            died or stalled), instead of hanging.
        on_synced: called with this optimizer wherever every rank holds bitwise the same parameters
            and optimizer state (after each step's exact corrections, and in ``flush()``); e.g. to
            checksum replicas. ``None``: nothing is called.

    Parameters are moved into one flat buffer per param group and dtype (they become views into it);
    gradients too. All ranks must build the optimizer with the same parameters (checked here; under
    Horovod Elastic by ``osp.elastic.State`` when it syncs).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, sync=None,
                 backend="auto", backward_passes_per_step: int = 1, timeout: float = 600.0,
                 on_synced: Optional[Callable[["DistributedOptimizer"], None]] = None):
        # Composition, not Optimizer.__init__: the wrapped optimizer owns param_groups and state.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"osp: expected a torch.optim.Optimizer to wrap, got {type(optimizer).__name__}")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("osp: the optimizer is already a DistributedOptimizer")
        sync = OSP() if sync is None else sync
        if not isinstance(sync, Options):
            raise TypeError(f"osp: sync must be osp.BSP(), osp.OSP(...), osp.DSync(...) or osp.HSP(...), "
                            f"got {sync!r}")
        if isinstance(backward_passes_per_step, bool) or not isinstance(backward_passes_per_step, int) \
                or backward_passes_per_step < 1:
            raise ValueError(f"osp: backward_passes_per_step must be an integer >= 1, got "
                             f"{backward_passes_per_step!r}")
        if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
            raise ValueError(f"osp: timeout must be a positive number of seconds, got {timeout!r}")
        if on_synced is not None and not callable(on_synced):
            raise TypeError(f"osp: on_synced must be callable or None, got {on_synced!r}")
        self.optimizer, self.sync, self.timeout = optimizer, sync, float(timeout)
        self.backward_passes_per_step = backward_passes_per_step
        self.on_synced = on_synced
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
        uid = next(_UIDS)
        self._signature = (names, uid)
        # under Horovod Elastic a rank may join while the others train, and no collective may run outside
        # hvd.elastic.run: osp.elastic.State's sync() runs this check on every rank, new ones too
        if not self.comm.elastic:
            self.check_world()
        self._build_groups(names)
        self._group_shape = self._param_group_shape()
        self._fresh = False  # a backward ran since the last step
        # the backward passes of the coming step: per parameter, how many reached it, and the version of
        # its gradient after the last one (a gradient zeroed or replaced since starts a new accumulation)
        self._where = {p: (fg, i) for fg in self.groups for i, p in enumerate(fg.params)}
        self._passes: Dict[torch.nn.Parameter, int] = {}
        self._seen: Dict[torch.nn.Parameter, int] = {}
        self._backwards = 0  # backward passes of the coming step that reached this optimizer
        self._averaged = False  # BSP: the step's last pass ended and .grad holds the average
        self._task: Optional[int] = None  # the autograd graph task this optimizer last saw
        self._versions: Optional[List[tuple]] = None  # (is its alias, version) of each gradient when the pass ended
        self._max_norm: Optional[float] = None  # clip_grad_norm_ asked for the coming step
        self._warned_grad_change = False
        self._in_extra = False  # HSP: a step(closure) micro-batch is running (its passes are extra)
        self._extra_passes = 0  # backward passes that ended inside such micro-batches
        self._closure_loss = None
        self._t_end: Optional[float] = None
        self._history: List[dict] = []
        self._totals = {"steps": 0, "skipped_steps": 0}
        ref = weakref.ref(self)
        gindex = {id(fg): k for k, fg in enumerate(self.groups)}
        self._order = [(gindex[id(self._where[p][0])], self._where[p][1]) for p in names if p in self._where]
        self._ctx = Context(optimizer=optimizer, groups=self.groups, comm=self.comm, timeout=self.timeout,
                            order=self._order,
                            on_synced=lambda ref=ref: ref()._synced_now(), prefix=f"osp{uid}")
        self.mode: Mode = sync.build(self._ctx)
        # the hooks hold the optimizer weakly: a dropped optimizer must not keep reacting to backward
        # (e.g. starting collectives) when the model is wrapped again
        grad_ref = weakref.WeakMethod(self._on_grad)

        def hook(p, ref=grad_ref):
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

    @property
    def nbytes(self) -> int:
        """Bytes of the flat gradients: what a step moves in all."""
        return self._ctx.nbytes

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
        # in the model's order: clipping sums the parameters' norms in the order torch's would take them
        position = {id(p): k for k, (_, p) in enumerate(named)}
        return {p: by_id[id(p)] for p in sorted(params, key=lambda p: position[id(p)])}

    def _check_same_everywhere(self, names, uid: int) -> None:
        """Every rank must wrap the same parameters with the same options: compare signatures with
        one allgather, and raise the same error on every rank (never hang, never diverge)."""
        sig = {"sync": repr(self.sync), "bpps": self.backward_passes_per_step, "uid": uid,
               "params": [(gi, names[p], tuple(p.shape), str(p.dtype), p.requires_grad)
                          for gi, g in enumerate(self.optimizer.param_groups) for p in g["params"]]}
        sigs = self.comm.allgather_object(sig)
        for r, other in enumerate(sigs):
            if other == sigs[0]:
                continue
            if other["sync"] != sigs[0]["sync"] or other["bpps"] != sigs[0]["bpps"]:
                raise ValueError(f"osp: ranks disagree on the options: rank 0 has {sigs[0]['sync']}, "
                                 f"rank {r} has {other['sync']}")
            if other["uid"] != sigs[0]["uid"]:
                raise ValueError(
                    f"osp: ranks built different numbers of osp optimizers before this one (rank 0 is at its "
                    f"optimizer {sigs[0]['uid']}, rank {r} at {other['uid']}); every rank must build the same "
                    "optimizers in the same order, as their collectives are matched by name")
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
        bs = self.sync.block_size
        self.groups: List[FlatGroup] = []
        self._outside = []  # (name, param): frozen when wrapped, so not synchronized
        for gi, g in enumerate(self.optimizer.param_groups):
            by_dtype: Dict[torch.dtype, list] = {}
            for p in g["params"]:
                if not p.requires_grad:
                    self._outside.append((names[p], p))
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

    # -- backward hooks ---------------------------------------------------------------------------
    def _on_grad(self, p: torch.Tensor) -> None:
        """A backward pass accumulated ``p``'s gradient."""
        task = torch._C._current_graph_task_id()
        if task != self._task:  # this backward's first gradient here: finish the pass when it ends
            self._task = task
            ref = weakref.ref(self)
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: ref() is not None and ref()._end_backward())
        self._fresh = True
        fg, i = self._where[p]
        alias, n = fg.grad_views[i], self._passes.get(p, 0)
        changed = n and (p.grad is not alias or alias._version != self._seen[p] + 1)
        if changed and self._in_extra:
            self._task = None
            raise RuntimeError(
                f"osp: the gradient of {fg.names[i]!r} was zeroed or replaced inside the closure passed to step(); "
                "an extra micro-batch must accumulate into .grad (no zero_grad() in the closure: the step's first "
                "micro-batch is already there)")
        if changed or (self._averaged and self._zeroed_since_averaging(p)):
            # zeroed, set to None or replaced since its last backward (e.g. a GAN's D.zero_grad() after
            # G's backward ran through D, or after D's average): the step's accumulation starts again
            self._restart()
            n = 0
        if p.grad is not alias and p.grad.layout == torch.strided:  # sparse ones raise in step()
            fg.gather_grads([p])
        fg.absent.discard(i)  # it has a gradient now (a bucket started before may have found none)
        n += 1
        # an extra micro-batch (HSP's step(closure)) adds to the step beyond backward_passes_per_step
        if n > self.backward_passes_per_step and not self._in_extra:
            self._task = None
            raise RuntimeError(
                f"osp: parameter {fg.names[i]!r} got a gradient from {n} backward passes since the last step(), "
                f"more than backward_passes_per_step={self.backward_passes_per_step}. Call step() after each "
                "backward, zero the gradients before the next one, or raise backward_passes_per_step to "
                "accumulate gradients locally")
        if self._averaged:
            self._task = None
            raise RuntimeError(
                f"osp: parameter {fg.names[i]!r} got a gradient from a backward pass after this step's gradients "
                f"were averaged (its backward_passes_per_step={self.backward_passes_per_step} pass(es) had "
                "ended). Sum the losses and call backward() once, raise backward_passes_per_step, or call "
                "step() first. (A backward re-entered inside another, as torch.utils.checkpoint(..., "
                "use_reentrant=True) does, ends a pass early: use use_reentrant=False.)")
        self._passes[p] = n
        self._seen[p] = alias._version
        if n == self.backward_passes_per_step and not self._in_extra:
            self.mode.on_ready(p)

    def _run_extra(self, closure) -> int:
        """One call of the user's ``closure`` (an extra micro-batch); returns its backward passes."""
        before = self._extra_passes
        self._in_extra = True
        try:
            with torch.enable_grad():
                self._closure_loss = closure()
        finally:
            self._in_extra = False
        passes = self._extra_passes - before
        if passes == 0:
            raise RuntimeError(
                f"osp: the closure passed to step() returned without a backward pass reaching this optimizer's "
                f"parameters (e.g. {self.groups[0].names[0]!r}); under HSP it must compute one more micro-batch: "
                "forward, loss.backward() (no zero_grad), and return the loss")
        return passes

    def _end_backward(self) -> None:
        self._task = None
        if self._in_extra:
            self._extra_passes += 1
            return
        self._backwards += 1
        if self._backwards >= self.backward_passes_per_step:
            self.mode.end_backward()
            self._averaged = self.mode.grad_is_average
            # what each gradient was when the pass ended: to tell a zeroed gradient (a new accumulation)
            # from a changed one (clipping) and from a backward that came too late
            self._versions = [(p.grad is a, a._version) for fg in self.groups
                              for p, a in zip(fg.params, fg.grad_views)]

    def _zeroed_since_averaging(self, current: torch.Tensor) -> bool:
        """Whether a gradient averaged at the end of the step's last pass was since zeroed, set to None
        or replaced (``current`` just had a backward accumulate into it)."""
        k = 0
        for fg in self.groups:
            for p, alias in zip(fg.params, fg.grad_views):
                held, v = self._versions[k]
                k += 1
                if not held:
                    continue
                grown = 1 if p is current else 0
                if p.grad is not alias or alias._version != v + grown:
                    return True
        return False

    def _restart(self) -> None:
        self.mode.restart()
        self._new_accumulation()

    def _new_accumulation(self) -> None:
        """Forget the passes, presence and clip request of the step being accumulated."""
        self._passes.clear()
        self._backwards = 0
        self._versions = None
        self._averaged = False
        self._max_norm = None
        for fg in self.groups:
            fg.absent.clear()

    def _synced_now(self) -> None:
        if self.on_synced is not None:
            self.on_synced(self)

    # -- public API -------------------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (``set_to_none``: ``p.grad = None``, as ``torch.optim`` does; a parameter
        whose gradient stays None on every rank is then left alone by the step). Starts a new
        accumulation, whatever the backward passes since the last step."""
        if self._in_extra:
            raise RuntimeError("osp: zero_grad() inside the closure passed to step(): an extra micro-batch "
                               "must accumulate into .grad (the step's first micro-batch is already there)")
        self._restart()
        self._fresh = False
        for fg in self.groups:
            fg.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """BSP: make sure ``.grad`` holds the average (it does once the step's last backward pass has
        returned); Horovod's contract, with ``skip_synchronize()``."""
        self._check_fresh()
        self.mode.synchronize()

    @contextmanager
    def skip_synchronize(self):
        """Horovod's ``with opt.skip_synchronize(): opt.step()`` after ``synchronize()``: accepted as is;
        ``step()`` never averages twice (BSP's average is finished once per step)."""
        yield

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip the gradient by the norm of the *averaged* gradient, as ``torch.nn.utils.clip_grad_norm_``
        on every rank's averaged ``.grad`` does under DDP. Call between backward and ``step()``.

        BSP: ``.grad`` already holds the average, so this is ``torch.nn.utils.clip_grad_norm_`` over this
        optimizer's parameters; returns the total norm. OSP and DSync: the average of the deferred part
        is known only later, so the step records ``max_norm`` (2-norm only) and applies it exactly: the
        update equals BSP's with the averaged gradient clipped. Returns None there: the norm is not known
        before the step."""
        if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
            raise ValueError(f"osp: clip_grad_norm_(max_norm) must be a positive number, got {max_norm!r}")
        self._check_fresh()
        if self.mode.grad_is_average:
            self.mode.synchronize()
            params = [self.groups[g].params[i] for g, i in self._order]
            return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm, norm_type,
                                                  error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(f"osp: clip_grad_norm_ under {self.sync.name.upper()} clips by the 2-norm of the "
                             f"averaged gradient; norm_type={norm_type!r} is not supported (use 2.0 or osp.BSP())")
        self._max_norm = float(max_norm)
        return None

    @property
    def _step_supports_amp_scaling(self) -> bool:
        # torch.amp.GradScaler: where .grad is this rank's own gradient (OSP, DSync), a scaler must not
        # skip step() on the ranks that overflowed alone (the others would wait for them): it calls
        # step() on every rank and osp unscales, skips on every rank alike and tells the scaler so. Where
        # .grad is the average (BSP), a wrapped optimizer that unscales in its own kernels (fused=True) is
        # handed the scaler's figures, as torch.optim would be
        return not self.mode.grad_is_average or bool(getattr(self.optimizer, "_step_supports_amp_scaling", False))

    def _check_fresh(self):
        if not self._fresh:
            raise RuntimeError(
                f"osp: step() called without a backward pass reaching this optimizer's parameters (e.g. "
                f"{self.groups[0].names[0]!r}) since the last step() or zero_grad(); every step needs new "
                "gradients (call loss.backward() first). "
                "If backward did run, the model no longer uses the parameters this optimizer was built with "
                "(e.g. model.load_state_dict(..., assign=True) or a layer replaced after wrapping): build "
                "and wrap the optimizer after such changes")

    def _check_model(self) -> None:
        """The parameters must still be the ones wrapped (views of osp's flat buffers), and a parameter
        frozen when wrapped (not synchronized) must not have started training."""
        self._check_param_groups()
        for fg in self.groups:
            fg.check_params()
        for name, p in self._outside:
            if p.grad is not None:
                raise RuntimeError(
                    f"osp: parameter {name!r} has a gradient, but it had requires_grad=False when the optimizer "
                    "was wrapped, so osp does not synchronize it (each rank would update it with its own "
                    "gradient). Wrap the optimizer with every parameter that will ever train trainable (freeze "
                    "it afterwards: a parameter whose gradient is None on every rank is left alone)")

    def _grads_changed(self, allowed: int) -> List[str]:
        """Parameters whose gradient was changed in place after the step's backward ended, beyond
        ``allowed`` changes each (a GradScaler's unscale or overflow check), or replaced by another
        tensor."""
        if self._versions is None:
            return []
        out, k = [], 0
        for fg in self.groups:
            for name, p, a in zip(fg.names, fg.params, fg.grad_views):
                held, old = self._versions[k]
                k += 1
                if a._version - old > allowed or (held and p.grad is not a):
                    out.append(name)
        return out

    @torch.no_grad()
    def step(self, closure=None):
        """One synchronized step (see the class docstring). ``closure``: under ``osp.HSP`` only, one more
        micro-batch (forward and backward, accumulating into ``.grad``, returning the loss) that HSP calls
        while other ranks are still computing; returns the loss of the last call (None if none ran)."""
        if closure is not None and not self.mode.accepts_closure:
            raise ValueError(f"osp: step(closure) runs extra micro-batches under osp.HSP only; with "
                             f"{self.sync!r} call loss.backward() then step()")
        if closure is not None and not callable(closure):
            raise TypeError(f"osp: step(closure) expects a callable, got {closure!r}")
        self._check_model()
        self._check_fresh()
        t0 = time.perf_counter()
        self._closure_loss = None
        inp = StepInput(compute_s=(t0 - self._t_end) if self._t_end is not None else 0.0,
                        max_norm=self._max_norm, passes=self.backward_passes_per_step,
                        extra=None if closure is None else (lambda: self._run_extra(closure)))
        scaler_state = None
        if getattr(self, "found_inf", None) is not None and self.mode.grad_is_average:
            inp.amp = (self.grad_scale, self.found_inf)  # for the wrapped optimizer's own unscaling
        elif getattr(self, "found_inf", None) is not None and self._step_supports_amp_scaling:
            scaler, scaler_state = _calling_grad_scaler(self)
            half = [fg.names[0] for fg in self.groups if fg.dtype == torch.float16]
            # as GradScaler.unscale_() refuses them, unless the wrapped optimizer unscales itself (fused)
            if half and not getattr(self.optimizer, "_step_supports_amp_scaling", False):
                self.__dict__.pop("grad_scale", None)
                self.__dict__.pop("found_inf", None)
                raise ValueError(f"osp: Attempting to unscale FP16 gradients (parameter {half[0]!r} is float16): "
                                 "torch.amp.GradScaler needs float32 parameters (autocast computes in float16); "
                                 "keep the parameters float32, or use bfloat16 without a scaler")
            inp.backward_scale = float(scaler._scale)
            if self.grad_scale is not None:  # not unscaled yet
                inp.unscale = float(1.0 / self.grad_scale.double())
            else:  # the user's scaler.unscale_(opt) changed them in place since backward
                inp.grads_changed = True
        if not self.mode.grad_is_average:
            # a GradScaler's unscale_() may count as one change, where its kernel bumps version counters
            unscaled = scaler_state is not None and inp.grads_changed and _unscale_counts_as_a_change()
            inp.edited = self._grads_changed(allowed=1 if unscaled else 0)
            if inp.edited and self.mode.honors_grad_edits and not self._warned_grad_change:
                self._warned_grad_change = True
                warnings.warn(
                    f"osp: the gradients of {len(inp.edited)} parameter(s) (e.g. {inp.edited[0]!r}) were changed in "
                    f"place between backward() and step(), e.g. by torch.nn.utils.clip_grad_norm_. Under "
                    f"{self.sync.name.upper()} .grad holds each rank's own gradient at that point, not the "
                    "average, so such a change acts on every rank's gradient separately (e.g. clips each by its "
                    "own norm). To clip by the norm of the averaged gradient, as under DDP, call "
                    "opt.clip_grad_norm_(max_norm) instead. This warning is shown once.",
                    RuntimeWarning, stacklevel=3)
        try:
            rec = self.mode.step(inp)
        except BaseException:
            if scaler_state is not None:  # the scaler removes them only after a step that returned
                self.__dict__.pop("grad_scale", None)
                self.__dict__.pop("found_inf", None)
            raise
        finally:
            self._fresh = False
            self._new_accumulation()
        if scaler_state is not None:  # every rank counts the same overflows, so the scales stay equal
            for found in scaler_state["found_inf_per_device"].values():
                found.fill_(1.0 if rec.get("overflow") else 0.0)
        rec.pop("overflow", None)
        if rec.get("skipped") and scaler_state is None:  # a GradScaler expects overflows and reports them
            self._warn_skipped()
        t1 = time.perf_counter()
        rec.update(compute_s=inp.compute_s, step_s=t1 - t0)
        self._record(rec)
        self._t_end = t1
        return self._closure_loss


    @staticmethod
    def _warn_skipped():
        warnings.warn("osp: non-finite gradient on some rank; step skipped on every rank",
                      RuntimeWarning, stacklevel=4)

    def _record(self, rec):
        self._totals["steps"] += 1
        self._totals["skipped_steps"] += int(rec.get("skipped", False))
        self._history.append(rec)
        if len(self._history) > 100000:
            del self._history[:50000]

    def last_step(self) -> Optional[dict]:
        """The record of the latest step (as in ``stats()["history"]``; None before the first), without
        copying the history: cheap enough to read every step (e.g. HSP's ``micro_batches``)."""
        return dict(self._history[-1]) if self._history else None

    def stats(self) -> dict:
        """Per-step records (critical fraction, bytes in each stage, stage-1 time, stage-2 wait,
        compute time between steps, whole step time, skipped) and totals, plus the mode's own
        figures."""
        hist = list(self._history)

        def mean(k):
            vals = [h[k] for h in hist if k in h]
            return sum(vals) / len(vals) if vals else 0.0
        out = {"steps": self._totals["steps"], "skipped_steps": self._totals["skipped_steps"],
               "mode": self.sync.name, "history": hist,
               "mean": {k: mean(k) for k in ("critical_fraction", "bytes_stage1", "bytes_stage2",
                                             "stage1_s", "stage2_wait_s", "replay_s", "compute_s",
                                             "step_s")}}
        out.update(self.mode.stats())
        return out

    @property
    def in_flight(self) -> bool:
        """Whether collectives or exact corrections of earlier steps are pending (``flush()`` ends them)."""
        return self.mode.in_flight

    @torch.no_grad()
    def flush(self) -> None:
        """Finish all in-flight work and apply the exact updates: call on every rank before
        evaluating, checkpointing or stopping. Afterwards replicas are bitwise equal."""
        skipped = self.mode.flush() or 0
        if skipped:
            self._totals["skipped_steps"] += skipped
            self._warn_skipped()

    # -- membership changes (osp.elastic) ---------------------------------------------------------
    def reset_world(self) -> None:
        """The engine was restarted, possibly with other ranks (Horovod Elastic's reset after a failure
        or a host change): drop whatever is in flight (the engine that carried it is gone), forget the
        step being accumulated, and rebuild the mode for the engine's world as it is now. The mode keeps
        the state every rank shares (OSP's block scores); its budget measures again in a world of another
        size. Local, no collective: afterwards every rank must load the same state (``osp.elastic.State``
        restores the last commit and broadcasts it to new ranks)."""
        teardown.forget(self.comm)
        kept = self.mode.state_dict()
        self.mode = self.sync.build(self._ctx)
        self.mode.load_state_dict(kept)
        self.mode.after_load()  # the new mode's corrector takes over the optimizer's state (flat buffers)
        self._fresh = False
        self._task = None
        self._in_extra = False
        self._t_end = None
        self._new_accumulation()

    def check_world(self) -> None:
        """A collective: every rank of the engine's world wraps the same parameters with the same
        options (as checked at construction; e.g. for a rank that joined since); the same ValueError on
        every rank otherwise."""
        self._check_same_everywhere(*self._signature)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state plus osp's own. Call ``flush()`` (on every rank) first."""
        if self.mode.in_flight:
            raise RuntimeError("osp: state_dict() with stage-2 work in flight: call flush() on every "
                               "rank first, so the state holds exact updates")
        out = {"optimizer": self.optimizer.state_dict(), "osp": {"sync": repr(self.sync)}}
        out["osp"].update(self.mode.state_dict())
        return out

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of this class, or a plain state dict of the wrapped optimizer
        (e.g. from a run with ``hvd.DistributedOptimizer``)."""
        if self.mode.in_flight:
            raise RuntimeError("osp: load_state_dict() with stage-2 work in flight: call flush() first")
        if "optimizer" in state_dict and "osp" in state_dict:
            self.optimizer.load_state_dict(state_dict["optimizer"])
            self.mode.load_state_dict(state_dict["osp"])
        else:
            self.optimizer.load_state_dict(state_dict)
        self.mode.after_load()


@functools.lru_cache(maxsize=None)
def _unscale_counts_as_a_change() -> bool:
    """Whether ``GradScaler.unscale_()``'s kernel bumps the version counter of the gradients it unscales
    (it does not in the torch osp is built against; it may in others)."""
    g = torch.ones(2)
    v = g._version
    torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(1), torch.ones(1))
    return g._version != v


def _calling_grad_scaler(opt):
    """The ``torch.amp.GradScaler`` whose ``step()`` is calling ``opt.step()``, and its record for
    ``opt`` (the overflow flags ``update()`` reads). osp makes those flags identical on every rank."""
    code = torch.amp.GradScaler.step.__code__
    f = sys._getframe(1)
    for _ in range(32):
        if f is None:
            break
        if f.f_code is code:
            scaler, state = f.f_locals.get("self"), f.f_locals.get("optimizer_state")
            if isinstance(scaler, torch.amp.GradScaler) and isinstance(state, dict) \
                    and "found_inf_per_device" in state:
                return scaler, state
        f = f.f_back
    raise RuntimeError(
        "osp: step() was called with a GradScaler's grad_scale and found_inf set, but not from "
        "torch.amp.GradScaler.step(); osp cannot make the overflow flags equal on every rank. Call "
        "scaler.step(opt) with a torch.amp.GradScaler")


def sync_buffers(module: torch.nn.Module, root_rank: int = 0, backend="auto") -> None:
    """Make every rank's buffers (BatchNorm running statistics and counters, ...) equal to
    ``root_rank``'s, as DDP's ``broadcast_buffers`` does before each forward. Call it on every rank,
    e.g. after ``opt.flush()`` and before evaluating or checkpointing: then ``model.eval()`` predicts
    alike on every rank."""
    broadcast_parameters(module.named_buffers(), root_rank, backend)


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
        optimizer.mode.after_load()
