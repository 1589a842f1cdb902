"""The distributed optimizer: one ``torch.optim``-shaped wrapper, the synchronization in its mode.

See docs/design.md for the algorithms. ``DistributedOptimizer`` wraps any ``torch.optim`` optimizer the
way ``horovod.torch.DistributedOptimizer`` does; switching is two lines::

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt = osp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=osp.OSP())

This module is the surface and delegates: the parameters and their flat groups to ``parameters``, the
backward passes to ``accumulation``, a GradScaler to ``amp``, the step records to ``steplog``, and the
synchronization to the mode (``osp/modes/<mode>.py``).
"""
from __future__ import annotations

import itertools
import time
import weakref
from collections import OrderedDict
from typing import Callable, Optional

import torch

from . import amp, clipping, joining, keywords, launcher, parameters, replicas, statedict, teardown
from .accumulation import Accumulation
from .arrivals import Arrivals
from .comm import Comm, get_comm
from .modes.base import Context, Mode, StepInput
from .modes.osp import OSP
from .steplog import StepLog
from .warn import warn

# optimizers built in this process, per set of ranks (``Comm.ranks_key``): names their collectives apart
_UIDS: dict = {}
_CLASSES: dict = {}  # the wrapped optimizer's class -> its DistributedOptimizer subclass (``__new__``)


