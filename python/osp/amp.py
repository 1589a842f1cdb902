"""``torch.amp.GradScaler`` with a DistributedOptimizer: the same overflow decision on every rank.

Where ``.grad`` holds this rank's own gradient (OSP, DSync, HSP), a scaler must not skip ``step()`` on
the ranks that overflowed alone (the others would wait for them): the optimizer says it supports AMP
scaling, so ``GradScaler.step()`` hands it ``grad_scale`` and ``found_inf`` and calls ``step()`` on every
rank; osp unscales inside the step, skips it on every rank alike when any rank's gradient (or the
average) is not finite, and writes that verdict into the scaler's overflow flags, so every rank's
scale follows the same sequence. Where ``.grad`` is the average (BSP) the scaler works as usual; a
wrapped optimizer that unscales in its own kernels (``fused=True``) is handed the scaler's figures, as
torch.optim would be.

In every mode osp remembers (weakly) the scaler whose ``step()`` last called ``opt.step()``: a rank that
joined (``opt.join()``) takes its shadow steps through it, as the others take theirs, so its scale, growth
tracker and unscaling stay in step with theirs; at the end of ``join()`` every rank takes the last joiner's
scaler state (``join_states``), as it takes its parameters and optimizer state.
"""
from __future__ import annotations

import functools
import sys
import weakref
from typing import List, Optional

import torch

from .modes.base import StepInput


def supports_scaling(grad_is_average: bool, optimizer: torch.optim.Optimizer) -> bool:
    """``_step_supports_amp_scaling`` of the DistributedOptimizer (see the module docstring)."""
    return not grad_is_average or bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def prepare(opt, grad_is_average: bool, inp: StepInput) -> Optional[dict]:
    """Fill ``inp`` from the GradScaler calling ``opt.step()`` (``opt.grad_scale`` / ``opt.found_inf``
    set), if any; returns the scaler's record for ``opt`` when osp decides the overflow (``report``)."""
    _remember(opt)
    if getattr(opt, "found_inf", None) is None:
        return None
    if grad_is_average:
        inp.amp = (opt.grad_scale, opt.found_inf)  # for the wrapped optimizer's own unscaling
        return None
    if not opt._step_supports_amp_scaling:
        return None
    scaler, state = _calling_grad_scaler(opt)
    half = [fg.names[0] for fg in opt.groups if fg.dtype == torch.float16]
    # as GradScaler.unscale_() refuses them, unless the wrapped optimizer unscales itself (fused)
    if half and not getattr(opt.optimizer, "_step_supports_amp_scaling", False):
        forget(opt, state)
        raise ValueError(f"osp: Attempting to unscale FP16 gradients (parameter {half[0]!r} is float16): "
                         "torch.amp.GradScaler needs float32 parameters (autocast computes in float16); "
                         "keep the parameters float32, or use bfloat16 without a scaler")
    # device scalars, no host sync: the loss scale as it is now (the scaler's update() changes it in place
    # later) and its inverse, computed in double as GradScaler does, rounded once where it multiplies
    inp.backward_scale = scaler._scale.double()
    if not state["found_inf_per_device"]:  # no gradient on this rank (it joined): osp's verdict still counts
        state["found_inf_per_device"][scaler._scale.device] = torch.zeros(1, dtype=torch.float32,
                                                                         device=scaler._scale.device)
    if opt.grad_scale is not None:  # not unscaled yet
        inp.unscale = opt.grad_scale.double().reciprocal()
    else:  # the user's scaler.unscale_(opt) changed them in place since backward
        inp.grads_changed = True
    return state


def allowed_changes(state: Optional[dict], inp: StepInput) -> int:
    """In-place changes of each gradient since backward that are the scaler's own: a GradScaler's
    ``unscale_()`` may count as one, where its kernel bumps version counters."""
    return 1 if state is not None and inp.grads_changed and _unscale_counts_as_a_change() else 0


def forget(opt, state: Optional[dict]) -> None:
    """The step raised: the scaler removes its figures only after a step that returned."""
    if state is not None:
        opt.__dict__.pop("grad_scale", None)
        opt.__dict__.pop("found_inf", None)


def report(state: Optional[dict], overflow: Optional[bool]) -> None:
    """Every rank counts the same overflows, so the scales stay equal."""
    if state is not None:
        for found in state["found_inf_per_device"].values():
            found.fill_(1.0 if overflow else 0.0)


@functools.lru_cache(maxsize=None)
def _unscale_counts_as_a_change() -> bool:
    """Whether ``GradScaler.unscale_()``'s kernel bumps the version counter of the gradients it unscales
    (it does not in the torch osp is built against; it may in others)."""
    g = torch.ones(2)
    v = g._version
    torch._amp_foreach_non_finite_check_and_unscale_([g], torch.zeros(1), torch.ones(1))
    return g._version != v


