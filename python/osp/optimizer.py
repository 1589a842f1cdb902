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
import sys
import time
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, List, Optional

import torch

from . import amp, keywords, parameters, replicas, teardown
from . import compression as compression_
from .accumulation import Accumulation
from .arrivals import Arrivals
from .comm import Comm, get_comm
from .correction import unhooked_step
from .modes.base import Clip, Context, Mode, StepInput
from .modes.osp import OSP
from .steplog import StepLog

# optimizers built in this process, per set of ranks (``Comm.ranks_key``): names their collectives apart
_UIDS: dict = {}
_CLASSES: dict = {}  # the wrapped optimizer's class -> its DistributedOptimizer subclass (``__new__``)


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
        compression, op, gradient_predivide_factor, groups, sparse_as_dense, process_set:
            ``hvd.DistributedOptimizer``'s keywords with Horovod's meaning (``osp.keywords``; README,
            "Coming from Horovod").
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
        reduction = keywords.reduction(op, gradient_predivide_factor)
        compressor = compression_.resolve(compression)
        keywords.check_groups(groups, optimizer)
        if not isinstance(sparse_as_dense, bool):
            raise ValueError(f"osp: sparse_as_dense must be True or False, got {sparse_as_dense!r}")
        if not isinstance(broadcast_parameters, bool):
            raise ValueError(f"osp: broadcast_parameters must be True or False, got {broadcast_parameters!r}")
        check_every = replicas.check_every(check_replicas)
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
        self._signature = (names, next(_UIDS.setdefault(self.comm.ranks_key, itertools.count())))
        # under Horovod Elastic a rank may join while the others train, and no collective may run outside
        # hvd.elastic.run: osp.elastic.State's sync() runs this check on every rank, new ones too
        if not self.comm.elastic:
            self.check_world()
        self.groups, self._outside = parameters.flat_groups(optimizer, names, sync.block_size, self.comm)
        for fg in self.groups:
            fg.sparse_as_dense = sparse_as_dense
        self._group_shape = parameters.group_shape(optimizer)
        where = {p: (k, i) for k, fg in enumerate(self.groups) for i, p in enumerate(fg.params)}
        self._order = [where[p] for p in names if p in where]  # (flat group, parameter) in the model's order
        ref = weakref.ref(self)  # the mode must not keep the optimizer (or its accumulation) alive
        self._ctx = Context(optimizer=optimizer, groups=self.groups, comm=self.comm, timeout=self.timeout,
                            order=self._order, extra_passes=lambda ref=ref: ref()._acc.extra(),
                            on_synced=lambda ref=ref: ref()._synced_now(),
                            prefix=f"{self.comm.prefix}{self._signature[1]}",
                            postscale=reduction.postscale, compression=compressor,
                            arrivals=Arrivals(self.comm.rank))
        for wire in {self._ctx.wire(fg) for fg in self.groups} - {None}:  # refused here, not at a step
            self.comm.check_dtype(wire, f"the wire of compression={compressor!r}")
        self.mode: Mode = sync.build(self._ctx)
        self._replicas = replicas.ReplicaCheck(self._ctx, check_every)
        self._synced_calls = 0  # on_synced points so far (flush() makes one where the mode did not)
        if broadcast_parameters and not self.comm.elastic:  # under Horovod Elastic, State's sync() does it
            for k, fg in enumerate(self.groups):
                self.comm.broadcast_(fg.param, 0, f"{self._ctx.prefix}.init.{k}")
        if reduction.predivide != 1.0 and sync.name != "bsp":
            raise ValueError(
                f"osp: gradient_predivide_factor is for osp.BSP(), whose average is one allreduce of the "
                f"gradients; with {sync!r} the average is assembled from parts (stage 1, the local estimate, "
                "the corrections), which a pre- and postscale would not reach alike. Leave it at 1.0 or use "
                "osp.BSP()")
        prescale = None
        if reduction != keywords.Reduction():
            prescale = lambda r=reduction, ref=ref: r.prescale(ref().comm.size)  # noqa: E731 (the world may change)
        # the hooks, last
        self._acc = Accumulation(self.groups, backward_passes_per_step, self.mode, prescale=prescale)
        self._log = StepLog()
        self._t_end: Optional[float] = None  # when the last step returned
        self._synchronized = False  # BSP: synchronize() ran since the last step (Horovod's warning)
        self._skip_synchronize = False

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

    @property
    def _parameter_names(self) -> dict:
        """``{parameter: name}``, as Horovod's optimizer has it (names from ``named_parameters``, else
        Horovod's ``allreduce.noname.<g>.<i>``)."""
        return dict(self._signature[0])

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
        if not self._acc.fresh and closure is None and _horovod_state_broadcast() is not None:
            return self._init_state_for_horovod()
        parameters.check_model(self.optimizer, self._group_shape, self.groups, self._outside)
        self._acc.check_fresh()
        if self._synchronized and not self._skip_synchronize:
            warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                          "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                          "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                          "your code.", UserWarning, stacklevel=3)
        self._synchronized = False
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
        amp.report(scaler, rec.pop("overflow", None))
        if rec.get("skipped") and scaler is None:  # a GradScaler expects overflows and reports them
            self._warn_skipped()
        loss = rec.pop("loss", None)
        self._t_end = self._ctx.t_end = time.perf_counter()
        rec.update(compute_s=inp.compute_s, step_s=self._t_end - t0)
        self._log.record(rec)
        return loss

    def _init_state_for_horovod(self) -> None:
        """``hvd.broadcast_optimizer_state`` on an optimizer without state sets every gradient to zeros and
        calls ``step()`` to have the state made, then broadcasts it: a local step of the wrapped optimizer
        (as Horovod does for its own optimizer), no collective. The zero gradients go back into osp's flat
        gradient, and the mode takes the new state over. The parameters are put back as they were: with
        weight decay (or ASGD's averaging) a zero-gradient step moves them, and only on the ranks without
        state, which would leave the replicas apart after ``broadcast_parameters`` (Horovod's does that)."""
        kept = [fg.param.clone() for fg in self.groups]
        unhooked_step(self.optimizer)
        for fg, p in zip(self.groups, kept):
            fg.param.copy_(p)
            fg.gather_grads()
        self.mode.load_state_dict({})

    @staticmethod
    def _warn_skipped():
        warnings.warn("osp: non-finite gradient on some rank; step skipped on every rank",
                      RuntimeWarning, stacklevel=4)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradients (``set_to_none``: ``p.grad = None``, as ``torch.optim`` does; a parameter
        whose gradient stays None on every rank is then left alone by the step). Starts a new
        accumulation, whatever the backward passes since the last step."""
        self._acc.zero_grad(set_to_none)

    def synchronize(self) -> None:
        """BSP: make sure ``.grad`` holds the average (it does once the step's last backward pass has
        returned); Horovod's contract, with ``skip_synchronize()``. OSP, DSync and HSP refuse it: their
        average is only complete inside (or after) ``step()``, so an edit of ``.grad`` between the two
        could not act on it; ``clip_grad_norm_`` is the exact alternative for clipping."""
        self._acc.check_fresh()
        if not self.mode.grad_is_average:
            raise RuntimeError(
                f"osp: synchronize() is for osp.BSP(): with {self.sync!r} the average gradient is only complete "
                "inside step() (the deferred part arrives while the next step computes), so .grad cannot be "
                "edited as the average between synchronize() and step(). To clip, replace Horovod's idiom "
                "`opt.synchronize(); torch.nn.utils.clip_grad_norm_(params, max_norm); with "
                "opt.skip_synchronize(): opt.step()` with `opt.clip_grad_norm_(max_norm); opt.step()`: the "
                "step then applies exactly the averaged gradient clipped by its 2-norm. For other edits of "
                "the average use osp.BSP()")
        self.mode.synchronize()
        self._synchronized = True

    @contextmanager
    def skip_synchronize(self):
        """Horovod's ``with opt.skip_synchronize(): opt.step()`` after ``synchronize()``: the step applies
        ``.grad`` as it is (BSP's average is finished once per step; ``step()`` never averages twice).
        Without it, ``step()`` after ``synchronize()`` warns, as Horovod's does."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

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
        params = self._averaged_or_none("clip_grad_norm_(max_norm)", max_norm)
        if params is not None:
            return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(f"osp: clip_grad_norm_ under {self.sync.name.upper()} clips by the 2-norm of the "
                             f"averaged gradient; norm_type={norm_type!r} is not supported (use 2.0 or osp.BSP())")
        self._request_clip(Clip("norm", float(max_norm)))
        return None

    def clip_grad_value_(self, clip_value: float) -> None:
        """Clip every element of the *averaged* gradient into ``[-clip_value, clip_value]``, as
        ``torch.nn.utils.clip_grad_value_`` on every rank's averaged ``.grad`` does under DDP. Call between
        backward and ``step()``. BSP: that function on the averages. OSP, DSync, HSP: the step applies it
        exactly to the average (its deferred part when it lands), the provisional moves to this rank's own."""
        params = self._averaged_or_none("clip_grad_value_(clip_value)", clip_value)
        if params is not None:
            torch.nn.utils.clip_grad_value_(params, clip_value)
            return None
        self._request_clip(Clip("value", float(clip_value)))
        return None

    def _averaged_or_none(self, what: str, limit) -> Optional[List[torch.Tensor]]:
        """What a clip call starts with: ``limit`` checked (a positive number), a backward since the last step;
        then, where ``.grad`` holds the average (BSP), the parameters with a gradient once it landed, else None
        (the step applies the clip exactly)."""
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ValueError(f"osp: {what} must be a positive number, got {limit!r}")
        self._acc.check_fresh()
        if not self.mode.grad_is_average:
            return None
        self.mode.synchronize()
        params = [self.groups[g].params[i] for g, i in self._order]
        return [p for p in params if p.grad is not None]

    def _request_clip(self, clip: Clip) -> None:
        if self._acc.clip is not None and self._acc.clip.kind != clip.kind:
            raise ValueError(f"osp: clip_grad_norm_ and clip_grad_value_ in one step under {self.sync.name.upper()} "
                             f"(asked for {self._acc.clip} and then {clip}): osp applies one clipping of the "
                             "averaged gradient per step; use one of them, or osp.BSP()")
        self._acc.clip = clip

    @torch.no_grad()
    def join(self) -> None:
        """This rank is out of data (DDP's ``Join``, Horovod's ``hvd.join()``): until every rank has joined,
        it takes part in the others' steps with no gradient of its own (zeros in the average, which stays
        divided by the number of ranks, as DDP's ``divide_by_initial_world_size`` and Horovod's join do;
        under HSP it adds no micro-batch), applying the same updates, so the replicas stay bitwise equal.
        Returns on every rank at the same step, once the last rank has joined, after ``flush()``, with the
        parameters and optimizer state of the rank that joined last (as DDP's join does: a learning-rate
        scheduler the joined ranks did not step while they waited must not leave their replicas apart).
        With a ``torch.amp.GradScaler`` (the one whose ``step()`` last stepped this optimizer), the shadow
        steps go through ``scaler.step(opt)`` and ``scaler.update()`` as the others' steps do, and every rank's
        scaler ends with the last joiner's state: the loss scales stay equal.

        Meanwhile the ranks still training may call ``step()`` (and what leads to it) only: a collective
        of their own (``flush()``, ``state_dict()`` of a mode with work in flight, a metric's allreduce)
        would meet a step's on the joined ranks. Call ``join()`` after ``step()``, not between a backward
        and its step."""
        if self._acc.fresh:
            raise RuntimeError("osp: join() after a backward pass whose step() has not run: call step() first, "
                               "then join()")
        ctx = self._ctx
        # a count left from an earlier join() must not end this one
        ctx.joined, ctx.joined_ranks, ctx.joined_age = True, 0, None
        # every rank leaves at the step ``record_lag`` after the one whose record first counted every rank as
        # joined: DSync reads that record steps later (with delay="auto" each rank at its own delay)
        lag, left = self.mode.record_lag, None
        # a GradScaler: the shadow steps go through it as the others' steps do (its scale moves with theirs)
        scaler = amp.join_scaler(self)
        shadowed = 0
        try:
            while True:
                self.zero_grad(set_to_none=True)
                self._acc.shadow_pass()
                amp.shadow_step(self, scaler)
                shadowed += 1
                if ctx.device.type == "meta":
                    break
                if left is None and ctx.joined_age is not None:
                    left = lag - ctx.joined_age
                    if left < 0:
                        raise RuntimeError(f"osp: join(): a record was read {ctx.joined_age} steps after its step, "
                                           f"beyond the mode's {lag} (a bug in osp)")
                if left is not None:
                    if left == 0:
                        break
                    left -= 1
            self.flush()  # (its replica check compares nothing: ranks are joined; the end of join() checks)
        finally:
            ctx.joined = False
            self.zero_grad(set_to_none=True)
        if self.comm.size > 1:
            # the rank that joined last (fewest shadow steps) sends its parameters and state, as DDP's join hook
            # does: a joined rank's learning rate stood still while a scheduler moved the others' (equal values
            # otherwise: then this changes nothing); and its GradScaler's state, which every scaler takes
            from .broadcast import broadcast_optimizer_state

            gathered = self.comm.allgather_object((shadowed, amp.join_states(self)))
            counts = [c for c, _ in gathered]
            root = counts.index(min(counts))
            for k, fg in enumerate(self.groups):
                self.comm.broadcast_(fg.param, root, f"{ctx.prefix}.join.{k}")
            broadcast_optimizer_state(self, root)
            amp.adopt_join_state(self, [st for _, st in gathered], root)
            self._replicas.check("the end of join()")  # every rank took the last joiner's parameters and state

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
        self._ctx.arrivals = Arrivals(self.comm.rank)

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
        ``flush()`` (on every rank) first."""
        if self.mode.in_flight:
            raise RuntimeError("osp: state_dict() with stage-2 work in flight: call flush() on every "
                               "rank first, so the state holds exact updates")
        frame = _horovod_state_broadcast()
        if frame is not None and "state_dict" not in frame.f_locals:
            # hvd.broadcast_optimizer_state's first read (every rank's, at the same point): it sends the
            # wrapped optimizer's state only, so osp's own part (OSP's scores and budget: the next split)
            # goes from root here, or a rank that loaded a checkpoint would split unlike the others
            root = frame.f_locals.get("root_rank", 0)
            mine = self._own_state() if self.comm.rank == root else None
            theirs = self.comm.broadcast_object(mine, root)
            if self.comm.rank != root:
                self.mode.load_state_dict(theirs)
        out = dict(self.optimizer.state_dict())
        out["osp"] = self._own_state()
        return out

    def _own_state(self) -> dict:
        return {"sync": repr(self.sync), **self.mode.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Load a ``state_dict()`` of this class, or a plain state dict of the wrapped optimizer
        (e.g. from a run with ``hvd.DistributedOptimizer``)."""
        if self.mode.in_flight:
            raise RuntimeError("osp: load_state_dict() with stage-2 work in flight: call flush() first")
        if not isinstance(state_dict, dict):
            raise TypeError(f"osp: load_state_dict() expects a dict (a state_dict()), got {type(state_dict).__name__}")
        if "optimizer" in state_dict and "osp" in state_dict:  # the layout of osp 0.x before Horovod parity
            inner, ours = state_dict["optimizer"], state_dict["osp"]
        else:
            inner = {k: v for k, v in state_dict.items() if k != "osp"}
            ours = state_dict.get("osp", {})
        self.optimizer.load_state_dict(inner)
        self.mode.load_state_dict(ours)



def _horovod_state_broadcast() -> Optional[object]:
    """The frame of Horovod's ``broadcast_optimizer_state`` if it is calling us (through torch's step
    wrappers: a few frames up), else None. It calls ``state_dict()`` on every rank, and ``step()`` on the
    ranks without state, to have it made."""
    functions = sys.modules.get("horovod.torch.functions")
    code = getattr(getattr(functions, "broadcast_optimizer_state", None), "__code__", None)
    if code is None:
        return None
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            return None
        if f.f_code is code:
            return f
        f = f.f_back
    return None
