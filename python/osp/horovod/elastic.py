"""``hvd.elastic`` on torchrun: ``run``, ``TorchState``, ``ObjectState``, ``State`` and ``ElasticSampler``.

Horovod Elastic keeps the processes and restarts its engine when a rank fails or hosts change; it restores the last
``commit()`` from memory. torchrun restarts the worker *processes* instead (``--max-restarts``, and with
``--nnodes MIN:MAX`` when nodes come or go), so here a ``commit()`` also writes the committed state to disk, and
``run`` starts every (re)started worker from the newest commit::

    import osp.horovod as hvd

    @hvd.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...                                   # steps; every N of them:
            state.commit()

    state = hvd.elastic.TorchState(model, optimizer, epoch=0)
    train(state)

    torchrun --nnodes 1:4 --max-restarts 3 ... train.py

What carries over: commits, ``restore()``, ``sync()`` (rank 0's state to every rank at the start and after each
restart), reset callbacks (run after a restart, before the sync: e.g. to scale the learning rate to the new size),
``ElasticSampler`` (it resumes the epoch where the last commit left it), and osp's optimizer in every mode (a commit
flushes it first, so it holds exact updates).

What does not: a failure or a change of hosts restarts every worker, so the steps since the last commit are redone
(Horovod redoes them after a failure too, but keeps going through a change of hosts without losing any);
``check_host_updates()`` never raises ``HostsUpdatedInterrupt`` (torchrun does not tell a worker about new hosts: it
restarts it); what is not in the state (a Python variable outside it) starts anew in the restarted process. Commits
go to ``$OSP_ELASTIC_DIR`` (default: a folder named after torchrun's run id in the temporary directory); on several
nodes put it on storage every node reads, or a node whose disk lacks the newest commit resumes from the newest any
rank can read.
"""
from __future__ import annotations

import copy
import functools
import math
import os
import random
import tempfile

import torch

from .. import statedict
from ..checkpoint import CheckpointDir
from . import basics
from .functions import allgather_object, broadcast_object, broadcast_optimizer_state, broadcast_parameters

__all__ = ["run", "State", "ObjectState", "TorchState", "ElasticSampler", "commit_dir"]


def commit_dir() -> str:
    """Where commits are written: ``$OSP_ELASTIC_DIR``, else ``<tmp>/osp-elastic-<torchrun's run id>``."""
    path = os.environ.get("OSP_ELASTIC_DIR")
    if path:
        return path
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return os.path.join(tempfile.gettempdir(), f"osp-elastic-{run_id}")


class State:
    """Horovod's elastic ``State``: what ``run`` saves, restores and syncs. Subclasses define ``save``, ``restore``,
    ``sync`` and (to survive a restart) ``_snapshot`` / ``_load_snapshot``."""

    def __init__(self, bcast_object=None, get_rank=None):
        self._reset_callbacks = []
        self._commits = 0

    def register_reset_callbacks(self, callbacks):
        """Functions called after a restart (before the state is synced): e.g. to rescale the learning rate."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def reset(self):
        """Called after a restart, before the callbacks."""

    def commit(self):
        """Save the state (in memory, as Horovod) and write it to ``commit_dir()``, from where a restarted worker
        resumes. Every rank calls it at the same step."""
        self.save()
        self._commits += 1
        if basics.rank() == 0:
            CheckpointDir(commit_dir()).save(self._commits, {"commits": self._commits, "state": self._snapshot()})
        self.check_host_updates()

    def check_host_updates(self):
        """A no-op: under torchrun a change of hosts restarts the workers, which resume from the last commit."""

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError

    def _snapshot(self):
        raise NotImplementedError

    def _load_snapshot(self, snap):
        raise NotImplementedError

    def _resume(self) -> bool:
        """Load the newest commit any rank can read (every rank agrees on it); whether there was one. The rank
        that read it becomes rank 0's source by the sync that follows (its state is sent from there)."""
        # written by this job's own commit(): its values may be any picklable object, as Horovod's ObjectState's
        found = CheckpointDir(commit_dir()).load_latest(weights_only=False) if os.path.isdir(commit_dir()) else None
        steps = allgather_object(found[0] if found else 0)
        newest = max(steps)
        if newest == 0:
            return False
        root = steps.index(newest)
        snap = broadcast_object(found[2] if basics.rank() == root else None, root_rank=root)
        self._commits = snap["commits"]
        self._load_snapshot(snap["state"])
        self.restore()
        return True


