"""What an optimizer wraps: its parameters by name, the same on every rank, in flat groups.

``DistributedOptimizer`` calls these at construction (and ``check_same_everywhere`` again from
``check_world()``, e.g. for a rank that joined under Horovod Elastic), and ``check_model`` before every
step: a parameter that left osp's flat buffers, or started training after being wrapped frozen, would
train on each rank alone and the replicas would diverge.
"""
from __future__ import annotations

import inspect
from typing import Dict, List, Tuple

import torch

from . import ops
from .comm import Comm
from .layout import FlatGroup, memory_layout
from .modes.base import Options


def check_arguments(optimizer, sync, passes, timeout, on_synced):
    """``DistributedOptimizer``'s arguments, each a clear error naming what was expected; returns ``sync``."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"osp: expected a torch.optim.Optimizer to wrap, got {type(optimizer).__name__}")
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise ValueError("osp: torch.optim.SparseAdam steps sparse gradients only, and osp averages dense ones "
                         "(in flat buffers): use torch.optim.Adam, with sparse_as_dense=True for a sparse "
                         "embedding (as with Horovod's sparse_as_dense)")
    needs = _required_step_arguments(optimizer)
    if needs:
        cls = type(optimizer)
        raise ValueError(
            f"osp: {cls.__name__}.step() requires {', '.join(map(repr, needs))} (expected an "
            "optimizer whose step() runs without arguments): osp steps the wrapped optimizer itself, and its exact "
            "corrections step it again, with the averaged gradient in .grad and no closure to re-evaluate the loss "
            "(an optimizer that needs one, as torch.optim.LBFGS does, evaluates it several times per step on "
            "this rank's own data). Use an optimizer whose step() needs no closure (SGD, Adam, ...), or "
            "hvd.DistributedOptimizer / DistributedDataParallel for LBFGS")
    if not isinstance(sync, Options):
        raise TypeError(f"osp: sync must be osp.BSP(), osp.OSP(...), osp.DSync(...) or osp.HSP(...), got {sync!r}")
    if isinstance(passes, bool) or not isinstance(passes, int) or passes < 1:
        raise ValueError(f"osp: backward_passes_per_step must be an integer >= 1, got {passes!r}")
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"osp: timeout must be a positive number of seconds, got {timeout!r}")
    if on_synced is not None and not callable(on_synced):
        raise TypeError(f"osp: on_synced must be callable or None, got {on_synced!r}")
    return sync


def _required_step_arguments(optimizer) -> List[str]:
    """The arguments ``type(optimizer).step`` cannot be called without (LBFGS's ``closure``), by its
    signature: osp calls it with none."""
    try:
        sig = inspect.signature(type(optimizer).step)
    except (TypeError, ValueError):  # no signature to read (a builtin): osp's call is the test
        return []
    params = list(sig.parameters.values())
    if params and params[0].kind in (params[0].POSITIONAL_ONLY, params[0].POSITIONAL_OR_KEYWORD):
        params = params[1:]  # self
    return [p.name for p in params if p.default is p.empty
            and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def names(optimizer: torch.optim.Optimizer, named_parameters) -> Dict[torch.nn.Parameter, str]:
    """Every parameter of ``optimizer`` with its name, in the model's order (``named_parameters``;
    clipping sums the parameters' norms in the order torch's would take them), or in the param groups'
    order as Horovod names them without names, ``allreduce.noname.{g}.{i}`` (param group g, its i-th)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    if len({id(p) for p in params}) != len(params):
        raise ValueError("osp: a parameter appears more than once in the optimizer's param_groups")
    if named_parameters is None:
        return {p: f"allreduce.noname.{gi}.{i}" for gi, g in enumerate(optimizer.param_groups)
                for i, p in enumerate(g["params"])}
    named = list(named_parameters)
    if any(not isinstance(t, tuple) or len(t) != 2 for t in named):
        raise ValueError("osp: named_parameters must be (name, parameter) pairs, e.g. "
                         "model.named_parameters()")
    seen: Dict[str, int] = {}
    for n, _ in named:
        seen[n] = seen.get(n, 0) + 1
    dups = sorted(n for n, c in seen.items() if c > 1)
    if dups:
        raise ValueError(f"osp: parameter names in named_parameters must be unique. Found duplicates: "
                         f"{', '.join(dups)}")
    by_id = {id(p): n for n, p in named}
    missing = [i for i, p in enumerate(params) if id(p) not in by_id]
    if missing:
        raise ValueError(f"osp: {len(missing)} parameter(s) of the optimizer are not in "
                         "named_parameters; pass model.named_parameters() of the same model")
    position = {id(p): k for k, (_, p) in enumerate(named)}
    return {p: by_id[id(p)] for p in sorted(params, key=lambda p: position[id(p)])}


