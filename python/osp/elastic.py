"""Ranks that join, leave and fail: Horovod Elastic for an osp optimizer.

Horovod Elastic (``horovodrun --min-np/--max-np --host-discovery-script``) restarts the engine when a
rank fails or the hosts change; ``osp.elastic.State`` is its ``hvd.elastic.TorchState`` for a
``DistributedOptimizer`` of any mode::

    state = osp.elastic.State(model, opt, epoch=0, batch=0)

    @hvd.elastic.run
    def train(state):
        ...                     # steps; every N of them:
        state.commit()

    train(state)

What it adds to ``TorchState``:

- ``commit()`` flushes the optimizer first (OSP's stage 2, DSync's delayed averages), so a commit
  holds exact updates and replicas bitwise equal; so does ``check_host_updates()``, so that a host
  change (which resets the engine without restoring) continues from exact parameters.
- After a failure (``HorovodInternalError``) every rank drops what was in flight and restores the last
  commit; after any reset the optimizer rebuilds its mode for the new world size (OSP's budget
  measures again; the block scores, shared by every rank, are kept).
- ``sync()`` (at the start and after each reset) checks that every rank, new ones too, wraps the same
  parameters with the same options, then broadcasts rank 0's parameters, buffers, optimizer state and
  osp's own state (the scores and budget).

At most the steps since the last commit are redone after a failure; nothing committed is lost. Every
``DistributedOptimizer`` of the job must be in the state (pass further ones as keyword arguments):
one left out would keep collectives of the engine that is gone. Other keyword arguments are handled as
``TorchState`` handles them (LR schedulers, ``ElasticSampler``, plain Python values).

Horovod's own ``hvd.elastic.TorchState`` holding a ``DistributedOptimizer`` (the one-line swap from
``hvd.DistributedOptimizer``) works too, through Horovod's public handler registry (``get_handler_registry``):
importing this module, or building a ``DistributedOptimizer`` once Horovod's elastic state is imported, puts osp's
handlers for a ``DistributedOptimizer`` and for a model first in it. Its ``commit()`` then flushes before the model
is saved, its restore after a failure drops what was in flight, its ``sync()`` checks every rank's parameters, and
the optimizer rebuilds its mode for a new world at its next use (``osp.statedict.follow_world``). A host
change noticed outside ``commit()`` with work in flight is refused (naming this class, whose
``check_host_updates()`` flushes first).
"""
from __future__ import annotations

import socket

import torch

from . import statedict
from .optimizer import DistributedOptimizer

__all__ = ["State", "run", "local_host_names"]


try:
    import horovod.torch as hvd
    from horovod.torch.elastic.state import TorchState
except ImportError as e:  # pragma: no cover - Horovod is installed with osp's test setup
    raise ImportError(f"osp.elastic needs Horovod with PyTorch support ({e})") from None


def run(func):
    """``hvd.elastic.run``: run ``func(state, ...)`` again from the last commit after a failure, and
    from the current (exact) state after a host change."""
    return hvd.elastic.run(func)


statedict.register_handlers()  # hvd.elastic.TorchState then holds a DistributedOptimizer as State does


class State(TorchState):
    """``hvd.elastic.TorchState`` for an osp ``DistributedOptimizer`` (see the module docstring).

    Args:
        model: the ``torch.nn.Module`` being trained (parameters and buffers are committed and synced).
        optimizer: its ``osp.DistributedOptimizer`` (any mode), on the Horovod backend.
        extra: further attributes, committed and synced with the rest: epoch and batch counters, LR
            schedulers, samplers, more ``DistributedOptimizer``s.
    """

    def __init__(self, model: torch.nn.Module, optimizer: DistributedOptimizer, **extra):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"osp.elastic.State: model must be a torch.nn.Module, got {type(model).__name__}")
        opts = {"optimizer": optimizer, **{k: v for k, v in extra.items() if isinstance(v, DistributedOptimizer)}}
        for name, opt in opts.items():
            if not isinstance(opt, DistributedOptimizer):
                raise TypeError(f"osp.elastic.State: {name} must be an osp.DistributedOptimizer, got "
                                f"{type(opt).__name__} (for hvd.DistributedOptimizer use hvd.elastic.TorchState)")
            if opt.comm.name != "horovod":
                raise ValueError(f"osp.elastic.State: {name} runs on the {opt.comm.name!r} backend; Horovod "
                                 "Elastic restarts Horovod's engine, so build the optimizer with backend='horovod' "
                                 "(under torchrun, restart from checkpoints instead: see osp.train --checkpoint-dir)")
        self._optimizers = list(opts.values())
        super().__init__(model, **opts, **{k: v for k, v in extra.items() if k not in opts})

    def _flush(self):
        # only what is in flight: a new rank builds its State outside hvd.elastic.run, where no collective
        # may run (flush() would call the optimizer's on_synced callback)
        for opt in self._optimizers:
            statedict.settle(opt)

    def check_host_updates(self):
        # a host change resets the engine without restoring: leave nothing in flight
        self._flush()
        super().check_host_updates()

    def reset(self):
        for opt in self._optimizers:
            opt.reset_world()
        super().reset()


def local_host_names(n: int) -> list:
    """``n`` distinct names of this machine that Horovod runs locally (each resolves to one of its own
    addresses): for an elastic job on one machine, one per slot in the discovery script. Horovod then
    treats each as a host of its own, so blacklisting the host of a failed rank leaves the others."""
    import psutil

    local = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs if a.family == socket.AF_INET}
    out = []
    for name in ["localhost", "127.0.0.1", socket.gethostname(), *sorted(local - {"127.0.0.1"})]:
        try:
            ok = socket.gethostbyname(name) in local
        except OSError:
            ok = False
        if ok and name not in out:
            out.append(name)
    if len(out) < n:
        raise RuntimeError(f"osp: need {n} local host names for Horovod Elastic, found {out}")
    return out[:n]
