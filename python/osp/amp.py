"""``torch.amp.GradScaler`` with a DistributedOptimizer: the same overflow decision on every rank.

Where ``.grad`` holds this rank's own gradient (OSP, DSync, HSP), a scaler must not skip ``step()`` on
the ranks that overflowed alone (the others would wait for them): the optimizer says it supports AMP
scaling, so ``GradScaler.step()`` hands it ``grad_scale`` and ``found_inf`` and calls ``step()`` on every
rank; osp unscales inside the step, skips it on every rank alike when any rank's gradient (or the
average) is not finite, and writes that verdict into the scaler's overflow flags, so every rank's
scale follows the same sequence. Where ``.grad`` is the average (BSP) the scaler works as usual; a
wrapped optimizer that unscales in its own kernels (``fused=True``) is handed the scaler's figures, as
torch.optim would be.
"""
from __future__ import annotations

import functools
import sys
from typing import Optional

import torch

from .modes.base import StepInput


def supports_scaling(grad_is_average: bool, optimizer: torch.optim.Optimizer) -> bool:
    """``_step_supports_amp_scaling`` of the DistributedOptimizer (see the module docstring)."""
    return not grad_is_average or bool(getattr(optimizer, "_step_supports_amp_scaling", False))


def prepare(opt, grad_is_average: bool, inp: StepInput) -> Optional[dict]:
    """Fill ``inp`` from the GradScaler calling ``opt.step()`` (``opt.grad_scale`` / ``opt.found_inf``
    set), if any; returns the scaler's record for ``opt`` when osp decides the overflow (``report``)."""
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


def _calling_grad_scaler(opt):
    """The ``torch.amp.GradScaler`` whose ``step()`` is calling ``opt.step()``, and its record for
    ``opt`` (the overflow flags ``update()`` reads). osp makes those flags identical on every rank."""
    code = torch.amp.GradScaler.step.__code__
    f = sys._getframe(1)
    for _ in range(32):
        if f is None:
            break
        if f.f_code is code:
            scaler, state = f.f_locals.get("self"), f.f_locals.get("optimizer_state")
            if isinstance(scaler, torch.amp.GradScaler) and isinstance(state, dict) \
                    and "found_inf_per_device" in state:
                return scaler, state
        f = f.f_back
    raise RuntimeError(
        "osp: step() was called with a GradScaler's grad_scale and found_inf set, but not from "
        "torch.amp.GradScaler.step(); osp cannot make the overflow flags equal on every rank. Call "
        "scaler.step(opt) with a torch.amp.GradScaler")