def check_same_everywhere(comm: Comm, optimizer: torch.optim.Optimizer, names: Dict, options: str,
                          passes: int, uid: int) -> None:
    """Every rank must wrap the same parameters with the same options (``options``: the mode's repr;
    ``passes``: backward_passes_per_step; ``uid``: which osp optimizer of the process this is): compare
    signatures with one allgather, and raise the same error on every rank (never hang, never diverge)."""
    sig = {"sync": options, "bpps": passes, "uid": uid,
           # the memory layout of what osp averages (element by element, in memory order)
           "params": [(gi, names[p], tuple(p.shape), str(p.dtype), p.requires_grad,
                       memory_layout(p) if p.requires_grad else None)
                      for gi, g in enumerate(optimizer.param_groups) for p in g["params"]]}
    sigs = comm.allgather_object(sig)
    for r, other in enumerate(sigs):
        if other == sigs[0]:
            continue
        if other["sync"] != sigs[0]["sync"] or other["bpps"] != sigs[0]["bpps"]:
            raise ValueError(f"osp: ranks disagree on the options: rank 0 has {sigs[0]['sync']}, "
                             f"rank {r} has {other['sync']}")
        if other["uid"] != sigs[0]["uid"]:
            raise ValueError(
                f"osp: ranks built different numbers of osp optimizers before this one (rank 0 is at its "
                f"optimizer {sigs[0]['uid']}, rank {r} at {other['uid']}); every rank must build the same "
                "optimizers in the same order, as their collectives are matched by name")
        a, b = sigs[0]["params"], other["params"]
        for x, y in zip(a, b):
            if x[:5] == y[:5] and x != y:
                raise ValueError(
                    f"osp: ranks disagree on the memory layout of parameter {x[1]!r} (group {x[0]}): rank 0 has "
                    f"{_layout_name(x[5])}, rank {r} has {_layout_name(y[5])}; expected the same on every rank, as "
                    "osp averages each parameter's elements in memory order. Convert the model alike on every "
                    "rank (e.g. model.to(memory_format=torch.channels_last) on all or none) before wrapping")
            if x != y:
                raise ValueError(f"osp: ranks disagree on the parameters: rank 0 has {x[1]!r} "
                                 f"shape {list(x[2])} {x[3]}, rank {r} has {y[1]!r} shape "
                                 f"{list(y[2])} {y[3]} (group {x[0]})")
        raise ValueError(f"osp: ranks disagree on the parameters: rank 0 has {len(a)} "
                         f"parameters, rank {r} has {len(b)}")


def _layout_name(layout) -> str:
    if layout is None:
        return "row-major (contiguous) memory"
    if layout == "overlapping":
        return "elements that share memory"
    return f"strides {['-' if st is None else st for st in layout]}"


def flat_groups(optimizer: torch.optim.Optimizer, names: Dict, block_size, comm: Comm
                ) -> Tuple[List[FlatGroup], List[tuple]]:
    """One flat group per param group and dtype of the trainable parameters (they become views into
    it), and the ``(name, parameter)`` pairs frozen when wrapped, which osp does not synchronize."""
    devices = {p.device for g in optimizer.param_groups for p in g["params"]}
    if len(devices) > 1:
        raise ValueError(f"osp: all parameters must be on one device, got {sorted(map(str, devices))}")
    groups: List[FlatGroup] = []
    outside = []
    for gi, g in enumerate(optimizer.param_groups):
        by_dtype: Dict[torch.dtype, list] = {}
        for p in g["params"]:
            if not p.requires_grad:
                outside.append((names[p], p))
                continue
            if p.dtype not in ops.DTYPES:
                raise ValueError(f"osp: parameter {names[p]!r} is {p.dtype}; osp handles "
                                 "float32, float16 and bfloat16 parameters")
            comm.check_dtype(p.dtype, f"parameter {names[p]!r}")
            by_dtype.setdefault(p.dtype, []).append(p)
        for ps in by_dtype.values():
            groups.append(FlatGroup(ps, [names[p] for p in ps], gi, block_size))
    if not groups:
        raise ValueError("osp: the optimizer has no trainable parameter (every parameter has "
                         "requires_grad=False); there is nothing to synchronize")
    return groups, outside


def group_shape(optimizer: torch.optim.Optimizer) -> tuple:
    return tuple(len(g["params"]) for g in optimizer.param_groups)


def check_model(optimizer: torch.optim.Optimizer, shape: tuple, groups: List[FlatGroup], outside) -> None:
    """The parameters must still be the ones wrapped (views of osp's flat buffers, in param groups of
    ``shape``), and a parameter frozen when wrapped must not have started training."""
    if group_shape(optimizer) != shape:
        raise RuntimeError(
            f"osp: the wrapped optimizer's param groups changed after wrapping (parameters per group "
            f"{list(shape)} then, {list(group_shape(optimizer))} now, e.g. by "
            "add_param_group()); build the optimizer with all its parameters before wrapping it")
    for fg in groups:
        fg.check_params()
    for name, p in outside:
        if p.grad is not None:
            raise RuntimeError(
                f"osp: parameter {name!r} has a gradient, but it had requires_grad=False when the optimizer "
                "was wrapped, so osp does not synchronize it (each rank would update it with its own "
                "gradient). Wrap the optimizer with every parameter that will ever train trainable (freeze "
                "it afterwards: a parameter whose gradient is None on every rank is left alone)")


def model_order(groups, names) -> list:
    """``(flat group, parameter index)`` of each parameter in the model's order (``names``)."""
    where = {p: (k, i) for k, fg in enumerate(groups) for i, p in enumerate(fg.params)}
    return [where[p] for p in names if p in where]
