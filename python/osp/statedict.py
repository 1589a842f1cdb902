"""A ``DistributedOptimizer``'s state: ``state_dict()`` / ``load_state_dict()`` (the wrapped optimizer's, plus
osp's own under ``"osp"``), Horovod's ``broadcast_optimizer_state`` on it, and the model's ``state_dict()``
read while the weights are provisional (warned once)."""
from __future__ import annotations

import sys
import weakref
from typing import Optional

import torch

from .correction import unhooked_step
from .warn import warn


def state_dict(opt) -> dict:
    if opt.mode.in_flight:
        raise RuntimeError("osp: state_dict() with stage-2 work in flight: call flush() on every "
                           "rank first, so the state holds exact updates")
    frame = horovod_state_broadcast()
    if frame is not None and "state_dict" not in frame.f_locals:
        # hvd.broadcast_optimizer_state's first read (every rank's, at the same point): it sends the
        # wrapped optimizer's state only, so osp's own part (OSP's scores and budget: the next split)
        # goes from root here, or a rank that loaded a checkpoint would split unlike the others
        root = frame.f_locals.get("root_rank", 0)
        mine = own_state(opt) if opt.comm.rank == root else None
        theirs = opt.comm.broadcast_object(mine, root)
        if opt.comm.rank != root:
            opt.mode.load_state_dict(theirs)
    out = dict(opt.optimizer.state_dict())
    out["osp"] = own_state(opt)
    return out


def own_state(opt) -> dict:
    return {"sync": repr(opt.sync), **opt.mode.state_dict()}


def load_state_dict(opt, state_dict: dict) -> None:
    if opt.mode.in_flight:
        raise RuntimeError("osp: load_state_dict() with stage-2 work in flight: call flush() first")
    if not isinstance(state_dict, dict):
        raise TypeError(f"osp: load_state_dict() expects a dict (a state_dict()), got {type(state_dict).__name__}")
    if "optimizer" in state_dict and "osp" in state_dict:  # the layout of osp 0.x before Horovod parity
        inner, ours = state_dict["optimizer"], state_dict["osp"]
    else:
        inner = {k: v for k, v in state_dict.items() if k != "osp"}
        ours = state_dict.get("osp", {})
    opt.optimizer.load_state_dict(inner)
    opt.mode.load_state_dict(ours)


def init_state_for_horovod(opt) -> None:
    """``hvd.broadcast_optimizer_state`` on an optimizer without state sets every gradient to zeros and
    calls ``step()`` to have the state made, then broadcasts it: a local step of the wrapped optimizer
    (as Horovod does for its own optimizer), no collective. The zero gradients go back into osp's flat
    gradient, and the mode takes the new state over. The parameters are put back as they were: with
    weight decay (or ASGD's averaging) a zero-gradient step moves them, and only on the ranks without
    state, which would leave the replicas apart after ``broadcast_parameters`` (Horovod's does that)."""
    kept = [fg.param.clone() for fg in opt.groups]
    unhooked_step(opt.optimizer)
    for fg, p in zip(opt.groups, kept):
        fg.param.copy_(p)
        fg.gather_grads()
    opt.mode.load_state_dict({})


def horovod_state_broadcast() -> Optional[object]:
    """The frame of Horovod's ``broadcast_optimizer_state`` if it is calling us (through torch's step
    wrappers: a few frames up), else None. It calls ``state_dict()`` on every rank, and ``step()`` on the
    ranks without state, to have it made."""
    functions = sys.modules.get("horovod.torch.functions")
    code = getattr(getattr(functions, "broadcast_optimizer_state", None), "__code__", None)
    if code is None:
        return None
    f = sys._getframe(2)
    for _ in range(12):
        if f is None:
            return None
        if f.f_code is code:
            return f
        f = f.f_back
    return None


def model_of(named_parameters) -> Optional[torch.nn.Module]:
    """The module whose ``named_parameters()`` generator this is, if it is one not started yet (the usual
    ``model.named_parameters()`` argument), else None."""
    frame = getattr(named_parameters, "gi_frame", None)
    model = frame.f_locals.get("self") if frame is not None else None
    return model if isinstance(model, torch.nn.Module) else None


def watch_model(opt, model: Optional[torch.nn.Module]) -> None:
    """``model.state_dict()`` while ``opt``'s weights are provisional (OSP's, DSync's corrections in flight)
    saves weights no rank will train on: warned once, at the user's line, naming ``flush()``."""
    if model is None:
        return
    ref = weakref.ref(opt)

    def hook(module, prefix, keep_vars):
        o = ref()
        if o is None or o.mode.exact or o.comm.size == 1 or getattr(o, "_warned_provisional", False):
            return
        o._warned_provisional = True
        warn(f"osp: model.state_dict() under {o.sync.name.upper()} with corrections in flight: the weights are "
             "provisional (this rank's own gradient applied, the exact average not yet), and differ from rank "
             "to rank. Call opt.flush() on every rank first, as before evaluating or checkpointing. This "
             "warning is shown once")
    opt._model_hook = model.register_state_dict_pre_hook(hook)
