"""A ``DistributedOptimizer``'s state: ``state_dict()`` / ``load_state_dict()`` (the wrapped optimizer's, plus
osp's own under ``"osp"``), what Horovod's ``broadcast_optimizer_state`` and ``hvd.elastic.TorchState`` do with
it, and the model's ``state_dict()`` read while the weights are provisional (warned once)."""
from __future__ import annotations

import copy
import sys
import weakref
from typing import Optional

import torch

from .broadcast import broadcast_state
from .correction import unhooked_step
from .warn import warn


def state_dict(opt) -> dict:
    frame = horovod_state_broadcast()
    # Horovod's broadcast_optimizer_state reads the state (every rank), then on the ranks without state steps
    # (init_state_for_horovod, a local step) and reads it again: the first read is the collective point
    first_read = frame is not None and opt.__dict__.pop("_horovod_init_frame", None) is not frame
    if opt.mode.in_flight:
        if frame is None:
            raise RuntimeError("osp: state_dict() with stage-2 work in flight: call flush() on every rank first, so "
                               "the state holds exact updates")
        # hvd.broadcast_optimizer_state runs on every rank at the same point (a collective): finish the work in
        # flight there, so the state read holds exact updates (as osp.broadcast_optimizer_state does)
        opt.flush()
    if first_read:
        # it sends the wrapped optimizer's state only, so osp's own part (OSP's scores and budget: the next
        # split) goes from root here, or a rank that loaded a checkpoint would split unlike the others. root_rank:
        # the function's documented argument
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
    drop = opt.mode.in_flight and engine_failed(opt)
    if opt.mode.in_flight and not drop:
        raise RuntimeError("osp: load_state_dict() with stage-2 work in flight: call flush() first")
    if not isinstance(state_dict, dict):
        raise TypeError(f"osp: load_state_dict() expects a dict (a state_dict()), got {type(state_dict).__name__}")
    if drop:
        # any load while the engine is failing (hvd.elastic.run restores the last commit while it handles a
        # HorovodInternalError): what is in flight belongs to the steps undone and to the dead engine. Every rank
        # drops it alike, and the loaded state replaces it
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
    frame = horovod_state_broadcast()
    if frame is not None:  # its second read of the state (after this step) is no collective point
        opt._horovod_init_frame = frame
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


# -- Horovod Elastic's state (osp.elastic's handlers, hvd.elastic.TorchState's and osp.elastic.State's) ------------
_LIVE: "weakref.WeakSet" = weakref.WeakSet()  # every DistributedOptimizer


def follow(opt) -> None:
    """``opt`` is built: known to ``holders`` (what a state's save, restore and sync of a model settle first), and,
    where Horovod's elastic state is imported, osp's handlers are in its registry, so that
    ``hvd.elastic.TorchState(model, opt)`` saves, restores and syncs ``opt`` as ``osp.elastic.State`` does."""
    _LIVE.add(opt)
    register_handlers()


def register_handlers() -> None:
    """osp's handlers first in Horovod's handler registry (``get_handler_registry``: its public way in for what a
    ``TorchState`` holds), once, if Horovod's elastic state is imported: a model, and a ``DistributedOptimizer``
    (any other optimizer keeps Horovod's handler)."""
    mod = sys.modules.get("horovod.torch.elastic.state")
    if mod is None:
        return
    registry = mod.get_handler_registry()
    if not any(cls is ModelHandler for _, cls in registry):
        mod.set_handler_registry([(torch.optim.Optimizer, _optimizer_handler), (torch.nn.Module, ModelHandler),
                                  *registry])


def _optimizer_handler(optimizer):
    if optimizer in _LIVE:
        return OptimizerHandler(optimizer)
    return sys.modules["horovod.torch.elastic.state"].OptimizerStateHandler(optimizer)


class OptimizerHandler:
    """A ``DistributedOptimizer``'s part of an elastic state (``osp.elastic.State``'s and Horovod's own
    ``hvd.elastic.TorchState``'s): its ``state_dict()`` (the wrapped optimizer's state and osp's own), saved after a
    flush, restored without what was in flight, synced after the check that every rank wraps the same
    parameters. Horovod's ``StateHandler`` interface."""

    def __init__(self, optimizer):
        self.value = optimizer
        self.save()  # a state is built on every rank at the same point

    def save(self):
        settle(self.value)
        self._saved = copy.deepcopy(self.value.state_dict())

    def restore(self):
        drop(self.value)  # what was in flight belongs to the failed engine
        # a copy: torch's load_state_dict() keeps the given tensors where they fit (step counts, ...), and the
        # steps after it would change the commit in place, which a second restore of it must bring back as it was
        self.value.load_state_dict(copy.deepcopy(self._saved))

    def sync(self):
        # at the start and after a reset; first of all, every rank (a new one too) wraps the same parameters with
        # the same options, or all raise the same ValueError. The flat state travels in place, on each rank's own
        # device (osp.broadcast.broadcast_state)
        opt = self.value
        settle(opt)  # and rebuilt for a new world
        opt.check_world()
        opt.load_state_dict(broadcast_state(opt.comm, opt.state_dict(), 0, opt.groups[0].device,
                                            f"{opt._ctx.prefix}.elastic_sync"))

    def set_value(self, value):
        raise AttributeError("osp: an osp.DistributedOptimizer kept in an elastic state cannot be replaced; build a "
                             "new state with the new optimizer")


