"""``osp.horovod``'s collectives: Horovod's ``allreduce`` / ``allgather`` / ``broadcast`` / ``alltoall`` (blocking,
asynchronous with a handle, in place, grouped), ``barrier``, ``poll`` and ``synchronize``, on torch.distributed.

Where they depart from Horovod (each function's docstring says its own):

- **Order, not names.** Horovod matches a collective across ranks by its ``name`` (ranks may issue them in any
  order); torch.distributed matches them by the order in which each rank issues them. Every rank must issue the
  same collectives in the same order; ``name`` is accepted and ignored.
- Gloo has no average: an average is a sum divided by the set's size. An integer tensor's average, and its
  ``prescale_factor`` / ``postscale_factor``, are scaled in float64 and truncated toward zero, as Horovod's
  (``ScaleBuffer``: the average is a post-scale by ``1 / size``).
- Gloo and NCCL have no int16: an int16 tensor travels as int32 (exact; a sum wraps around as in int16).
- ``op=hvd.Adasum`` is refused (no Adasum on torch.distributed).
"""
from __future__ import annotations

import os
from typing import Callable, List, Optional

import torch
import torch.distributed as dist

from . import basics
from .basics import (
    Adasum,
    Average,
    CollectiveMismatchError,
    HorovodInternalError,
    Max,
    Min,
    Product,
    ReduceOp,
    Sum,
    global_process_set,
)

_TORCH_OPS = {Sum: dist.ReduceOp.SUM, Average: dist.ReduceOp.SUM, Min: dist.ReduceOp.MIN, Max: dist.ReduceOp.MAX,
              Product: dist.ReduceOp.PRODUCT}


class Handle:
    """An asynchronous collective: its torch.distributed works, and what makes its result once they completed.
    ``poll()`` tests it, ``synchronize()`` waits for it and returns the result."""

    __slots__ = ("works", "finish", "result", "done")

    def __init__(self, works: list, finish: Callable[[], object]):
        self.works, self.finish, self.result, self.done = [w for w in works if w is not None], finish, None, False


def poll(handle: Handle) -> bool:
    """Whether the collective of ``handle`` completed (then ``synchronize`` does not block)."""
    return handle.done or all(w.is_completed() for w in handle.works)


def synchronize(handle: Handle):
    """Wait for ``handle``'s collective and return its result (a tensor, or a tuple for ``alltoall`` with
    ``splits``). A collective that failed (a peer died, the group was destroyed) raises ``HorovodInternalError``."""
    if not isinstance(handle, Handle):
        raise ValueError(f"osp.horovod: synchronize() expects a handle from an *_async function, got {handle!r}")
    if not handle.done:
        try:
            for w in handle.works:
                w.wait()
            handle.result = handle.finish()
        except RuntimeError as e:
            raise HorovodInternalError(e) from e
        handle.done, handle.works = True, []
    return handle.result


def _start(fn):
    try:
        return fn()
    except RuntimeError as e:  # a broken group, a peer gone
        raise HorovodInternalError(e) from e


def _op(op, average) -> ReduceOp:
    if average is not None:
        if op is not None:
            raise ValueError("osp.horovod: pass op= or the deprecated average=, not both")
        return Average if average else Sum
    if op is None:
        return Average
    try:
        op = ReduceOp(op)
    except ValueError:
        raise ValueError(f"osp.horovod: op must be hvd.Average, Sum, Min, Max or Product, got {op!r}") from None
    if op == Adasum:
        raise NotImplementedError("osp.horovod: op=hvd.Adasum is not available on torch.distributed (Adasum is a "
                                  "Horovod-only reduction): use hvd.Average, or keep Horovod for Adasum")
    return op


def _set(process_set, what: str) -> Optional[object]:
    """The group of ``process_set`` after checking this rank is in it (``None``: the default group)."""
    basics._need_init()
    if process_set is None or process_set is global_process_set:
        return None
    if not isinstance(process_set, basics.ProcessSet):
        raise ValueError(f"osp.horovod: process_set must be an osp.horovod ProcessSet, got {process_set!r}")
    process_set._check_member(what)
    return process_set.group


