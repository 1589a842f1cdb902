"""``hvd.DistributedOptimizer``'s keywords, with Horovod's meaning in osp (docs/horovod.md).

``DistributedOptimizer`` takes every keyword of Horovod 0.28's ``hvd.DistributedOptimizer``, so that
switching is the one-line swap. This module validates them (a clear error naming what was expected and
what was got) and says what each becomes:

- ``op`` and ``gradient_predivide_factor``: a ``Reduction``. ``op=hvd.Sum`` makes the step apply the sum
  of the ranks' gradients: each backward pass's gradient is multiplied by the number of ranks where it
  arrives (a pre-hook on the parameter's gradient accumulator, before it accumulates into ``.grad``;
  ``torch.autograd.grad``, which accumulates nothing, returns the true gradient), so every mode's average is the sum
  (bitwise, for a power-of-two number of ranks) and OSP's local estimate of the deferred part is at the
  sum's scale too. ``gradient_predivide_factor=f`` divides each gradient by ``f`` on arrival and
  multiplies the average by ``f`` after it, as Horovod's pre- and postscale factors do (BSP: the one mode where the
  average is a single allreduce). ``hvd.Adasum`` is refused.
- ``compression``: ``osp.compression.resolve`` (Horovod's ``Compression.none`` / ``fp16`` and osp's own).
- ``groups``: validated as Horovod does, then left to osp's buckets (``bucket_mb``), which already fuse
  the gradients into allreduces of a chosen size in the order backward produces them.
- ``sparse_as_dense``: a sparse gradient is made dense where it enters osp's flat gradient.
- ``process_set``: a Horovod process set (``HorovodComm``) or an ``osp.horovod`` one (``TorchComm`` on its group);
  the optimizer's collectives run on it. On a rank outside it the optimizer steps alone (``LocalComm``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from .warn import warn

AVERAGE, SUM = "average", "sum"


@dataclass(frozen=True)
class Reduction:
    """How the ranks' gradients combine into the one a step applies."""

    op: str = AVERAGE
    predivide: float = 1.0

    def prescale(self, size: int) -> float:
        """The factor each backward pass's gradient gets where it arrives (1.0: none)."""
        return float(size) if self.op == SUM else 1.0 / self.predivide

    @property
    def postscale(self) -> float:
        """The factor the average gets after the allreduce (BSP)."""
        return self.predivide

    def __repr__(self):
        return f"Reduction(op={self.op!r}, gradient_predivide_factor={self.predivide:g})"


def _horovod_ops():
    # Horovod's values (hvd.Average is 0, hvd.Sum 1, hvd.Adasum 2), which osp.horovod's ReduceOp shares
    # (tests/test_osp_horovod.py checks both): one table for both
    return {0: AVERAGE, 1: SUM, 2: "adasum"}


def reduction(op, gradient_predivide_factor) -> Reduction:
    """``op``: ``hvd.Average`` / ``hvd.Sum`` (or "average" / "sum"); ``hvd.Adasum`` is refused."""
    if isinstance(op, str) and op.lower() in (AVERAGE, SUM):
        name = op.lower()
    else:
        name = None
        if isinstance(op, int) and not isinstance(op, bool):
            name = _horovod_ops().get(op)
        if name == "adasum":
            raise ValueError("osp: op=hvd.Adasum is not supported: Adasum combines gradients by a nonlinear rule, "
                             "so OSP's exact correction (and DSync's late averages) have nothing linear to correct "
                             "with; use op=hvd.Average (the default) or hvd.Sum, or hvd.DistributedOptimizer "
                             "for Adasum")
        if name is None:
            raise ValueError(f"osp: op must be hvd.Average or hvd.Sum (or 'average' / 'sum'), got {op!r}")
    f = gradient_predivide_factor
    if isinstance(f, bool) or not isinstance(f, (int, float)) or not f > 0 or f != f or f == float("inf"):
        raise ValueError(f"osp: gradient_predivide_factor must be a positive number, got {f!r}")
    if float(f) != 1.0 and name != AVERAGE:
        raise ValueError("osp: gradient_predivide_factor is for op=hvd.Average only (as in Horovod), got "
                         f"gradient_predivide_factor={f!r} with op=hvd.Sum")
    return Reduction(name, float(f))


def check_groups(groups, optimizer: torch.optim.Optimizer) -> None:
    """Horovod's rules: a positive integer, or lists of the optimizer's parameters, each at most once."""
    if groups is None:
        return
    if isinstance(groups, bool) or not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
        raise ValueError(f"osp: groups must be a positive integer or a list of lists of parameters, got {groups!r}")
    if isinstance(groups, int):
        return
    mine = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen = set()
    for inner in groups:
        if not isinstance(inner, (list, tuple)):
            raise ValueError(f"osp: groups must be a list of lists of parameters, got an element {inner!r}")
        for p in inner:
            if not isinstance(p, torch.Tensor):
                raise ValueError(f"osp: groups must consist of torch.Tensor, got {type(p).__name__}")
            if id(p) in seen:
                raise ValueError("osp: a parameter can only appear once in groups")
            if id(p) not in mine:
                raise ValueError("osp: groups holds a tensor that is not a parameter of the optimizer")
            seen.add(id(p))


