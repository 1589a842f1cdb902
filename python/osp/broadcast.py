"""Making every rank start alike: broadcasts of parameters, buffers and optimizer state (Horovod's
``broadcast_parameters`` / ``broadcast_optimizer_state``, DDP's ``broadcast_buffers``)."""
from __future__ import annotations

from collections import defaultdict

import torch

from .comm import Comm, get_comm, running_alone


def sync_buffers(module: torch.nn.Module, root_rank: int = 0, backend="auto") -> None:
    """Make every rank's buffers (BatchNorm running statistics and counters, ...) equal to
    ``root_rank``'s, as DDP's ``broadcast_buffers`` does before each forward. Call it on every rank,
    e.g. after ``opt.flush()`` and before evaluating or checkpointing: then ``model.eval()`` predicts
    alike on every rank."""
    _broadcast_coalesced(get_comm(backend), [b for _, b in module.named_buffers()], root_rank, "osp.sync_buffers")


def broadcast_buffers(module: torch.nn.Module, root_rank: int = 0, backend="auto"):
    """DDP's ``broadcast_buffers=True`` as a hook: before each forward of ``module`` in training (``module.training``
    and gradients enabled), every rank's buffers (BatchNorm running statistics and counters) become
    ``root_rank``'s, so each rank's forward updates them from the same values, exactly as under DDP. The buffers
    travel in one broadcast per dtype and device (DDP coalesces them too); a blocking collective at every
    forward, which DDP pays as well. Call it on every rank, once; returns the hook's handle
    (``handle.remove()`` stops it). Evaluation forwards leave the buffers alone, as DDP's do: call
    ``osp.sync_buffers(module)`` before evaluating to start it from root's. The forwards of HSP's extra
    micro-batches (``opt.step(closure)``) run on one rank alone: they broadcast nothing (the next regular
    forward makes the buffers root's again)."""
    comm = get_comm(backend)

    def pre_forward(mod, args):
        # a collective only where every rank issues it: not in an extra micro-batch, which meets the others' step
        if mod.training and torch.is_grad_enabled() and not running_alone():
            _broadcast_coalesced(comm, [b for _, b in mod.named_buffers()], root_rank, "osp.bcast_buffers")

    return module.register_forward_pre_hook(pre_forward)


def _broadcast_coalesced(comm, tensors, root_rank: int, name: str) -> None:
    """``tensors`` from ``root_rank``, in place: one broadcast per (dtype, device)."""
    by_kind = defaultdict(list)
    for t in tensors:
        if t.numel():
            by_kind[(t.dtype, t.device)].append(t)
    with torch.no_grad():
        # the same order on every rank (ranks on different GPUs differ only in the device index)
        for k, (_, ts) in enumerate(sorted(by_kind.items(), key=lambda kv: (str(kv[0][0]), kv[0][1].type))):
            flat = torch.cat([t.reshape(-1) for t in ts])
            comm.broadcast_(flat, root_rank, f"{name}.{k}")
            off = 0
            for t in ts:
                t.copy_(flat[off:off + t.numel()].view_as(t))
                off += t.numel()


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
    """Make every rank's optimizer state (and hyper-parameters) equal to ``root_rank``'s: a
    ``torch.optim`` optimizer's, or a ``DistributedOptimizer``'s: the wrapped optimizer's and osp's own.
    Call it on every rank at the same point (it is a collective): a ``DistributedOptimizer``'s work in flight
    is flushed there first, so the state sent holds exact updates (as ``hvd.broadcast_optimizer_state`` on it
    does). A rank whose state is not made yet (no step so far) gets root's, and where root has none yet every
    rank keeps none (the first step makes it alike everywhere); the gradients are left as they are. The state
    tensors travel in place, on each rank's own device (``broadcast_state``)."""
    if isinstance(getattr(optimizer, "comm", None), Comm):  # a DistributedOptimizer (no import: no cycle)
        if optimizer.in_flight:  # the same on every rank: every rank ran the same steps
            optimizer.flush()
        # its state_dict() holds osp's own part too (OSP's scores and budget decide the next split)
        comm, device = optimizer.comm, optimizer.groups[0].device
    else:
        comm = get_comm(backend)
        device = next((p.device for g in optimizer.param_groups for p in g["params"]), torch.device("cpu"))
    optimizer.load_state_dict(broadcast_state(comm, optimizer.state_dict(), root_rank, device, "osp.bcast_state"))