def _remember(opt) -> None:
    """Note (weakly) the GradScaler whose ``step()`` is calling ``opt.step()``, if one is: ``join()`` steps
    through it."""
    found = _find_grad_scaler()
    if found is not None:
        ref = opt.__dict__.get("_grad_scaler")
        if ref is None or ref() is not found[0]:
            opt.__dict__["_grad_scaler"] = weakref.ref(found[0])


def _scaler(opt) -> Optional[torch.amp.GradScaler]:
    """The GradScaler that last stepped ``opt`` (still alive and enabled), else None."""
    ref = opt.__dict__.get("_grad_scaler")
    scaler = ref() if ref is not None else None
    return scaler if scaler is not None and scaler.is_enabled() else None


def join_scaler(opt) -> Optional[torch.amp.GradScaler]:
    """``join()``: the GradScaler this rank's shadow steps go through (``shadow_step``), so that its scale and
    growth tracker move as the other ranks' do and its unscaling is theirs: the one that last stepped ``opt``,
    if it is ready for a step of ``opt`` (its ``update()`` ran since); else None (plain steps)."""
    scaler = _scaler(opt)
    if scaler is None or getattr(scaler, "_scale", None) is None:
        return None
    state = getattr(scaler, "_per_optimizer_states", {})
    if id(opt) in state and getattr(state[id(opt)].get("stage"), "name", None) != "READY":
        return None  # join() between scaler.step(opt) and scaler.update()
    return scaler


def shadow_step(opt, scaler: Optional[torch.amp.GradScaler]) -> None:
    """One of ``join()``'s shadow steps, after its shadow backward: as the ranks with data take theirs,
    ``scaler.step(opt); scaler.update()``. Where ``.grad`` is the average (BSP) and no parameter has one on
    any rank (every rank has joined), the others have none either: a plain step on every rank alike (the
    scaler has nothing to check)."""
    if scaler is not None and opt.mode.grad_is_average and not any(
            p.grad is not None for g in opt.param_groups for p in g["params"]):
        scaler = None
    if scaler is None:
        opt.step()
        return
    scaler.step(opt)
    scaler.update()


def join_states(opt) -> Optional[dict]:
    """This rank's part of ``join()``'s last exchange: the state of the GradScaler that steps ``opt``
    (None: none known here)."""
    scaler = _scaler(opt)
    return None if scaler is None else scaler.state_dict()


def adopt_join_state(opt, states: List[Optional[dict]], root: int) -> None:
    """End of ``join()``: every rank's scaler takes ``root``'s state (the last joiner's: its scale moved with
    every step). Raises the same error on every rank where some rank knows no scaler and another does: its
    loss scale could not be made the others'."""
    have = [r for r, s in enumerate(states) if s is not None]
    if have and len(have) != len(states):
        missing = [r for r, s in enumerate(states) if s is None]
        raise RuntimeError(
            f"osp: join(): a torch.amp.GradScaler steps this optimizer on rank(s) {have} but none ever did on rank(s) "
            f"{missing} (e.g. a rank that had no batch before join()), so their loss scales cannot be made equal: "
            "training on with them would scale and unscale gradients differently on each rank. Take every rank's "
            "scaler.step(opt) through the same kind of scaler, or give every rank the last joiner's scaler state "
            "(scaler.load_state_dict) before training on")
    if states[root] is not None and opt.comm.rank != root:
        _scaler(opt).load_state_dict(states[root])


def _find_grad_scaler():
    """``(scaler, its record for the optimizer)`` of the ``torch.amp.GradScaler.step()`` up the stack, if any."""
    code = torch.amp.GradScaler.step.__code__
    f = sys._getframe(2)
    for _ in range(32):
        if f is None:
            break
        if f.f_code is code:
            scaler, state = f.f_locals.get("self"), f.f_locals.get("optimizer_state")
            if isinstance(scaler, torch.amp.GradScaler) and isinstance(state, dict) \
                    and "found_inf_per_device" in state:
                return scaler, state
        f = f.f_back
    return None


def _calling_grad_scaler(opt):
    """The ``torch.amp.GradScaler`` whose ``step()`` is calling ``opt.step()``, and its record for
    ``opt`` (the overflow flags ``update()`` reads). osp makes those flags identical on every rank."""
    found = _find_grad_scaler()
    if found is not None:
        return found
    raise RuntimeError(
        "osp: step() was called with a GradScaler's grad_scale and found_inf set, but not from "
        "torch.amp.GradScaler.step(); osp cannot make the overflow flags equal on every rank. Call "
        "scaler.step(opt) with a torch.amp.GradScaler")
