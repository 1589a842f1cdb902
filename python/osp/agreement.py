"""The per-step agreement: what every rank must agree on before a step's update, in one small sum.

Every mode decides things each rank must decide alike, from facts only some rank may know: a
non-finite gradient on one rank (the step is skipped on every rank), which parameters have a gradient
on some rank (the others are left alone, as ``torch.optim`` leaves them), a gradient or parameter
changed where a correction was pending (refused on every rank), which critical blocks each rank chose
(they must be the same, or the replicas diverge), and measurements the ``auto`` policies average. An
``Agreement`` is one fp32 buffer on the parameters' device holding this rank's part (named fields,
fields with one place per rank, one presence flag per parameter), summed across ranks in one
collective next to the gradients; its ``result()`` is the sum, identical on every rank. A sum, not an
average: exact for these small integers, and Horovod never fuses a sum with the averaged gradient
buffers (a fusion would move their reduction boundaries from run to run).

Posting launches only small fills and copies on the device (no host sync); ``result()`` reads the
summed buffer once (with this rank's checksums, in the same read: one sync) and raises if the ranks
chose different blocks (e.g. GPUs of different generations contracting FMAs differently when scoring).

    OSP:   nonfinite, bandwidth_mbps, edited, stale, backward_ms, iteration_ms, the mask's checksums, presence
    BSP:   presence
    DSync: grads_edited, params_edited, presence (one record per step in flight)
    HSP:   per rank: passes, failed; presence (with OSP or DSync: passes, failed, and the mode's own record)

Every per-step record (one with presence flags) also counts the ranks that have joined (``opt.join()``:
out of data, they shadow the others' steps with no gradient); ``result()`` leaves the count in
``ctx.joined_ranks``, and, for the first record that counts every rank, how many steps after its own step
it was read in ``ctx.joined_age`` (DSync reads a record ``delay`` steps late, and with ``"auto"`` each rank
at its own delay: ``join()`` leaves ``Mode.record_lag`` steps after that record's step on every rank). And
it carries, per rank, the rank's arrival (``arrival_ms``: from the end of its previous step to the post),
which ``result()`` hands to ``ctx.arrivals`` (``osp.arrivals``: which rank holds the job back).
"""
from __future__ import annotations

import time
from typing import Dict, List, Optional, Sequence

import torch

from .comm import Handle

# Checksums are weighted sums of the mask modulo small primes: integers below 2^11, so their sum over up
# to 2^13 ranks is exact in fp32.
_PRIMES = (2039, 2029)
_CHECKSUMS = ("mask_sum1", "mask_sum2")


def read(t: torch.Tensor) -> List[float]:
    """The host values of a small device tensor (the one sync). Meta tensors carry no values (a
    shape-only run, e.g. to check a model's plumbing): they read as zeros."""
    if t.device.type == "meta":
        return [0.0] * t.numel()
    return t.tolist()


class MaskChecksum:
    """Two checksums of a block mask, computed on its device without a sync."""

    def __init__(self, nblocks: int, device: torch.device):
        g = torch.Generator().manual_seed(0x05F)
        self.weights = [torch.randint(1, p, (nblocks,), generator=g, dtype=torch.int64).to(device)
                        for p in _PRIMES]

    def __call__(self, mask: torch.Tensor) -> List[torch.Tensor]:
        m = mask.to(torch.int64)
        return [torch.remainder((m * w).sum(), p) for w, p in zip(self.weights, _PRIMES)]


