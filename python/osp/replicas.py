"""Replicas checked at runtime: a digest of every rank's parameters and optimizer state, compared across ranks.

DDP checks that every rank has the same parameter *shapes*; nothing in DDP or Horovod checks their values, so
ranks that start from different weights (a forgotten ``broadcast_parameters``), or one that skips an update,
train to the end apart and exit 0. ``DistributedOptimizer(check_replicas=N)`` compares the replicas

- at the first ``step()``, before anything is applied (every mode's replicas are the initial ones there);
- every ``N`` steps after it, where the mode holds exact replicas (BSP and HSP: at the start of the step; OSP and
  fixed-delay DSync: where the step's exact corrections have landed, the ``on_synced`` point; DSync with
  ``delay="auto"`` holds them only after ``flush()``);
- in every ``flush()``;
- when ``join()`` returns (while some rank is joined the replicas may differ by design, e.g. a learning-rate
  scheduler the joined rank does not step: a check then compares nothing, on every rank alike).

A digest is exact and order-free: the sum of the bit patterns of a tensor's elements as 32-bit integers, with
wrap-around (modular addition: no rounding, and no dependence on how a reduction is split across threads or
blocks, so ranks with other thread counts agree). A change of any one element always changes it; changes of
several can cancel only if their bit patterns' differences sum to a multiple of 2**32. Per parameter, the digest
of its values and the sum of its optimizer state's (reduced modulo 2**52 to travel exactly as float64). Each rank
puts its two totals in its own row of a ``[ranks, 2]`` buffer and one sum gives every rank every row (exact: each
place is one rank's value plus zeros). Only when rows differ does a second sum carry each parameter's digests, to
name the first parameter (in the model's order) that differs; both run on every rank alike, and every rank
raises the same error. ``N=0`` turns the checks off, the first step's included.

Cost: one pass over the parameters and the optimizer state (integer sums on their device, about the time of a
float sum) and one blocking collective of ``2 * ranks`` doubles per check (``bench/replica_check.py``).
"""
from __future__ import annotations

from typing import List, Optional

import torch

_MOD = 1 << 52
_BITS = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16,
         torch.float64: torch.int64, torch.int64: torch.int64}


def tensor_digest(t) -> torch.Tensor:
    """An int64 device scalar: the wrap-around 32-bit sum of ``t``'s bit patterns (a number: its float64's)."""
    if not torch.is_tensor(t):
        t = torch.tensor([float(t)], dtype=torch.float64)
    t = t.detach().reshape(-1)
    if t.dtype in _BITS:
        t = t.view(_BITS[t.dtype])
    elif t.is_complex() or t.is_floating_point():
        t = t.to(torch.float64).view(torch.int64)
    if t.dtype == torch.int64:  # two 32-bit halves
        t = t.view(torch.int32)
    return t.sum(dtype=torch.int32).to(torch.int64)


def check_every(value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"osp: check_replicas must be an integer >= 0 (steps between checks; 0: never), got {value!r}")
    return value