class ObjectState(State):
    """Plain Python values as attributes, saved, restored and synced (from rank 0) as Horovod's ``ObjectState``."""

    def __init__(self, bcast_object=None, get_rank=None, **kwargs):
        self._saved_state = kwargs
        self._set_attrs()
        super().__init__()

    def save(self):
        self._saved_state = {k: getattr(self, k) for k in self._saved_state}

    def restore(self):
        self._set_attrs()

    def sync(self):
        if self._saved_state:
            self._saved_state = broadcast_object(self._saved_state, root_rank=0)
            self._set_attrs()

    def _set_attrs(self):
        for k, v in self._saved_state.items():
            setattr(self, k, v)

    def _snapshot(self):
        return {"objects": copy.deepcopy(self._saved_state)}

    def _load_snapshot(self, snap):
        self._saved_state = snap["objects"]


class _Handler:
    """One model, optimizer or sampler of a ``TorchState``: its ``state_dict()`` saved, restored and synced."""

    def __init__(self, value):
        self.value = value
        self.saved = None
        self.save()

    def save(self):
        # every rank commits at the same step: the optimizers stepping a model's parameters (the model is saved
        # before its optimizer) or this optimizer finish their work in flight, so the state holds exact updates
        statedict.settle(self.value)
        self.saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        if any(o.in_flight for o in statedict.holders(self.value)):
            statedict.drop(self.value)  # the uncommitted steps' work is dropped with them
        self.value.load_state_dict(copy.deepcopy(self.saved))

    def sync(self):
        v = self.value
        if isinstance(v, torch.nn.Module):
            broadcast_parameters(v.state_dict(), root_rank=0)
        elif isinstance(v, torch.optim.Optimizer):
            broadcast_optimizer_state(v, root_rank=0)
        else:
            v.load_state_dict(broadcast_object(v.state_dict(), root_rank=0))


class TorchState(ObjectState):
    """Horovod's ``TorchState``: a model, an optimizer (osp's, any mode, or a plain one), ``ElasticSampler`` s as
    keyword arguments, and plain values; see the module docstring."""

    def __init__(self, model=None, optimizer=None, **kwargs):
        kwargs.update(model=model, optimizer=optimizer)
        handled = {k: v for k, v in kwargs.items()
                   if isinstance(v, (torch.nn.Module, torch.optim.Optimizer, ElasticSampler))}
        object.__setattr__(self, "_handlers", {k: _Handler(v) for k, v in handled.items()})
        for k, h in self._handlers.items():
            object.__setattr__(self, k, h.value)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in handled})

    def save(self):
        for h in self._handlers.values():
            h.save()
        super().save()

    def restore(self):
        for h in self._handlers.values():
            h.restore()
        super().restore()

    def sync(self):
        for h in self._handlers.values():
            h.sync()
        super().sync()

    def __setattr__(self, name, value):
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers:
            handlers[name].value = value
            handlers[name].save()
        super().__setattr__(name, value)

    def _snapshot(self):
        return {"handlers": {k: h.saved for k, h in self._handlers.items()}, **super()._snapshot()}

    def _load_snapshot(self, snap):
        for k, saved in snap["handlers"].items():
            if k in self._handlers:
                self._handlers[k].saved = saved
        super()._load_snapshot(snap)


def run(func):
    """``@hvd.elastic.run``: before ``func(state, ...)``, resume from the newest commit if there is one (a worker
    torchrun restarted), run the reset callbacks then, and sync the state from rank 0. A failure is not caught:
    the worker exits, and torchrun (``--max-restarts``) restarts every worker, which resume here."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        basics._need_init()
        if state._resume():
            state.on_reset()
        state.sync()
        return func(state, *args, **kwargs)

    return wrapper


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ``ElasticSampler``: the dataset's indices (shuffled by ``seed + epoch``) split over the ranks,
    without the ones processed earlier in the epoch (``record_batch``), so that a worker resumed from a commit goes
    on where the commit left the epoch. Call ``set_epoch`` at the end of each epoch."""

    def __init__(self, dataset, shuffle=True, seed=0):
        self.dataset, self.shuffle, self.seed = dataset, shuffle, seed
        self.epoch, self.processed_num = 0, 0
        self.reset()

    def set_epoch(self, epoch):
        self.epoch, self.processed_num = epoch, 0
        self.reset()

    def record_batch(self, batch_idx, batch_size):
        self.processed_num += batch_size * self.num_replicas

    def load_state_dict(self, state_dict):
        self.epoch, self.processed_num = state_dict["epoch"], state_dict["processed_num"]
        self.reset()

    def state_dict(self):
        return {"epoch": self.epoch, "processed_num": self.processed_num}

    def reset(self):
        self.num_replicas, self.rank = basics.size(), basics.rank()
        indices = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(indices)
        self.remaining_indices = indices[self.processed_num:]
        self.num_samples = int(math.ceil(len(self.remaining_indices) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def __iter__(self):
        idx = self.remaining_indices[:]
        idx += idx[:self.total_size - len(idx)]
        self.indices = idx[self.rank:self.total_size:self.num_replicas]
        return iter(self.indices)

    def __len__(self):
        return self.num_samples