def _size(group) -> int:
    return dist.get_world_size(group)


_CHECK = os.environ.get("OSP_HOROVOD_CHECK", "1") != "0"


def _agree(group, kind: str, tensor: Optional[torch.Tensor] = None, problem: Optional[str] = None, first_dim=True,
           **desc) -> None:
    """Horovod's coordinator compares every rank's request before a collective runs and raises on every rank where
    they differ; torch.distributed does not (Gloo then reduces bytes that happen to fit, or aborts the process).
    So before each collective the ranks exchange what they are about to do (its kind, dtype, device, shape, or
    all but the first dimension where that may differ, and ``desc``: op, root, ...) and a problem one rank found
    with its own arguments; anything that differs, or any problem, raises the same error on every rank. One small
    blocking exchange per call (``OSP_HOROVOD_CHECK=0`` turns it off); the optimizer's own collectives do not go
    through here."""
    n = _size(group)
    if not _CHECK:
        if problem is not None:
            raise ValueError(f"osp.horovod: {kind}: {problem}")
        return
    if tensor is not None:
        shape = tuple(tensor.shape) if first_dim else ("*",) + tuple(tensor.shape[1:])
        desc.update(dtype=str(tensor.dtype).replace("torch.", ""), device=tensor.device.type, shape=shape)
    mine = (kind, tuple(sorted(desc.items())), problem)
    if n == 1:
        everyone = [mine]
    else:
        everyone = [None] * n
        _start(lambda: dist.all_gather_object(everyone, mine, group=group))
    ranks = list(range(n)) if group is None else dist.get_process_group_ranks(group)
    problems = [f"rank {ranks[i]}: {e[2]}" for i, e in enumerate(everyone) if e[2] is not None]
    if problems:
        raise ValueError(f"osp.horovod: {kind}: " + "; ".join(problems))
    if any(e[:2] != everyone[0][:2] for e in everyone):
        said = "; ".join(f"rank {ranks[i]}: {e[0]} " + ", ".join(f"{k}={v}" for k, v in e[1])
                         for i, e in enumerate(everyone))
        raise CollectiveMismatchError(
            f"osp.horovod: the ranks disagree on a collective ({said}). Every rank must issue the same collectives, "
            "with the same dtype, shape (allgather and alltoall: all but the first dimension), op and root, in the "
            "same order (they are matched by order, not by name)")


# dtypes torch.distributed's Gloo (and NCCL) have no kernels for ("Invalid scalar type"), sent as a wider one that
# holds every value; Horovod reduces and moves int16
_WIDER = {torch.int16: torch.int32}


def _wire(tensor):
    """``tensor`` as it travels: itself, or a widened copy (see ``_WIDER``)."""
    wide = _WIDER.get(tensor.dtype)
    return tensor if wide is None else tensor.to(wide)