def backend_for(backend, process_set):
    """The backend to build the optimizer's communicator from. ``process_set``: a Horovod ProcessSet (Horovod on
    that set) or an ``osp.horovod.ProcessSet`` (torch.distributed on its group); on a rank outside the set, a
    ``LocalComm``: the rank steps on its own gradient, as under Horovod's optimizer, which registers no hooks
    there."""
    if process_set is None:
        return backend
    from .comm import HorovodComm, LocalComm

    osp_comm = getattr(process_set, "_osp_comm", None)  # an osp.horovod.ProcessSet
    if osp_comm is not None:
        if backend not in ("auto", "torch"):
            raise ValueError(f"osp: process_set is an osp.horovod process set, on torch.distributed; it needs "
                             f"backend='auto' or 'torch', got backend={backend!r}")
        return osp_comm()
    try:
        import horovod.torch as hvd
    except ImportError:
        raise ValueError(f"osp: process_set must be an osp.horovod.ProcessSet or a horovod ProcessSet, got "
                         f"{process_set!r}") from None
    if not isinstance(process_set, hvd.ProcessSet):
        raise ValueError(f"osp: process_set must be a horovod ProcessSet (or an osp.horovod.ProcessSet), got "
                         f"{process_set!r}")
    if process_set is hvd.global_process_set:
        return backend
    if backend not in ("auto", "horovod"):
        raise ValueError(f"osp: process_set is a Horovod process set; it needs backend='auto' or 'horovod', got "
                         f"backend={backend!r}")
    if process_set.process_set_id is not None and process_set.included() is False:
        return LocalComm()
    return HorovodComm(process_set)


def check(optimizer, sync, op, gradient_predivide_factor, compression, groups, sparse_as_dense,
          broadcast_parameters):
    """Horovod's keywords (and ``broadcast_parameters``) of a ``DistributedOptimizer``, each a clear error naming
    what was expected, before any engine is looked for; returns ``(Reduction, compressor)``."""
    from .compression import resolve

    red = reduction(op, gradient_predivide_factor)
    if red.predivide != 1.0 and sync.name != "bsp":
        raise ValueError(
            f"osp: gradient_predivide_factor is for osp.BSP(), whose average is one allreduce of the "
            f"gradients; with {sync!r} the average is assembled from parts (stage 1, the local estimate, "
            "the corrections), which a pre- and postscale would not reach alike. Leave it at 1.0 or use "
            "osp.BSP()")
    compressor = resolve(compression)
    check_groups(groups, optimizer)
    for name, value in (("sparse_as_dense", sparse_as_dense), ("broadcast_parameters", broadcast_parameters)):
        if not isinstance(value, bool):
            raise ValueError(f"osp: {name} must be True or False, got {value!r}")
    return red, compressor


class HorovodSurface:
    """What ``hvd.DistributedOptimizer`` has beyond ``torch.optim``'s surface, as code written for it uses it:
    ``synchronize()`` / ``skip_synchronize()`` (with Horovod's warning for a step after ``synchronize()``
    outside ``skip_synchronize()``) and ``_parameter_names``. A base of ``DistributedOptimizer``."""

    _synchronized = False  # BSP: synchronize() ran since the last step (Horovod's warning)
    _skip_synchronize = False

    @property
    def _parameter_names(self) -> dict:
        """``{parameter: name}``, as Horovod's optimizer has it (names from ``named_parameters``, else
        Horovod's ``allreduce.noname.<g>.<i>``)."""
        return dict(self._signature[0])

    def synchronize(self) -> None:
        """BSP: make sure ``.grad`` holds the average (it does once the step's last backward pass has
        returned); Horovod's contract, with ``skip_synchronize()``. OSP, DSync and HSP refuse it: their
        average is only complete inside (or after) ``step()``, so an edit of ``.grad`` between the two
        could not act on it; ``clip_grad_norm_`` is the exact alternative for clipping."""
        self._acc.check_fresh()
        if not self.mode.grad_is_average or self.mode.may_defer:
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

    def _check_synchronized(self) -> None:
        """At ``step()``: Horovod's warning for a step after ``synchronize()`` outside ``skip_synchronize()``."""
        if self._synchronized and not self._skip_synchronize:
            warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                 "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                 "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                 "your code.", UserWarning)
        self._synchronized = False