class Agreed:
    """The summed record (host values, identical on every rank)."""

    def __init__(self, values: List[float], agreement: "Agreement", extra: Sequence[float] = ()):
        self._v, self._a = values, agreement
        self.extra = list(extra)  # the values read with it (``result(extra=...)``)

    def total(self, name: str) -> float:
        return self._v[self._a.fields[name]]

    def mean(self, name: str) -> float:
        return self.total(name) / self._a.size

    def any(self, name: str) -> bool:
        return self.total(name) > 0

    def per_rank(self, name: str) -> List[float]:
        lo = self._a.per_rank[name]
        return self._v[lo:lo + self._a.size]

    @property
    def presence(self) -> List[float]:
        """Per parameter (flat groups in order): how many ranks have a gradient for it."""
        return self._v[self._a.presence_at:]

    def absent(self) -> List[set]:
        """Per flat group, the parameters without a gradient on every rank. Meta tensors carry no
        values: every parameter counts as present there."""
        groups = self._a.ctx.groups
        if self._a.ctx.device.type == "meta":
            return [set() for _ in groups]
        out, lo, pres = [], 0, self.presence
        for fg in groups:
            out.append({i for i in range(len(fg.params)) if pres[lo + i] == 0})
            lo += len(fg.params)
        return out


class Agreement:
    """One rank's part of a per-step agreement, and its sum across ranks (see the module docstring).

    Args:
        ctx: the mode's ``Context``.
        name: the collective's name (after the optimizer's prefix).
        fields: named numbers, summed.
        per_rank: named numbers with one place per rank (this rank fills its own).
        mask_blocks: with a block count, the record carries two checksums of a block mask, and
            ``result()`` raises where the ranks' masks differ.
        presence: one field per parameter: whether this rank has a gradient for it.
        comm: the communicator it is summed on (default the mode's ``ctx.comm``).
        arrival: a per-rank ``arrival_ms`` (default: with ``presence``, a per-step record): the ms from the
            end of this rank's previous step to the post, unless ``post`` is given it.
    """

    def __init__(self, ctx, name: str, fields: Sequence[str] = (), per_rank: Sequence[str] = (),
                 mask_blocks: int = 0, presence: bool = True, comm=None, arrival: Optional[bool] = None):
        self.ctx, self.name = ctx, f"{ctx.prefix}.{name}"
        self.comm = ctx.comm if comm is None else comm
        self.size, self.rank = ctx.comm.size, ctx.comm.rank
        self._arrival = presence if arrival is None else arrival
        per_rank = tuple(per_rank) + (("arrival_ms",) if self._arrival else ())
        names = list(fields) + (list(_CHECKSUMS) if mask_blocks else []) + (["joined"] if presence else [])
        self.fields: Dict[str, int] = {n: i for i, n in enumerate(names)}
        self.per_rank: Dict[str, int] = {n: len(names) + k * self.size for k, n in enumerate(per_rank)}
        self.presence_at = len(names) + len(per_rank) * self.size
        n = self.presence_at + (ctx.nparams if presence else 0)
        self._presence = presence
        self._checksum = MaskChecksum(mask_blocks, ctx.device) if mask_blocks else None
        # this rank's checksums, kept in the second half of one buffer with the sum: read in one piece
        self._both = torch.zeros(2 * n if mask_blocks else n, dtype=torch.float32, device=ctx.device)
        self.buf = self._both[:n]
        self._own = self._both[n:] if mask_blocks else None
        self._absent_index = None
        self.handle: Optional[Handle] = None

    def post(self, mask: Optional[torch.Tensor] = None, **values) -> Handle:
        """Fill this rank's part (``values``: numbers, bools or device scalars, by field name; a per-rank
        field at this rank's place; ``mask``: the block mask to checksum) and start the sum."""
        buf = self.buf
        buf.zero_()
        if self._arrival and "arrival_ms" not in values:
            t_end = self.ctx.t_end
            values["arrival_ms"] = (time.perf_counter() - t_end) * 1e3 if t_end is not None else 0.0
        for k, v in values.items():
            at = self.fields[k] if k in self.fields else self.per_rank[k] + self.rank
            if torch.is_tensor(v):
                buf[at].copy_(v.reshape(()))
            else:
                buf[at].fill_(float(v))
        if self._checksum is not None:
            for k, c in zip(_CHECKSUMS, self._checksum(mask)):
                buf[self.fields[k]].copy_(c)
            self._own.copy_(buf)
        if self._presence:
            self._fill_presence(buf[self.presence_at:])
            if self.ctx.joined:
                buf[self.fields["joined"]].fill_(1.0)
        self.handle = self.comm.allreduce_sum_async_(buf, self.name)
        return self.handle

    def per_rank_on_device(self, name: str) -> torch.Tensor:
        """Per-rank field ``name`` of the sum as the buffer holds it on the device, once the sum landed (for
        device math that needs no read)."""
        lo = self.per_rank[name]
        return self.buf[lo:lo + self.size]

    def _fill_presence(self, out: torch.Tensor) -> None:
        absent, lo = [], 0
        for fg in self.ctx.groups:
            absent.extend(i + lo for i in fg.absent)
            lo += len(fg.params)
        out.fill_(1.0)
        if absent:
            out.index_fill_(0, self._index(tuple(absent)), 0.0)

    def _index(self, absent: tuple) -> torch.Tensor:
        """``absent`` as an index on the device, kept while it stays the same (frozen parameters): no copy
        from the host at every step, and none that waits (pinned memory) when it changes."""
        if self._absent_index is None or self._absent_index[0] != absent:
            idx = torch.tensor(absent, dtype=torch.long)
            if self.buf.is_cuda:
                idx = idx.pin_memory().to(self.buf.device, non_blocking=True)
            else:
                idx = idx.to(self.buf.device)
            self._absent_index = (absent, idx)
        return self._absent_index[1]

    def result(self, what: str = "allreduce", step: Optional[int] = None,
               extra: Sequence[torch.Tensor] = (), age: int = 0) -> Agreed:
        """Wait for the sum (``what`` names it in a timeout) and read it on the host, with the device
        scalars ``extra`` (in ``Agreed.extra``) in the same read. Raises ``RuntimeError`` on every rank
        when the ranks chose different critical blocks (at ``step``). ``age``: how many steps ago the
        record was posted (DSync reads a step's record ``delay`` steps later)."""
        self.comm.wait(self.handle, self.ctx.timeout, what)
        both = self._both
        if extra:
            both = torch.cat([both] + [e.reshape(1).to(torch.float32) for e in extra])
        values = read(both)  # the sum, this rank's checksums and the extras: one read
        n = self.buf.numel()
        out = Agreed(values[:n], self, values[self._both.numel():])
        if self._checksum is not None:
            own = values[n:]
            for k in _CHECKSUMS:
                t, o = out.total(k), own[self.fields[k]]
                if round(t) != round(o) * self.size:
                    raise RuntimeError(
                        f"osp: ranks chose different critical blocks at step {step} (mask checksum {o:.0f} on "
                        f"this rank, {t / self.size:.3f} on average over {self.size} ranks); continuing would "
                        "make the replicas diverge. The block scores must be bitwise equal on every rank: check "
                        "that all ranks run the same osp, torch and hardware kind")
        if self._presence:
            self.ctx.joined_ranks = int(round(out.total("joined")))
            # the first record that counts every rank: every rank reads the same one (records are read in the
            # order of their steps), though maybe at another step; join() leaves at a step fixed from its own
            if self.ctx.joined and self.ctx.joined_age is None and self.ctx.joined_ranks >= self.size:
                self.ctx.joined_age = age
        # while a rank has joined (out of data) it computes nothing: no arrivals to compare
        if self._arrival and self.ctx.arrivals is not None and not self.ctx.joined_ranks:
            self.ctx.arrivals.record(out.per_rank("arrival_ms"))
        return out


def any_rank(ctx, flag, name: str) -> bool:
    """Whether ``flag`` (this rank's device scalar or bool; None: nothing to ask) is set on some rank:
    one tiny sum, so every rank decides alike."""
    if flag is None:
        return False
    a = Agreement(ctx, name, fields=("flag",), presence=False)
    a.post(flag=flag.to(torch.float32) if torch.is_tensor(flag) else flag)
    return a.result(name).any("flag")
