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
``hvd.DistributedOptimizer``) works too, with the same exact commits and restores (``osp.statedict``): its
``commit()`` flushes before the model is saved, its restore after a failure drops what was in flight, and a
reset callback, registered when the state first syncs or commits, rebuilds the mode for the new world. It
lacks the check of a new rank's parameters, and a host change noticed outside ``commit()`` with work in flight
is refused (naming this class).
"""
from __future__ import annotations

import copy
import socket

import torch

from .broadcast import broadcast_state
from .optimizer import DistributedOptimizer

__all__ = ["State", "run", "local_host_names"]


try:
    import horovod.torch as hvd
    from horovod.torch.elastic.state import ModelStateHandler, StateHandler, TorchState, _get_handlers
except ImportError as e:  # pragma: no cover - Horovod is installed with osp's test setup
    raise ImportError(f"osp.elastic needs Horovod with PyTorch support ({e})") from None


def run(func):
    """``hvd.elastic.run``: run ``func(state, ...)`` again from the last commit after a failure, and
    from the current (exact) state after a host change."""
    return hvd.elastic.run(func)


class _OptimizerHandler(StateHandler):
    """A ``DistributedOptimizer``'s part of the state: its ``state_dict()`` (the wrapped optimizer's
    state and osp's own), saved after a flush."""

    def __init__(self, optimizer: DistributedOptimizer):
        super().__init__(optimizer)
        self._saved = None  # State saves every handler once built, after its flush

    def save(self):
        self._saved = copy.deepcopy(self.value.state_dict())  # (State.save flushed first)

    def restore(self):
        self.value.reset_world()  # what was in flight belongs to the failed engine
        # a copy: torch's load_state_dict() keeps the given tensors where they fit (step counts, ...), and the
        # steps after it would change the commit in place, which a second restore of it must bring back as it was
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        # the flat state travels in place, on each rank's own device (osp.broadcast.broadcast_state)
        opt = self.value
        opt.load_state_dict(broadcast_state(opt.comm, opt.state_dict(), 0, opt.groups[0].device,
                                            f"{opt._ctx.prefix}.elastic_sync"))

    def set_value(self, value):
        raise AttributeError("osp.elastic.State: an optimizer of the state cannot be replaced; build a new "
                             "State with the new optimizer")


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
        rest = {k: v for k, v in extra.items() if k not in opts}
        handlers, plain = _get_handlers(rest)
        self._handlers = {"model": ModelStateHandler(model), **{k: _OptimizerHandler(v) for k, v in opts.items()},
                          **handlers}
        self._optimizers = [h.value for h in self._handlers.values() if isinstance(h, _OptimizerHandler)]
        for name, handler in self._handlers.items():
            setattr(self, name, handler.value)
        # TorchState's own __init__ would give a DistributedOptimizer Horovod's optimizer handler, which
        # knows nothing of osp's flat buffers, modes or work in flight
        super(TorchState, self).__init__(bcast_object=hvd.broadcast_object, get_rank=hvd.rank, **plain)
        self.save()  # flush first, so the model's committed parameters are the exact ones

    def _flush(self):
        # only what is in flight: a new rank builds its State outside hvd.elastic.run, where no collective
        # may run (flush() would call the optimizer's on_synced callback)
        for opt in self._optimizers:
            if opt.in_flight:
                opt.flush()

    def save(self):
        # the model's parameters are committed before the optimizer's handler runs: flush first
        self._flush()
        super().save()

    def sync(self):
        # first of all (before any broadcast of the model's tensors): every rank, a new one too, wraps the
        # same parameters with the same options, or all raise the same ValueError
        for opt in self._optimizers:
            opt.check_world()
        super().sync()

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
