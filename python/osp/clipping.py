"""``DistributedOptimizer.clip_grad_norm_`` / ``clip_grad_value_``: clipping of the *averaged* gradient, as
``torch.nn.utils``'s functions on every rank's averaged ``.grad`` under DDP. Where ``.grad`` holds the average
(BSP) they are those functions; elsewhere the step is told the clip and applies it exactly to the average
(``modes.base.Clip``), the provisional update moving by this rank's own gradient."""
from __future__ import annotations

from typing import List, Optional

import torch

from .modes.base import Clip


def clip_norm(opt, max_norm, norm_type=2.0, error_if_nonfinite=False):
    params = _averaged_or_none(opt, "clip_grad_norm_(max_norm)", max_norm)
    if params is not None:
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
    if float(norm_type) != 2.0:
        raise ValueError(f"osp: clip_grad_norm_ under {opt.sync.name.upper()} clips by the 2-norm of the "
                         f"averaged gradient; norm_type={norm_type!r} is not supported (use 2.0 or osp.BSP())")
    _request(opt, Clip("norm", float(max_norm)))
    return None


def clip_value(opt, clip_value) -> None:
    params = _averaged_or_none(opt, "clip_grad_value_(clip_value)", clip_value)
    if params is not None:
        torch.nn.utils.clip_grad_value_(params, clip_value)
        return None
    _request(opt, Clip("value", float(clip_value)))
    return None


def _averaged_or_none(opt, what: str, limit) -> Optional[List[torch.Tensor]]:
    """What a clip call starts with: ``limit`` checked (a positive number), a backward since the last step;
    then, where ``.grad`` holds the average (BSP), the parameters with a gradient once it landed, else None
    (the step applies the clip exactly)."""
    if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
        raise ValueError(f"osp: {what} must be a positive number, got {limit!r}")
    opt._acc.check_fresh()
    if not opt.mode.grad_is_average:
        return None
    opt.mode.synchronize()
    params = [opt.groups[g].params[i] for g, i in opt._order]
    return [p for p in params if p.grad is not None]


def _request(opt, clip: Clip) -> None:
    if opt._acc.clip is not None and opt._acc.clip.kind != clip.kind:
        raise ValueError(f"osp: clip_grad_norm_ and clip_grad_value_ in one step under {opt.sync.name.upper()} "
                         f"(asked for {opt._acc.clip} and then {clip}): osp applies one clipping of the "
                         "averaged gradient per step; use one of them, or osp.BSP()")
    opt._acc.clip = clip