class ModelHandler:
    """A model's part of an elastic state: Horovod's ``ModelStateHandler``, except that the optimizers stepping its
    parameters settle first: a state saves its model before its optimizer, and under OSP or DSync the weights
    would be the provisional ones. After a failure, what they had in flight is dropped first; before a sync, every
    rank's parameters are checked first."""

    def __init__(self, model):
        self.value = model
        self.save()

    def save(self):
        settle(self.value)
        self._saved_model_state = copy.deepcopy(self.value.state_dict())

    def restore(self):
        drop(self.value)
        self.value.load_state_dict(self._saved_model_state)

    def sync(self):
        from horovod.torch.functions import broadcast_parameters

        for opt in holders(self.value):  # before any of the model's tensors is sent
            settle(opt)
            opt.check_world()
        broadcast_parameters(self.value.state_dict(), root_rank=0)

    def set_value(self, value):
        self.value = value
        self.save()


def holders(value) -> list:
    """The live DistributedOptimizers that step ``value``'s parameters: ``value`` itself if it is one, those
    holding any parameter of a module, none for anything else."""
    if value in _LIVE:
        return [value]
    if not isinstance(value, torch.nn.Module):
        return []
    mine = {id(p) for p in value.parameters()}
    return [o for o in list(_LIVE) if any(id(p) in mine for fg in o.groups for p in fg.params)]


def settle(value) -> None:
    """Before a state saves or sends ``value`` (a model, or an optimizer) at a point every rank reaches together
    (a commit, a sync, building the state): every optimizer that steps its parameters finishes its work in
    flight, so that what is saved or sent holds the exact updates (a model is saved before its optimizer: its
    weights would be the provisional ones). After an engine restart that nobody was told of, refused."""
    for opt in holders(value):
        follow_world(opt)
        if opt.in_flight:
            opt.flush()


def drop(value) -> None:
    """A state restores its last commit of ``value`` after a failure: what is in flight belongs to the steps undone
    and to the failed engine; every optimizer that steps its parameters drops it and is rebuilt (again, for the
    new world, at its next use: ``follow_world``)."""
    for opt in holders(value):
        opt.reset_world()
        opt._world = None


def follow_world(opt) -> None:
    """``opt.reset_world()`` if the engine's world is no longer the one its mode was built for: Horovod Elastic
    restarted the engine into another world. (After hosts were removed ``hvd.elastic.run`` neither restores nor
    syncs, and tells only the state's reset callbacks, which a handler cannot register.) Called at each backward
    pass's first gradient and at ``step()``, before any collective of the new world: local, and alike on every
    rank. With work in flight, its exact updates are lost with the old engine: raised."""
    comm = opt.comm
    if not comm.active() or (comm.rank, comm.size) == opt._world:
        return
    if opt.mode.in_flight:
        _lost_in_flight()
    opt.reset_world()


def _lost_in_flight() -> None:
    # TorchState's commit() flushes (its save), so check_host_updates() was called outside it; each rank keeps its
    # own provisional weights. Every rank that was training raises here alike, before any collective of the new
    # engine
    raise RuntimeError(
        "osp: Horovod Elastic restarted the engine while this DistributedOptimizer had work in flight (its "
        "exact updates are lost with the engine): hvd.elastic.TorchState's check_host_updates() was called "
        "outside commit(), where nothing flushes it. Use osp.elastic.State(model, optimizer, ...) instead, "
        "whose check_host_updates() and commit() flush first, or call opt.flush() on every rank before "
        "check_host_updates()")


def model_of(named_parameters) -> Optional[torch.nn.Module]:
    """The module whose ``named_parameters()`` generator this is, if it is one not started yet (the usual
    ``model.named_parameters()`` argument), else None."""
    frame = getattr(named_parameters, "gi_frame", None)
    model = frame.f_locals.get("self") if frame is not None else None
    return model if isinstance(model, torch.nn.Module) else None


def watch_model(opt, model: Optional[torch.nn.Module]) -> None:
    """``model.state_dict()`` while ``opt``'s weights are provisional (OSP's, DSync's corrections in flight)
    saves weights no rank will train on: warned once, at the user's line, naming ``flush()``. (An elastic state's
    commit or sync settles the optimizer before it reads the model: ``settle``.)"""
    if model is None:
        return
    ref = weakref.ref(opt)

    def hook(module, prefix, keep_vars):
        o = ref()
        if o is None or o.mode.exact or not o.mode.in_flight:
            return
        if o.comm.size == 1 or getattr(o, "_warned_provisional", False):
            return
        o._warned_provisional = True
        warn(f"osp: model.state_dict() under {o.sync.name.upper()} with corrections in flight: the weights are "
             "provisional (this rank's own gradient applied, the exact average not yet), and differ from rank "
             "to rank. Call opt.flush() on every rank first, as before evaluating or checkpointing. This "
             "warning is shown once")
    opt._model_hook = model.register_state_dict_pre_hook(hook)
