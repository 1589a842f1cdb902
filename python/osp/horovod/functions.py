"""``osp.horovod``'s optimizer and state functions: ``DistributedOptimizer`` (osp's, every mode; BSP by default, as
Horovod's), ``broadcast_parameters``, ``broadcast_optimizer_state``, ``broadcast_object``, ``allgather_object`` and
``join``, on torch.distributed."""
from __future__ import annotations

import time
import warnings
import weakref

import torch
import torch.distributed as dist

from .. import broadcast as _bcast
from .. import statedict
from ..comm import TorchComm
from ..modes import BSP
from ..optimizer import DistributedOptimizer as _OSPOptimizer
from . import basics, ops
from .basics import Average, global_process_set

_optimizers: "weakref.WeakSet[_OSPOptimizer]" = weakref.WeakSet()  # made here, on the global set: join() joins them


def DistributedOptimizer(optimizer, named_parameters=None, compression=None, backward_passes_per_step=1, op=Average,
                         gradient_predivide_factor=1.0, num_groups=0, groups=None, sparse_as_dense=False,
                         process_set=global_process_set, sync=None, **kwargs):
    """``hvd.DistributedOptimizer``: osp's ``DistributedOptimizer`` on torch.distributed, with every one of Horovod's
    keywords (``osp.keywords``), ``process_set`` an ``osp.horovod`` set (on a rank outside it the optimizer steps on
    the rank's own gradient, as Horovod's). ``sync`` is osp's mode: ``osp.BSP()`` by default here, Horovod's
    algorithm, so that a script changed only in its import line trains as it did; pass ``sync=osp.OSP()`` (or
    ``DSync``, ``HSP``) for osp's faster modes. Further keywords go to ``osp.DistributedOptimizer`` (``timeout``,
    ``check_replicas``, ...). Departs from Horovod: ``op=hvd.Adasum`` is refused; ``synchronize()`` is for BSP
    only."""
    basics._need_init()
    if num_groups:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if process_set is not global_process_set and not isinstance(process_set, basics.ProcessSet):
        raise ValueError(f"osp.horovod: process_set must be an osp.horovod ProcessSet, got {process_set!r}")
    if compression is None:
        from ..compression import Compression

        compression = Compression.none
    opt = _OSPOptimizer(optimizer, named_parameters=named_parameters, sync=BSP() if sync is None else sync,
                        backend="torch", backward_passes_per_step=backward_passes_per_step, compression=compression,
                        op=op, gradient_predivide_factor=gradient_predivide_factor, groups=groups or None,
                        sparse_as_dense=sparse_as_dense,
                        process_set=None if process_set is global_process_set else process_set, **kwargs)
    if process_set is global_process_set:
        _optimizers.add(opt)
    return opt


def broadcast_parameters(params, root_rank, process_set=global_process_set) -> None:
    """``hvd.broadcast_parameters``: ``params`` (a ``state_dict()``, ``named_parameters()`` or a list of tensors)
    from ``root_rank``, in place."""
    if isinstance(params, dict):
        items = sorted(params.items())
    elif hasattr(params, "__iter__"):  # a list of tensors, or of (name, tensor) pairs
        items = [p if isinstance(p, tuple) else (str(k), p) for k, p in enumerate(params)]
    else:
        raise ValueError(f"invalid params of type: {type(params)}")
    handles = []
    with torch.no_grad():
        for _, p in items:
            if torch.is_tensor(p):
                handles.append(ops.broadcast_async_(p.data if isinstance(p, torch.nn.Parameter) else p, root_rank,
                                                    process_set=process_set))
    for h in handles:
        ops.synchronize(h)


def broadcast_optimizer_state(optimizer, root_rank, model=None, process_set=global_process_set) -> None:
    """``hvd.broadcast_optimizer_state``: every rank's optimizer state and hyper-parameters become ``root_rank``'s.
    As Horovod, an optimizer without state first makes it with zero gradients (the gradients stay zeros); unlike
    Horovod, that first step does not move the parameters (with weight decay Horovod's does, on those ranks only).
    An osp ``DistributedOptimizer`` with work in flight is flushed first (every rank calls this at the same
    point), so the state holds exact updates. ``torch.optim.LBFGS`` is refused, as in Horovod."""
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError("cannot broadcast torch.optim.LBFGS state")
    if isinstance(optimizer, _OSPOptimizer):
        if not optimizer.optimizer.state:
            statedict.init_state_for_horovod(optimizer)
        comm, ps = optimizer.comm, optimizer.process_set
    else:
        comm, ps = TorchComm(ops._set(process_set, "broadcast_optimizer_state")), process_set
        if not optimizer.state:
            _init_plain_state(optimizer, model)
    # osp's roots are ranks within the communicator, Horovod's global ranks (alone: a world of one, or a rank
    # outside the optimizer's process set, its own); osp's function flushes work in flight first
    if comm.size == 1:
        root = 0
    elif isinstance(ps, basics.ProcessSet) and ps is not global_process_set:
        root = ps.ranks.index(root_rank)
    else:
        root = root_rank
    _bcast.broadcast_optimizer_state(optimizer, root, backend=comm)


def _init_plain_state(optimizer, model) -> None:
    """Horovod's state initialization of a plain ``torch.optim`` optimizer: zero gradients and a step; the parameters
    are put back (a zero-gradient step moves them under weight decay)."""
    sparse = {id(p) for m in (model.modules() if model is not None else ())
              if isinstance(m, torch.nn.Embedding) and m.sparse for p in m.parameters()}
    kept = []
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
                if isinstance(optimizer, torch.optim.SparseAdam) or id(p) in sparse:
                    p.grad = p.grad.to_sparse()
                kept.append((p, p.detach().clone()))
    optimizer.step()
    with torch.no_grad():
        for p, v in kept:
            p.copy_(v)


def broadcast_object(obj, root_rank=0, name=None, process_set=global_process_set):
    """``hvd.broadcast_object``: ``root_rank``'s ``obj`` (any picklable object) on every rank of the set."""
    group = ops._set(process_set, "broadcast_object")
    box = [obj]
    dist.broadcast_object_list(box, src=root_rank, group=group)
    return box[0]


def allgather_object(obj, name=None, process_set=global_process_set) -> list:
    """``hvd.allgather_object``: every rank's ``obj``, in rank order."""
    group = ops._set(process_set, "allgather_object")
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def join(device=-1) -> int:
    """``hvd.join()``: this rank is out of data. With the ``DistributedOptimizer`` made here on the global set, it
    takes part in the other ranks' steps with zero gradients until every rank joined (``osp.DistributedOptimizer
    .join``), and every rank leaves at the same step with equal replicas. Returns the rank that joined last.
    Departs from Horovod: meanwhile the other ranks may only step that optimizer (Horovod also answers their other
    allreduces with zeros; here a collective of their own would meet a step's; without an optimizer, it raises
    ``CollectiveMismatchError`` on every rank). With several such optimizers, call
    ``opt.join()`` on each instead. ``device`` is accepted and ignored."""
    basics._need_init()
    live = list(_optimizers)
    if len(live) > 1:
        raise RuntimeError(f"osp.horovod: join() with {len(live)} DistributedOptimizers made on the global set: "
                           "which steps the joined rank shadows is ambiguous; call opt.join() on each, in the order "
                           "they step")
    if live:
        return live[0].join()
    mine = time.time()
    # a rank still running collectives of its own would meet this one: the same clear error on every rank
    ops._agree(None, "join")
    stamps = [None] * dist.get_world_size()
    dist.all_gather_object(stamps, mine)
    return max(range(len(stamps)), key=lambda r: stamps[r])
