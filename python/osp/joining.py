"""``DistributedOptimizer.join()``: a rank out of data takes part in the others' steps with no gradient of its
own until every rank has joined (see the method's docstring for the contract)."""
from __future__ import annotations

import torch

from . import amp
from .broadcast import broadcast_optimizer_state


@torch.no_grad()
def join(opt) -> int:
    if opt._acc.fresh:
        raise RuntimeError("osp: join() after a backward pass whose step() has not run: call step() first, "
                           "then join()")
    ctx = opt._ctx
    # a count left from an earlier join() must not end this one
    ctx.joined, ctx.joined_ranks, ctx.joined_age = True, 0, None
    # every rank leaves at the step ``record_lag`` after the one whose record first counted every rank as
    # joined: DSync reads that record steps later (with delay="auto" each rank at its own delay)
    lag, left = opt.mode.record_lag, None
    # a GradScaler: the shadow steps go through it as the others' steps do (its scale moves with theirs)
    scaler = amp.join_scaler(opt)
    shadowed = 0
    try:
        while True:
            opt.zero_grad(set_to_none=True)
            opt._acc.shadow_pass()
            amp.shadow_step(opt, scaler)
            shadowed += 1
            if ctx.device.type == "meta":
                break
            if left is None and ctx.joined_age is not None:
                left = lag - ctx.joined_age
                if left < 0:
                    raise RuntimeError(f"osp: join(): a record was read {ctx.joined_age} steps after its step, "
                                       f"beyond the mode's {lag} (a bug in osp)")
            if left is not None:
                if left == 0:
                    break
                left -= 1
        opt.flush()  # (its replica check compares nothing: ranks are joined; the end of join() checks)
    finally:
        ctx.joined = False
        opt.zero_grad(set_to_none=True)
    if opt.comm.size > 1:
        # the rank that joined last (fewest shadow steps) sends its parameters and state, as DDP's join hook
        # does: a joined rank's learning rate stood still while a scheduler moved the others' (equal values
        # otherwise: then this changes nothing); and its GradScaler's state, which every scaler takes
        gathered = opt.comm.allgather_object((shadowed, amp.join_states(opt)))
        counts = [c for c, _ in gathered]
        root = counts.index(min(counts))
        for k, fg in enumerate(opt.groups):
            opt.comm.broadcast_(fg.param, root, f"{ctx.prefix}.join.{k}")
        broadcast_optimizer_state(opt, root)
        amp.adopt_join_state(opt, [st for _, st in gathered], root)
        opt._replicas.check("the end of join()")  # every rank took the last joiner's parameters and state
        return root
    return 0