class DistributedOptimizer(keywords.HorovodSurface, torch.optim.Optimizer):
    """Wrap ``optimizer`` so that every step synchronizes gradients across ranks with ``sync``.

    Args:
        optimizer: any ``torch.optim`` optimizer (per-parameter state; LBFGS-style closures are not
            supported). SGD, Adam and AdamW get fused correction kernels; others the generic path.
        named_parameters: ``model.named_parameters()``, for error messages and the cross-rank check;
            every parameter of ``optimizer`` must be named once.
        sync: the mode and its options: ``osp.OSP(...)`` (default: ``osp.OSP()``, ``critical="auto"``),
            ``osp.BSP()``, ``osp.DSync(...)`` or ``osp.HSP(...)``.
        backend: ``"auto"`` (Horovod when initialized, else torch.distributed), ``"horovod"``,
            ``"torch"`` or a ``osp.comm.Comm``.
        backward_passes_per_step: backward passes accumulated locally before each step.
        timeout: seconds a collective may take before the step raises ``TimeoutError`` (a peer that
            died or stalled), instead of hanging.
        on_synced: called with this optimizer wherever every rank holds bitwise the same parameters
            and optimizer state (after each step's exact corrections, and in ``flush()``); e.g. to
            checksum replicas. ``None``: nothing is called.
        compression, op, gradient_predivide_factor, groups, sparse_as_dense, process_set:
            ``hvd.DistributedOptimizer``'s keywords with Horovod's meaning (``osp.keywords``;
            docs/horovod.md).
        broadcast_parameters: send rank 0's parameters to every rank here, as DDP's constructor does
            (default False: call ``osp.broadcast_parameters`` yourself, as with Horovod).
        check_replicas: compare a digest of every rank's parameters and optimizer state at the first
            step, in every ``flush()`` and every this many steps (``osp.replicas``): ranks that start
            from different weights, or drift apart, raise the same RuntimeError on every rank naming the
            first parameter that differs. 0: never.

    The wrapper is an instance of the wrapped optimizer's class too (``isinstance(opt, torch.optim.SGD)``),
    as Horovod's is: its class is ``Distributed<Name>``, a subclass of this class and of the optimizer's,
    made once per optimizer class. Nothing of the wrapped class runs on the wrapper (no ``__init__``, and
    this class's methods come first); its instance attributes are read through.

    Parameters are moved into one flat buffer per param group and dtype (they become views into it);
    gradients too. All ranks must build the optimizer with the same parameters (checked here; under
    Horovod Elastic by ``osp.elastic.State`` when it syncs).
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        base = type(optimizer)
        if (cls is DistributedOptimizer and isinstance(optimizer, torch.optim.Optimizer)
                and not isinstance(optimizer, DistributedOptimizer) and base is not torch.optim.Optimizer):
            if base not in _CLASSES:
                _CLASSES[base] = type(f"Distributed{base.__name__}", (DistributedOptimizer, base),
                                      {"__module__": __name__, "__doc__": DistributedOptimizer.__doc__})
            cls = _CLASSES[base]
        return object.__new__(cls)

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters=None, sync=None,
                 backend="auto", backward_passes_per_step: int = 1, timeout: float = 600.0,
                 on_synced: Optional[Callable[["DistributedOptimizer"], None]] = None,
                 compression=None, op="average", gradient_predivide_factor: float = 1.0, groups=None,
                 sparse_as_dense: bool = False, process_set=None, broadcast_parameters: bool = False,
                 check_replicas: int = 1000):
        # Composition, not Optimizer.__init__: the wrapped optimizer owns param_groups and state.
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("osp: the optimizer is already a DistributedOptimizer")
        sync = parameters.check_arguments(optimizer, OSP() if sync is None else sync, backward_passes_per_step,
                                          timeout, on_synced)
        # Horovod's keywords, and the names: wrong ones raise before any engine is looked for
        reduction, compressor = keywords.check(optimizer, sync, op, gradient_predivide_factor, compression, groups,
                                               sparse_as_dense, broadcast_parameters)
        check_every = replicas.check_every(check_replicas)
        model = statedict.model_of(named_parameters)
        names = parameters.names(optimizer, named_parameters)
        # Horovod's optimizer has these attributes, and code written for it reads them
        self.op, self.gradient_predivide_factor, self.sparse_as_dense = op, gradient_predivide_factor, sparse_as_dense
        self.compression = compressor
        self.process_set = process_set
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
        self.comm: Comm = get_comm(keywords.backend_for(backend, process_set))
        launcher.check_launched(self.comm)  # N ranks launched, an engine of one: a job split silently
        self._signature = (names, next(_UIDS.setdefault(self.comm.ranks_key, itertools.count())))
        # under Horovod Elastic a rank may join while the others train, and no collective may run outside
        # hvd.elastic.run: osp.elastic.State's sync() runs this check on every rank, new ones too
        if not self.comm.elastic:
            self.check_world()
        self.groups, self._outside = parameters.flat_groups(optimizer, names, sync.block_size, self.comm)
        for fg in self.groups:
            fg.sparse_as_dense = sparse_as_dense
        self._group_shape = parameters.group_shape(optimizer)
        self._order = parameters.model_order(self.groups, names)
        ref = weakref.ref(self)  # the mode must not keep the optimizer (or its accumulation) alive
        self._ctx = Context(optimizer=optimizer, groups=self.groups, comm=self.comm, timeout=self.timeout,
                            order=self._order, extra_passes=lambda ref=ref: ref()._acc.extra(),
                            on_synced=lambda ref=ref: ref()._synced_now(),
                            prefix=f"{self.comm.prefix}{self._signature[1]}",
                            postscale=reduction.postscale, compression=compressor)
        for wire in {self._ctx.wire(fg) for fg in self.groups} - {None}:  # refused here, not at a step
            self.comm.check_dtype(wire, f"the wire of compression={compressor!r}")
        self.mode: Mode = sync.build(self._ctx)
        self._ctx.arrivals = Arrivals(self.comm.rank, advice=self.mode.straggler_advice)
        self._replicas = replicas.ReplicaCheck(self._ctx, check_every)
        self._synced_calls = 0  # on_synced points so far (flush() makes one where the mode did not)
        if broadcast_parameters and not self.comm.elastic:  # under Horovod Elastic, State's sync() does it
            for k, fg in enumerate(self.groups):
                self.comm.broadcast_(fg.param, 0, f"{self._ctx.prefix}.init.{k}")
        prescale = None
        if reduction != keywords.Reduction():
            prescale = lambda r=reduction, ref=ref: r.prescale(ref().comm.size)  # noqa: E731 (the world may change)
        # the hooks, last
        self._world = (self.comm.rank, self.comm.size)  # the engine's world the mode was built for
        self._acc = Accumulation(self.groups, backward_passes_per_step, self.mode, prescale=prescale,
                                 before_pass=lambda ref=ref: statedict.follow_world(ref()))
        self._log = StepLog()
        self._t_end: Optional[float] = None  # when the last step returned
        statedict.watch_model(self, model)
        statedict.follow(self)

    def __del__(self):
        # its own attribute only: a wrapper that takes this class as a base and forwards attribute reads to
        # this object (Lightning's LightningOptimizer) must not remove this optimizer's hooks when it is dropped
        acc = self.__dict__.get("_acc")
        if acc is not None:
            acc.remove_hooks()

    def __getattr__(self, name):
        # the wrapped optimizer's own instance attributes (set by its __init__, which never runs on the
        # wrapper): methods of its class, inherited by the wrapper, may read them
        inner = self.__dict__.get("optimizer")
        if inner is not None and name in vars(inner):
            return vars(inner)[name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # -- torch.optim.Optimizer surface (LR schedulers, step hooks, GradScaler) ----------------
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
    def _step_supports_amp_scaling(self) -> bool:
        return amp.supports_scaling(self.mode.grad_is_average, self.optimizer)

    @property
    def nbytes(self) -> int:
        """Bytes of the flat gradients: what a step moves in all."""
        return self._ctx.nbytes

    def _synced_now(self) -> None:
        self._synced_calls += 1
        self._replicas.run_if_due()
        if self.on_synced is not None:
            self.on_synced(self)

    # -- the step ---------------------------------------------------------------------------------
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
        if not self._acc.fresh and closure is None and statedict.horovod_state_broadcast() is not None:
            return statedict.init_state_for_horovod(self)
        statedict.follow_world(self)
        parameters.check_model(self.optimizer, self._group_shape, self.groups, self._outside)
        self._acc.check_fresh()
        self._check_synchronized()
        t0 = time.perf_counter()
        inp = StepInput(compute_s=(t0 - self._t_end) if self._t_end is not None else 0.0,
                        clip=self._acc.clip, passes=self.backward_passes_per_step, closure=closure)
        self._replicas.begin_step()
        if self.mode.exact and not self.mode.synced_in_step:  # else at the mode's on_synced point
            self._replicas.run_if_due()
        average = self.mode.grad_is_average
        try:
            scaler = amp.prepare(self, average, inp)
        except ValueError:  # refused alike on every rank: first finish what backward started (none in flight)
            self.mode.restart()
            raise
        if not average:
            inp.edited = self._acc.edited(allowed=amp.allowed_changes(scaler, inp))
        try:
            rec = self.mode.step(inp)
        except BaseException:
            amp.forget(self, scaler)
            raise
        finally:
            self._acc.fresh = False
            self._acc.new_step()
            self._ctx.arrivals.next_step()
        self._ctx.arrivals.warn_pending()  # at the user's step() line, whichever point of the step read the record
        amp.report(scaler, rec.pop("overflow", None))
        if rec.get("skipped") and scaler is None:  # a GradScaler expects overflows and reports them
            self._warn_skipped()
        loss = rec.pop("loss", None)
        self._t_end = self._ctx.t_end = time.perf_counter()
        rec.update(compute_s=inp.compute_s, step_s=self._t_end - t0)
        self._log.record(rec)
        return loss

    @staticmethod
    def _warn_skipped():
        warn("osp: non-finite gradient on some rank; step skipped on every rank")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (``set_to_none``: ``p.grad = None``, as ``torch.optim`` does; a parameter
        whose gradient stays None on every rank is then left alone by the step). Starts a new
        accumulation, whatever the backward passes since the last step."""
        self._acc.zero_grad(set_to_none)

    def no_sync(self):
        """``with opt.no_sync(): loss.backward()``: as DDP's ``model.no_sync()``, the passes inside
        accumulate into ``.grad`` locally and start no collective; the first backward pass outside averages
        their sum with its own (it counts toward ``backward_passes_per_step``, they do not). Every rank
        must run the same number of passes outside ``no_sync()``; inside, any number."""
        return self._acc.no_sync()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False):
        """Clip the gradient by the norm of the *averaged* gradient, as ``torch.nn.utils.clip_grad_norm_``
        on every rank's averaged ``.grad`` does under DDP. Call between backward and ``step()``.

        BSP: ``.grad`` already holds the average, so this is ``torch.nn.utils.clip_grad_norm_`` over this
        optimizer's parameters; returns the total norm. OSP and DSync: the average of the deferred part
        is known only later, so the step records ``max_norm`` (2-norm only) and applies it exactly: the
        update equals BSP's with the averaged gradient clipped. Returns None there: the norm is not known
        before the step."""
        return clipping.clip_norm(self, max_norm, norm_type, error_if_nonfinite)

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip every element of the *averaged* gradient into ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_`` on every rank's averaged ``.grad`` does under DDP. Call between
        backward and ``step()``. BSP: that function on the averages. OSP, DSync, HSP: the step applies it
        exactly to the average (its deferred part when it lands), the provisional moves to this rank's own."""
        clipping.clip_value(self, clip_value)

    @torch.no_grad()
    def join(self) -> int:
        """This rank is out of data (DDP's ``Join``, Horovod's ``hvd.join()``): until every rank has joined, it
        takes part in the others' steps with no gradient of its own (zeros in the average, still divided by the
        number of ranks, as DDP and Horovod do), so the replicas stay bitwise equal; with a GradScaler, through
        it. Returns on every rank at the same step, after ``flush()``, with the parameters, optimizer state and
        scaler state of the rank that joined last (as DDP's join). Meanwhile the ranks still training may call
        ``step()`` only (a collective of their own would meet a step's); call ``join()`` after ``step()``. Returns the
        rank (within the optimizer's ranks) that joined last, as ``hvd.join()`` does."""
        return joining.join(self)

    @property
    def in_flight(self) -> bool:
        """Whether collectives or exact corrections of earlier steps are pending (``flush()`` ends them)."""
        return self.mode.in_flight

    @torch.no_grad()
    def flush(self) -> None:
        """Finish all in-flight work and apply the exact updates: call on every rank before
        evaluating, checkpointing or stopping. Afterwards replicas are bitwise equal."""
        self._replicas.due = "flush()" if self._replicas.every else None
        calls = self._synced_calls
        skipped = self.mode.flush() or 0
        if self._synced_calls == calls and self.mode.exact:  # BSP, HSP: exact without a correction to land
            self._synced_now()
        if skipped:
            self._log.skipped += skipped
            self._warn_skipped()
        self._ctx.arrivals.warn_pending()

    # -- what was done ----------------------------------------------------------------------------
    def last_step(self) -> Optional[dict]:
        """The record of the latest step (as in ``stats()["history"]``; None before the first), without
        copying the history: cheap enough to read every step (e.g. HSP's ``micro_batches``)."""
        return self._log.last()

    def stats(self) -> dict:
        """Per-step records (critical fraction, bytes in each stage, stage-1 time, stage-2 wait,
        compute time between steps, whole step time, skipped) and totals, plus the mode's own
        figures."""
        out = self._log.stats(self.sync.name)
        out["arrivals"] = self._ctx.arrivals.stats()
        out["replica_checks"] = self._replicas.checks
        out.update(self.mode.stats())
        return out

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
        self.mode.load_state_dict(kept)  # and takes over the optimizer's state (flat buffers)
        self._acc.reset(self.mode)
        # the next step is the first in this world
        self._replicas = replicas.ReplicaCheck(self._ctx, self._replicas.every)
        self._t_end = self._ctx.t_end = None
        self._ctx.arrivals = Arrivals(self.comm.rank, advice=self.mode.straggler_advice)
        self._world = (self.comm.rank, self.comm.size)

    def check_world(self) -> None:
        """A collective: every rank of the engine's world wraps the same parameters with the same
        options (as checked at construction; e.g. for a rank that joined since); the same ValueError on
        every rank otherwise."""
        names, uid = self._signature
        parameters.check_same_everywhere(self.comm, self.optimizer, names, repr(self.sync),
                                         self.backward_passes_per_step, uid)

    # -- checkpoints ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The wrapped optimizer's state dict (``state``, ``param_groups``: what Horovod's
        ``broadcast_optimizer_state`` reads and writes in place) plus osp's own under ``"osp"``. Call
        ``flush()`` (on every rank) first; Horovod's ``broadcast_optimizer_state`` and ``hvd.elastic.TorchState``'s
        ``commit()``, which every rank calls at the same point, flush themselves (``osp.statedict``)."""
        return statedict.state_dict(self)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of this class, or a plain state dict of the wrapped optimizer
        (e.g. from a run with ``hvd.DistributedOptimizer``). With work in flight only as a restore of the last commit
        (``hvd.elastic.TorchState``'s, or while the engine fails), which drops it (``osp.statedict``)."""
        statedict.load_state_dict(self, state_dict)

