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
import warnings
import weakref
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Optional

import torch

from . import amp, parameters, teardown
from .accumulation import Accumulation
from .comm import Comm, get_comm
from .modes.base import Context, Mode, StepInput
from .modes.osp import OSP
from .steplog import StepLog

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
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("osp: the optimizer is already a DistributedOptimizer")
        sync = parameters.check_arguments(optimizer, OSP() if sync is None else sync, backward_passes_per_step,
                                          timeout, on_synced)
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
        names = parameters.names(optimizer, named_parameters)
        self._signature = (names, next(_UIDS))
        # under Horovod Elastic a rank may join while the others train, and no collective may run outside
        # hvd.elastic.run: osp.elastic.State's sync() runs this check on every rank, new ones too
        if not self.comm.elastic:
            self.check_world()
        self.groups, self._outside = parameters.flat_groups(optimizer, names, sync.block_size, self.comm)
        self._group_shape = parameters.group_shape(optimizer)
        where = {p: (k, i) for k, fg in enumerate(self.groups) for i, p in enumerate(fg.params)}
        self._order = [where[p] for p in names if p in where]  # (flat group, parameter) in the model's order
        ref = weakref.ref(self)  # the mode must not keep the optimizer (or its accumulation) alive
        self._ctx = Context(optimizer=optimizer, groups=self.groups, comm=self.comm, timeout=self.timeout,
                            order=self._order, extra_passes=lambda ref=ref: ref()._acc.extra(),
                            on_synced=lambda ref=ref: ref()._synced_now(), prefix=f"osp{self._signature[1]}")
        self.mode: Mode = sync.build(self._ctx)
        self._acc = Accumulation(self.groups, backward_passes_per_step, self.mode)  # the hooks, last
        self._log = StepLog()
        self._t_end: Optional[float] = None  # when the last step returned

    def __del__(self):
        if getattr(self, "_acc", None) is not None:
            self._acc.remove_hooks()

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
        parameters.check_model(self.optimizer, self._group_shape, self.groups, self._outside)
        self._acc.check_fresh()
        t0 = time.perf_counter()
        inp = StepInput(compute_s=(t0 - self._t_end) if self._t_end is not None else 0.0,
                        max_norm=self._acc.max_norm, passes=self.backward_passes_per_step, closure=closure)
        average = self.mode.grad_is_average
        scaler = amp.prepare(self, average, inp)
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
        amp.report(scaler, rec.pop("overflow", None))
        if rec.get("skipped") and scaler is None:  # a GradScaler expects overflows and reports them
            self._warn_skipped()
        loss = rec.pop("loss", None)
        self._t_end = time.perf_counter()
        rec.update(compute_s=inp.compute_s, step_s=self._t_end - t0)
        self._log.record(rec)
        return loss

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
        returned); Horovod's contract, with ``skip_synchronize()``."""
        self._acc.check_fresh()
        if not self.mode.grad_is_average:
            raise RuntimeError(f"osp: synchronize() is for BSP; with {self.sync!r} the gradient a step applies "
                               "is only known inside step()")
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
        self._acc.check_fresh()
        if self.mode.grad_is_average:
            self.mode.synchronize()
            params = [self.groups[g].params[i] for g, i in self._order]
            return torch.nn.utils.clip_grad_norm_([p for p in params if p.grad is not None], max_norm, norm_type,
                                                  error_if_nonfinite)
        if float(norm_type) != 2.0:
            raise ValueError(f"osp: clip_grad_norm_ under {self.sync.name.upper()} clips by the 2-norm of the "
                             f"averaged gradient; norm_type={norm_type!r} is not supported (use 2.0 or osp.BSP())")
        self._acc.max_norm = float(max_norm)
        return None

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
        self._t_end = None

    def check_world(self) -> None:
        """A collective: every rank of the engine's world wraps the same parameters with the same
        options (as checked at construction; e.g. for a rank that joined since); the same ValueError on
        every rank otherwise."""
        names, uid = self._signature
        parameters.check_same_everywhere(self.comm, self.optimizer, names, repr(self.sync),
                                         self.backward_passes_per_step, uid)

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
        ours = "optimizer" in state_dict and "osp" in state_dict
        self.optimizer.load_state_dict(state_dict["optimizer"] if ours else state_dict)
        self.mode.load_state_dict(state_dict["osp"] if ours else {})
