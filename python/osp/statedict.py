"""A ``DistributedOptimizer``'s state: ``state_dict()`` / ``load_state_dict()`` (the wrapped optimizer's, plus
osp's own under ``"osp"``), what Horovod's ``broadcast_optimizer_state`` and ``hvd.elastic.TorchState`` do with
it, and the model's ``state_dict()`` read while the weights are provisional (warned once)."""
from __future__ import annotations

import copy
import sys
import weakref
from typing import Optional

import torch

from .correction import unhooked_step
from .warn import warn


def state_dict(opt) -> dict:
    frame = horovod_state_broadcast()
    first_read = frame is not None and "state_dict" not in frame.f_locals
    follow_torch_state(opt)
    if opt.mode.in_flight:
        commit = torch_state_commit()
        if first_read or commit is not None:
            # hvd.broadcast_optimizer_state, and hvd.elastic.TorchState's commit(), run on every rank at the same
            # point (each is a collective): finish the work in flight there, so the state read holds exact
            # updates (as osp.broadcast_optimizer_state and osp.elastic.State's commit() do)
            opt.flush()
            if commit is not None:
                _save_models_again(commit)
        else:
            hint = ""
            if _caller(*[("horovod.torch.elastic.state", c, m) for c in ("TorchState", "OptimizerStateHandler")
                         for m in ("__init__", "save")]) is not None:
                hint = (". hvd.elastic.TorchState saves the optimizer here outside commit(), where nothing flushes "
                        "it: use osp.elastic.State(model, optimizer, ...), which flushes first wherever it saves")
            raise RuntimeError("osp: state_dict() with stage-2 work in flight: call flush() on every "
                               f"rank first, so the state holds exact updates{hint}")
    if first_read:
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
    restoring = follow_torch_state(opt, restore=True)
    drop = opt.mode.in_flight and (restoring or engine_failed(opt))
    if opt.mode.in_flight and not drop:
        raise RuntimeError("osp: load_state_dict() with stage-2 work in flight: call flush() first")
    if not isinstance(state_dict, dict):
        raise TypeError(f"osp: load_state_dict() expects a dict (a state_dict()), got {type(state_dict).__name__}")
    if restoring:
        # torch's load_state_dict() keeps the given tensors where they fit (Adam's step counts, ...), and the steps
        # after it would change the commit in place: a second restore of it (two failures without a commit in
        # between) would bring back something else. The optimizer takes a copy, and the commit stays as it was
        state_dict = copy.deepcopy(state_dict)
    if drop:
        # a restore of the last commit: hvd.elastic.TorchState's restore() (hvd.elastic.run calls it on every rank
        # while it handles a HorovodInternalError), or any load while the engine is failing. What is in flight
        # belongs to the steps undone (and to the dead engine), as osp.elastic.State's restore() knows: every
        # rank drops it alike, and the committed state replaces it
        opt.reset_world()
    if "optimizer" in state_dict and "osp" in state_dict:  # the layout of osp 0.x before Horovod parity
        inner, ours = state_dict["optimizer"], state_dict["osp"]
    else:
        inner = {k: v for k, v in state_dict.items() if k != "osp"}
        ours = state_dict.get("osp", {})
    opt.optimizer.load_state_dict(inner)
    opt.mode.load_state_dict(ours)


def engine_failed(opt) -> bool:
    """Whether the engine under ``opt`` failed: a ``HorovodInternalError`` (Horovod's, or ``osp.horovod``'s) is
    being handled by a caller (``hvd.elastic.run`` restores the last commit inside its handler), or the engine is
    no longer running."""
    exc = sys.exc_info()[1]
    if exc is not None and any(isinstance(exc, cls) for cls in _internal_errors()):
        return True
    return not opt.comm.active()


def _internal_errors() -> list:
    out = []
    for module in ("horovod.common.exceptions", "osp.horovod.basics"):
        cls = getattr(sys.modules.get(module), "HorovodInternalError", None)
        if isinstance(cls, type):
            out.append(cls)
    return out


def init_state_for_horovod(opt) -> None:
    """``hvd.broadcast_optimizer_state`` on an optimizer without state: every parameter that requires a gradient
    gets a zero gradient, and a local step of the wrapped optimizer makes the state, no collective (as Horovod
    does for its own optimizer); it then broadcasts the state. The zero gradients stay, as Horovod leaves them (in
    osp's flat gradient: each ``.grad`` its alias), a parameter that requires none keeps its ``.grad``, and the
    mode takes the new state over. The parameters are put back as they were: with weight decay (or ASGD's
    averaging) a zero-gradient step moves them, and only on the ranks without state, which would leave the
    replicas apart after ``broadcast_parameters`` (Horovod's does that)."""
    kept = [fg.param.clone() for fg in opt.groups]
    for fg in opt.groups:
        for p in fg.params:
            if p.requires_grad:  # Horovod's rule; its own function has set these already, osp.horovod's has not
                p.grad = torch.zeros_like(p)
        fg.gather_grads()  # the zeros into the flat gradient, each .grad its alias (a None stays None)
    unhooked_step(opt.optimizer)
    for fg, p in zip(opt.groups, kept):
        fg.param.copy_(p)
        fg.grad.zero_()  # zeros after the step too, whatever the optimizer did with them
    opt.mode.load_state_dict({})


def _caller(*targets, skip: int = 2, depth: int = 16):
    """The nearest frame, at most ``depth`` frames above the caller of our caller, that runs one of ``targets``
    (``(module, attribute, ...)`` paths to functions), or None. Only modules already imported are looked at."""
    codes = set()
    for module, *path in targets:
        obj = sys.modules.get(module)
        for name in path:
            obj = getattr(obj, name, None)
        code = getattr(obj, "__code__", None)
        if code is not None:
            codes.add(code)
    if not codes:
        return None
    try:
        f = sys._getframe(skip)
    except ValueError:  # a shallower stack
        return None
    for _ in range(depth):
        if f is None:
            return None
        if f.f_code in codes:
            return f
        f = f.f_back
    return None