def _scale(tensor, factor) -> None:
    """``tensor *= factor`` in place, as Horovod scales: an integer tensor in float64, truncated toward zero."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.mul_(factor)
    else:
        tensor.copy_(tensor.to(torch.float64).mul_(factor))


def _allreduce_async(tensor, output, op, prescale_factor, postscale_factor, process_set) -> Handle:
    group = _set(process_set, "allreduce")
    if not isinstance(tensor, torch.Tensor):
        _agree(group, "allreduce", problem=f"expects a tensor, got {type(tensor).__name__}")
    _agree(group, "allreduce", tensor, op=int(op), prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    if output is not tensor:
        output.copy_(tensor)
    if prescale_factor != 1.0:
        _scale(output, prescale_factor)
    wire = _wire(output)
    work = _start(lambda: dist.all_reduce(wire, op=_TORCH_OPS[op], group=group, async_op=True))

    def finish():
        if wire is not output:
            output.copy_(wire)
        if output.is_floating_point() or output.is_complex():
            if op == Average:
                output.div_(_size(group))
            if postscale_factor != 1.0:
                output.mul_(postscale_factor)
        elif op == Average or postscale_factor != 1.0:  # Horovod: one post-scale by postscale_factor / size
            _scale(output, postscale_factor / (_size(group) if op == Average else 1))
        return output

    return Handle([work], finish)


def allreduce_async_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                     process_set=global_process_set) -> Handle:
    """Start reducing ``tensor`` in place over the ranks of ``process_set``; a handle for ``synchronize``."""
    return _allreduce_async(tensor, tensor, _op(op, average), prescale_factor, postscale_factor, process_set)


def allreduce_async(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                    process_set=global_process_set) -> Handle:
    """Start reducing a copy of ``tensor`` (left as it is); a handle for ``synchronize``."""
    return _allreduce_async(tensor, torch.empty_like(tensor), _op(op, average), prescale_factor, postscale_factor,
                            process_set)


def allreduce_(tensor, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
               process_set=global_process_set) -> torch.Tensor:
    """Reduce ``tensor`` in place (``op``: Average by default, Sum, Min, Max, Product) and return it."""
    return synchronize(allreduce_async_(tensor, average, name, op, prescale_factor, postscale_factor, process_set))


class _Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, op, prescale_factor, postscale_factor, process_set):
        ctx.args = (op, prescale_factor, postscale_factor, process_set)
        return synchronize(_allreduce_async(tensor, torch.empty_like(tensor), op, prescale_factor, postscale_factor,
                                            process_set))

    @staticmethod
    def backward(ctx, grad_output):
        op, pre, post, ps = ctx.args
        out = synchronize(_allreduce_async(grad_output, torch.empty_like(grad_output), op, pre, post, ps))
        return out, None, None, None, None


def allreduce(tensor, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
              postscale_factor=1.0, process_set=global_process_set) -> torch.Tensor:
    """The reduction of ``tensor`` over the ranks (``tensor`` is left as it is), differentiable as Horovod's (the
    gradient is reduced the same way). ``compression``: ``hvd.Compression.fp16`` sends it in float16."""
    op = _op(op, average)
    if compression is not None:
        tensor, cctx = compression.compress(tensor)
    out = _Allreduce.apply(tensor, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, cctx) if compression is not None else out


def grouped_allreduce_async_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                             process_set=global_process_set) -> Handle:
    """Start reducing each of ``tensors`` in place; ``synchronize`` returns the list."""
    op = _op(op, average)
    handles = [_allreduce_async(t, t, op, prescale_factor, postscale_factor, process_set) for t in tensors]
    return Handle([w for h in handles for w in h.works], lambda: [h.finish() for h in handles])


def grouped_allreduce_async(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                            process_set=global_process_set) -> Handle:
    op = _op(op, average)
    handles = [_allreduce_async(t, torch.empty_like(t), op, prescale_factor, postscale_factor, process_set)
               for t in tensors]
    return Handle([w for h in handles for w in h.works], lambda: [h.finish() for h in handles])


def grouped_allreduce_(tensors, average=None, name=None, op=None, prescale_factor=1.0, postscale_factor=1.0,
                       process_set=global_process_set) -> List[torch.Tensor]:
    return synchronize(grouped_allreduce_async_(tensors, average, name, op, prescale_factor, postscale_factor,
                                                process_set))


def grouped_allreduce(tensors, average=None, name=None, compression=None, op=None, prescale_factor=1.0,
                      postscale_factor=1.0, process_set=global_process_set) -> List[torch.Tensor]:
    """Each of ``tensors`` reduced (differentiable, as ``allreduce``)."""
    return [allreduce(t, average, name, compression, op, prescale_factor, postscale_factor, process_set)
            for t in tensors]


def _allgather_async(tensor, process_set) -> Handle:
    group = _set(process_set, "allgather")
    _agree(group, "allgather", tensor, first_dim=False,
           problem="needs a tensor of at least one dimension (it concatenates on the first), got a scalar"
           if tensor.dim() == 0 else None)
    n = _size(group)
    # the first dimension may differ between ranks: gather the lengths, then pad every tensor to the longest
    rows = torch.tensor([tensor.shape[0]], dtype=torch.int64, device=tensor.device)
    all_rows = [torch.empty_like(rows) for _ in range(n)]
    _start(lambda: dist.all_gather(all_rows, rows, group=group))
    lengths = [int(r.item()) for r in all_rows]
    longest = max(lengths)
    padded = _wire(tensor.contiguous())
    if tensor.shape[0] < longest:
        padded = torch.cat([padded, padded.new_zeros((longest - tensor.shape[0],) + tuple(tensor.shape[1:]))])
    outs = [torch.empty_like(padded) for _ in range(n)]
    work = _start(lambda: dist.all_gather(outs, padded, group=group, async_op=True))
    return Handle([work], lambda: torch.cat([o[:k] for o, k in zip(outs, lengths)]).to(tensor.dtype))


def allgather_async(tensor, name=None, process_set=global_process_set) -> Handle:
    """Start concatenating every rank's ``tensor`` on the first dimension (which may differ between ranks; the
    lengths are exchanged first, so this returns after one small blocking collective)."""
    return _allgather_async(tensor, process_set)


class _Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(_allgather_async(tensor, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        # as Horovod: the average of the gradients, then this rank's rows
        ps = ctx.process_set
        reduced = synchronize(_allreduce_async(grad_output, torch.empty_like(grad_output), Average, 1.0, 1.0, ps))
        rows = synchronize(_allgather_async(torch.tensor([ctx.rows]), ps))
        me = dist.get_rank(_set(ps, "allgather"))
        offset = int(rows[:me].sum()) if me else 0
        return reduced.narrow(0, offset, ctx.rows), None


def allgather(tensor, name=None, process_set=global_process_set) -> torch.Tensor:
    """Every rank's ``tensor`` concatenated on the first dimension, in rank order (differentiable, as Horovod's)."""
    return _Allgather.apply(tensor, process_set)


def grouped_allgather_async(tensors, name=None, process_set=global_process_set) -> Handle:
    handles = [_allgather_async(t, process_set) for t in tensors]
    return Handle([w for h in handles for w in h.works], lambda: [h.finish() for h in handles])


def grouped_allgather(tensors, name=None, process_set=global_process_set) -> List[torch.Tensor]:
    return [allgather(t, name, process_set) for t in tensors]


def _broadcast_async(tensor, output, root_rank, process_set) -> Handle:
    group = _set(process_set, "broadcast")
    ranks = basics.global_process_set.ranks if group is None else process_set.ranks
    _agree(group, "broadcast", tensor, root=root_rank,
           problem=None if root_rank in ranks else f"root_rank {root_rank!r} is not a rank of the process set "
           f"({ranks}); roots are global ranks, as in Horovod")
    if output is not tensor:
        output.copy_(tensor)
    wire = _wire(output)
    work = _start(lambda: dist.broadcast(wire, src=root_rank, group=group, async_op=True))
    return Handle([work], lambda: output if wire is output else output.copy_(wire))


def broadcast_async_(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    """Start overwriting ``tensor`` with ``root_rank``'s (a global rank, also within a process set)."""
    return _broadcast_async(tensor, tensor, root_rank, process_set)