class ReplicaCheck:
    """The checks of one ``DistributedOptimizer`` (its context's communicator, groups and wrapped optimizer)."""

    def __init__(self, ctx, every: int):
        self.ctx, self.every = ctx, every
        self.due: Optional[str] = None  # where the pending check was asked for ("step 7", "flush()")
        self.checks = 0  # how many ran (stats)
        self.steps = 0  # step() calls so far

    def digests(self) -> List[torch.Tensor]:
        """Per parameter in the model's order: its values' and its optimizer state's digests (int64, [4])."""
        ctx, out = self.ctx, []
        state = ctx.optimizer.state
        for k, i in ctx.order:
            p = ctx.groups[k].params[i]
            st = state.get(p) or {}
            state_parts = [tensor_digest(v).to(p.device) for _, v in sorted(st.items())
                           if torch.is_tensor(v) or isinstance(v, (int, float))]
            own = tensor_digest(p)
            out.append(torch.stack([own, torch.stack(state_parts).sum() if state_parts else torch.zeros_like(own)]))
        return out

    def begin_step(self) -> None:
        """A ``step()`` begins (every rank counts the same steps): a check is due at the first and every
        ``every``-th."""
        index, self.steps = self.steps, self.steps + 1
        if self.every and (index == 0 or index % self.every == 0):
            self.due = f"step {index + 1}" if index else "the first step()"

    def run_if_due(self) -> None:
        """The replicas are exact here on every rank (the same point of the same step): check if one is due."""
        if self.due is not None:
            where, self.due = self.due, None
            self.check(where)

    def check(self, where: str) -> None:
        """Compare every rank's digests (a collective on every rank); raise the same error on each if they differ."""
        ctx = self.ctx
        comm = ctx.comm
        self.checks += 1
        if comm.size == 1 or not self.every or ctx.groups[0].device.type == "meta":  # meta: no values to compare
            return
        per_param = self.digests()
        total = torch.stack(per_param).sum(0).remainder(_MOD)
        joined = torch.tensor([1 if ctx.joined else 0], dtype=total.dtype, device=total.device)
        rows = self._gather(torch.cat([total, joined]), "replicas")
        if any(r[2] for r in rows):
            # a rank is in join(): its learning rate may stand still while a scheduler moves the others', and
            # join() makes the replicas equal when it returns (then it checks them); every rank skips alike
            return
        if all(r == rows[0] for r in rows):
            return
        detail = self._gather(torch.stack(per_param).reshape(-1).remainder(_MOD), "replicas.each")
        n = len(per_param)
        names = [ctx.groups[k].names[i] for k, i in ctx.order]
        first, what, ranks = names[0], "values", (0, 1)
        for j in range(n):
            vals = [tuple(r[2 * j:2 * j + 2]) for r in detail]
            odd = next((r for r, v in enumerate(vals) if v != vals[0]), None)
            if odd is not None:
                first = names[j]
                what = "values" if vals[odd][0] != vals[0][0] else "optimizer state"
                ranks = (0, odd)
                break
        differ = sum(1 for j in range(n) if len({tuple(r[2 * j:2 * j + 2]) for r in detail}) > 1)
        if where == "the first step()":
            hint = ("The ranks' parameters differ before the first update: they start from different weights "
                    "(each built its model with its own random state), or a forward changed them in place "
                    "differently on each rank (e.g. nn.Embedding(max_norm=...) renormalizes the rows its batch "
                    "looks up). Broadcast the weights once before training, as DDP's constructor does: "
                    "osp.broadcast_parameters(model.state_dict(), root_rank=0) (or hvd.broadcast_parameters), "
                    "and osp.broadcast_optimizer_state(opt, root_rank=0) for a loaded state; or pass "
                    "broadcast_parameters=True to osp.DistributedOptimizer")
        else:
            hint = ("Something changed the parameters or the optimizer state on some ranks only: a rank that "
                    "skipped or repeated an update, an in-place edit on one rank, a state loaded on one rank, "
                    "or hardware that computes differently. Training on would continue with unequal replicas")
        raise RuntimeError(f"osp: the replicas differ at {where}: parameter {first!r} has different {what} on "
                           f"rank {ranks[0]} and rank {ranks[1]} ({differ} of {n} parameters differ). {hint}. "
                           "(check_replicas=0 turns this check off)")

    def _gather(self, mine: torch.Tensor, name: str) -> List[List[float]]:
        """Every rank's ``mine`` (int64 values below 2**52), one row per rank, through one exact sum."""
        comm = self.ctx.comm
        buf = torch.zeros(comm.size, mine.numel(), dtype=torch.float64, device=mine.device)
        buf[comm.rank] = mine.to(torch.float64)
        h = comm.allreduce_sum_async_(buf, f"{self.ctx.prefix}.{name}")
        out = comm.wait(h, self.ctx.timeout, "replica check")
        return out.cpu().tolist()