def horovod_state_broadcast() -> Optional[object]:
    """The frame of Horovod's ``broadcast_optimizer_state`` if it is calling us (through torch's step
    wrappers: a few frames up), else None. It calls ``state_dict()`` on every rank, and ``step()`` on the
    ranks without state, to have it made."""
    return _caller(("horovod.torch.functions", "broadcast_optimizer_state"), skip=3)


def torch_state_commit():
    """The ``hvd.elastic.TorchState`` (or other Horovod ``State``) whose ``commit()`` is calling us, or None."""
    frame = _caller(("horovod.common.elastic", "State", "commit"), skip=3)
    return frame.f_locals.get("self") if frame is not None else None


def _save_models_again(state) -> None:
    """``TorchState.save()`` saved its models before it reached the optimizer (its handlers in the order given):
    their parameters were the provisional ones; saved again now, exact. (With the model known to osp, its
    ``state_dict()`` hook flushed first and nothing is left in flight here.)"""
    handler = getattr(sys.modules.get("horovod.torch.elastic.state"), "ModelStateHandler", None)
    for h in list(getattr(state, "_handlers", {}).values()):
        if handler is not None and isinstance(h, handler):
            h.save()


_TORCH_STATE = [("horovod.torch.elastic.state", "TorchState", name) for name in ("sync", "save", "restore")]


def follow_torch_state(opt, restore: bool = False):
    """When ``hvd.elastic.TorchState`` (Horovod's, not ``osp.elastic.State``) saves, restores or syncs ``opt``, the
    state is noted, once: Horovod Elastic then restarts the engine (a failure, hosts added or removed) without
    telling the optimizer, whose mode was built for the old world (its per-step records are sized by it, its
    replica check, OSP's budget). A reset callback of the state rebuilds it for the new world on every rank, as
    ``osp.elastic.State.reset`` does (``reset_world``). Returns whether the call comes from that state's ``restore()``
    when ``restore``, else whether it comes from such a state at all."""
    frame = _caller(*_TORCH_STATE, skip=3)
    state = frame.f_locals.get("self") if frame is not None else None
    if state is None or not callable(getattr(state, "register_reset_callbacks", None)):
        return False
    ours = getattr(sys.modules.get("osp.elastic"), "State", None)
    if ours is not None and isinstance(state, ours):  # its own restore() and reset() rebuild the mode
        return False
    followed = opt.__dict__.setdefault("_torch_states", weakref.WeakSet())
    if state not in followed:
        followed.add(state)
        ref = weakref.ref(opt)
        state.register_reset_callbacks([lambda ref=ref: _engine_reset(ref())])
    return frame.f_code.co_name == "restore" if restore else True


def _engine_reset(opt) -> None:
    """``hvd.elastic.TorchState``'s reset callback: the engine was restarted, maybe with other ranks."""
    if opt is None:
        return
    if opt.mode.in_flight:
        # a reset without a restore (hosts changed) while work was in flight: TorchState's commit() flushed
        # (state_dict() above), so check_host_updates() was called outside it; the exact updates in flight are
        # lost with the engine, and each rank keeps its own provisional weights. Every rank that was training
        # raises here alike, before any collective of the new engine
        raise RuntimeError(
            "osp: Horovod Elastic restarted the engine while this DistributedOptimizer had work in flight (its "
            "exact updates are lost with the engine): hvd.elastic.TorchState's check_host_updates() was called "
            "outside commit(), where nothing flushes it. Use osp.elastic.State(model, optimizer, ...) instead, "
            "whose check_host_updates() and commit() flush first, or call opt.flush() on every rank before "
            "check_host_updates()")
    opt.reset_world()


def model_of(named_parameters) -> Optional[torch.nn.Module]:
    """The module whose ``named_parameters()`` generator this is, if it is one not started yet (the usual
    ``model.named_parameters()`` argument), else None."""
    frame = getattr(named_parameters, "gi_frame", None)
    model = frame.f_locals.get("self") if frame is not None else None
    return model if isinstance(model, torch.nn.Module) else None


def watch_model(opt, model: Optional[torch.nn.Module]) -> None:
    """``model.state_dict()`` while ``opt``'s weights are provisional (OSP's, DSync's corrections in flight)
    saves weights no rank will train on: warned once, at the user's line, naming ``flush()``; inside
    ``hvd.elastic.TorchState``'s ``commit()`` or ``sync()`` the optimizer is flushed instead."""
    if model is None:
        return
    ref = weakref.ref(opt)

    def hook(module, prefix, keep_vars):
        o = ref()
        if o is None or o.mode.exact:
            return
        if o.mode.in_flight and _caller(("horovod.common.elastic", "State", "commit"),
                                        ("horovod.torch.elastic.state", "TorchState", "sync")) is not None:
            # hvd.elastic.TorchState's commit() and sync() (each on every rank at the same point) save or send the
            # model before the optimizer: flush here, so that the committed or sent parameters are the exact ones
            o.flush()
            return
        if o.comm.size == 1 or getattr(o, "_warned_provisional", False):
            return
        o._warned_provisional = True
        warn(f"osp: model.state_dict() under {o.sync.name.upper()} with corrections in flight: the weights are "
             "provisional (this rank's own gradient applied, the exact average not yet), and differ from rank "
             "to rank. Call opt.flush() on every rank first, as before evaluating or checkpointing. This "
             "warning is shown once")
    opt._model_hook = model.register_state_dict_pre_hook(hook)