def broadcast_async(tensor, root_rank, name=None, process_set=global_process_set) -> Handle:
    return _broadcast_async(tensor, torch.empty_like(tensor), root_rank, process_set)


def broadcast_(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """``tensor`` overwritten in place with ``root_rank``'s, and returned."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(_broadcast_async(tensor, torch.empty_like(tensor), root_rank, process_set))

    @staticmethod
    def backward(ctx, grad_output):
        reduced = synchronize(_allreduce_async(grad_output, torch.empty_like(grad_output), Average, 1.0, 1.0,
                                               ctx.process_set))
        if dist.get_rank() != ctx.root_rank:
            reduced.zero_()
        return reduced, None, None


def broadcast(tensor, root_rank, name=None, process_set=global_process_set) -> torch.Tensor:
    """A copy of ``root_rank``'s ``tensor`` (differentiable, as Horovod's)."""
    return _Broadcast.apply(tensor, root_rank, process_set)


def _alltoall_async(tensor, splits, process_set, counts: bool = False) -> Handle:
    group = _set(process_set, "alltoall")
    n = _size(group)
    given, problem = splits is not None, None
    if splits is None:
        send = [tensor.shape[0] // n] * n
        if tensor.shape[0] % n:
            problem = (f"without splits the first dimension ({tensor.shape[0]}) is divided equally between {n} ranks; "
                       "pass splits=")
    else:
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != n or any(s < 0 for s in send) or sum(send) != tensor.shape[0]:
            problem = (f"splits must be {n} non-negative counts summing to the first dimension ({tensor.shape[0]}), "
                       f"got {send}")
    _agree(group, "alltoall", tensor, problem, first_dim=False, splits=given)
    sent = torch.tensor(send, dtype=torch.int64, device=tensor.device)
    got = torch.empty_like(sent)
    _start(lambda: dist.all_to_all_single(got, sent, group=group))
    recv = [int(x) for x in got.tolist()]
    send_wire = _wire(tensor.contiguous())
    out = send_wire.new_empty((sum(recv),) + tuple(tensor.shape[1:]))
    work = _start(lambda: dist.all_to_all_single(out, send_wire, recv, send, group=group, async_op=True))
    received = torch.tensor(recv, dtype=torch.int32)

    def finish():
        res = out.to(tensor.dtype)
        return (res, received) if given or counts else res

    return Handle([work], finish)


def alltoall_async(tensor, splits=None, name=None, process_set=global_process_set) -> Handle:
    """Start sending ``splits[j]`` rows of ``tensor`` to rank ``j`` (equal parts without ``splits``); the counts
    are exchanged first, in a small blocking collective. ``synchronize`` returns ``(output, received_splits)``,
    the int32 counts received from each rank, with ``splits`` given or not (as Horovod's)."""
    return _alltoall_async(tensor, splits, process_set, counts=True)


class _Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, process_set):
        ctx.process_set = process_set
        # the counts received are the backward's splits, also where the forward split equally (the ranks' first
        # dimensions may differ: each rank's gradient goes back in the parts it came in)
        out, ctx.received = synchronize(_alltoall_async(tensor, splits, process_set, counts=True))
        if splits is None:
            return out
        ctx.mark_non_differentiable(ctx.received)
        return out, ctx.received

    @staticmethod
    def backward(ctx, grad_output, *unused):
        back = synchronize(_alltoall_async(grad_output.contiguous(), ctx.received, ctx.process_set))
        return (back[0] if isinstance(back, tuple) else back), None, None