class _Tensor:
    """Where a tensor of ``root``'s state goes: its shape and dtype; ``value`` carries it when it travels in
    the object (a scalar, or a tensor kept on the host while training on a device)."""

    __slots__ = ("shape", "dtype", "value")

    def __init__(self, t: torch.Tensor, inline: bool):
        self.shape, self.dtype = tuple(t.shape), t.dtype
        self.value = t.detach().cpu().clone() if inline else None


def _flatten(obj, path=()):
    """(path, tensor) of every tensor in a nest of dicts, lists and tuples."""
    if torch.is_tensor(obj):
        yield path, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, path + (k,))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _flatten(v, path + (i,))


def _skeleton(obj, device: torch.device):
    if torch.is_tensor(obj):
        # scalars (step counts), and host tensors of a job training on a device, travel in the object: an
        # engine on device tensors (NCCL) may not take host ones
        return _Tensor(obj, inline=obj.numel() <= 1 or (obj.device.type == "cpu" and device.type != "cpu"))
    if isinstance(obj, dict):
        return {k: _skeleton(v, device) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_skeleton(v, device) for v in obj)
    return obj


def broadcast_state(comm, state: dict, root: int, device: torch.device, name: str) -> dict:
    """``root``'s ``state`` (a nest of dicts and lists holding tensors, as ``state_dict()`` returns) on every
    rank. Its structure and plain values travel in one small object broadcast; its tensors by value, in
    place: coalesced by dtype into one buffer each, broadcast on ``device`` (this rank's own), never pickled
    (which would put every rank's copy on root's device, through the host). This rank's own tensor at the
    same place in ``state`` is overwritten where it has root's shape and dtype; elsewhere a new one is made
    on ``device``."""
    skeleton = comm.broadcast_object(_skeleton(state, device) if comm.rank == root else None, root)
    moving: list = []  # the tensors that travel in place, in the skeleton's order (the same on every rank)
    out = _fill(skeleton, dict(_flatten(state)), device, (), moving)
    by_dtype: dict = {}
    for t in moving:
        if t.numel():
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
    for k, ((dtype, dev), ts) in enumerate(sorted(by_dtype.items(), key=lambda kv: str(kv[0]))):
        if comm.rank == root:
            buf = torch.cat([t.detach().reshape(-1) for t in ts])
        else:
            buf = torch.empty(sum(t.numel() for t in ts), dtype=dtype, device=dev)
        comm.broadcast_(buf, root, f"{name}.{k}")
        if comm.rank != root:
            o = 0
            with torch.no_grad():
                for t in ts:
                    t.copy_(buf[o:o + t.numel()].view_as(t))
                    o += t.numel()
    return out


def _fill(node, mine: dict, device: torch.device, path, moving: list):
    """The skeleton with its tensors: carried values, this rank's own where they fit, or new ones on
    ``device`` (those two appended to ``moving``)."""
    if isinstance(node, _Tensor):
        if node.value is not None:
            return node.value
        own = mine.get(path)
        if own is not None and tuple(own.shape) == node.shape and own.dtype == node.dtype and own.device == device:
            t = own
        else:
            t = torch.empty(node.shape, dtype=node.dtype, device=device)
        moving.append(t)
        return t
    if isinstance(node, dict):
        return {k: _fill(v, mine, device, path + (k,), moving) for k, v in node.items()}
    if isinstance(node, (list, tuple)):
        return type(node)(_fill(v, mine, device, path + (i,), moving) for i, v in enumerate(node))
    return node
