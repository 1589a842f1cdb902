"""Making every rank start alike: broadcasts of parameters, buffers and optimizer state (Horovod's
``broadcast_parameters`` / ``broadcast_optimizer_state``, DDP's ``broadcast_buffers``)."""
from __future__ import annotations

import torch

from .comm import get_comm
from .optimizer import DistributedOptimizer


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
    """Make every rank's optimizer state (and hyper-parameters) equal to ``root_rank``'s: a
    ``torch.optim`` optimizer's, or the optimizer a ``DistributedOptimizer`` wraps (call ``flush()``
    first: its state must hold exact updates)."""
    comm = get_comm(backend)
    inner = optimizer.optimizer if isinstance(optimizer, DistributedOptimizer) else optimizer
    optimizer.load_state_dict(comm.broadcast_object(inner.state_dict(), root_rank))