def alltoall(tensor, splits=None, name=None, process_set=global_process_set):
    """``splits[j]`` rows of ``tensor`` go to rank ``j``; returns what every rank sent here, in rank order, and,
    when ``splits`` is given, the int32 counts received from each rank (differentiable, as Horovod's)."""
    return _Alltoall.apply(tensor, splits, process_set)


def barrier(process_set=global_process_set) -> None:
    """Wait until every rank of ``process_set`` got here."""
    group = _set(process_set, "barrier")
    _agree(group, "barrier")
    _start(lambda: dist.barrier(group=group))


def reducescatter(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                  postscale_factor=1.0):
    raise NotImplementedError("osp.horovod: reducescatter is not provided (Gloo has no reduce-scatter): use "
                              "hvd.allreduce and keep this rank's slice")


def reducescatter_async(tensor, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                        postscale_factor=1.0):
    reducescatter(tensor)


def grouped_reducescatter(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                          postscale_factor=1.0):
    reducescatter(tensors)


def grouped_reducescatter_async(tensors, name=None, op=Average, process_set=global_process_set, prescale_factor=1.0,
                                postscale_factor=1.0):
    reducescatter(tensors)


def sparse_allreduce_async(tensor, name, op, process_set=global_process_set):
    raise NotImplementedError("osp.horovod: sparse allreduce is not provided; pass sparse_as_dense=True to "
                              "DistributedOptimizer, or allreduce tensor.to_dense()")
