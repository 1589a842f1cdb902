"""Gradients averaged in buckets that start during backward (as DDP's reducer and Horovod's hooks do).

A bucket is a run of consecutive parameters of one flat group, in reverse order (as backward produces
them), closed once it holds ``bucket_mb`` MiB (the first one 1 MiB, as DDP's): a contiguous slice of
the flat gradient. When every parameter of a bucket has had its last backward pass of the step, the
bucket's slice is averaged asynchronously. Buckets start strictly in order, so every rank issues the
same collectives in the same order.
"""
from __future__ import annotations

from typing import Callable, List, Optional, Sequence

import torch

from .comm import Comm, Handle
from .layout import FlatGroup

FIRST_BUCKET_BYTES = 1 << 20  # DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES)


class Buckets:
    """The buckets of ``groups`` and the averages of one step in flight.

    ``dest(fg)`` is the buffer a flat group's gradient is averaged in (default: the flat gradient
    itself; a mode that keeps the local gradient passes a buffer of its own, which receives a copy).
    ``start(b)``, if given, replaces the averaging of bucket ``b`` (its gradients gathered): it starts
    what the mode wants and returns the handle, or None when there is nothing to wait for.
    """

    def __init__(self, groups: Sequence[FlatGroup], bucket_mb: float, comm: Comm, name: str,
                 start: Optional[Callable[[int], Optional[Handle]]] = None,
                 wire: Callable[[FlatGroup], Optional[torch.dtype]] = lambda fg: None):
        """``wire(fg)``: the dtype a flat group's buckets travel in (``osp.compression``; None: its own)."""
        self.comm, self.name, self.start, self.wire = comm, name, start, wire
        limit = int(bucket_mb * (1 << 20))
        first = min(limit, FIRST_BUCKET_BYTES)
        self.buckets: List[tuple] = []  # (fg, lo, hi, params)
        for fg in groups:
            cur, lo, hi = [], None, None
            for i in reversed(range(len(fg.params))):
                p, o = fg.params[i], fg.offsets[i]
                if not cur:
                    hi = fg.padded if i == len(fg.params) - 1 else o + p.numel()
                cur.append(p)
                lo = 0 if i == 0 else o
                # as DDP's reducer: a bucket closes once it holds its cap, the first one at 1 MiB, so
                # the last layers' gradients start averaging early in backward
                if (hi - lo) * p.element_size() >= (first if not self.buckets else limit):
                    self.buckets.append((fg, lo, hi, cur))
                    cur = []
            if cur:
                self.buckets.append((fg, lo, hi, cur))
        self._bucket_of = {p: b for b, (_, _, _, ps) in enumerate(self.buckets) for p in ps}
        self.dest: Callable[[FlatGroup], torch.Tensor] = lambda fg: fg.grad
        self.meter = None  # an osp.meter.Meter told when each bucket is issued (OSP's auto measures the step)
        self.reset()

    def reset(self, dest: Callable[[FlatGroup], torch.Tensor] = None, tag: str = "") -> None:
        """Forget the step's ready gradients and handles (the caller waited for them or keeps them)."""
        self._ready = [0] * len(self.buckets)
        self.launched: List[Handle] = []
        if dest is not None:
            self.dest = dest
        self.tag = tag

    @property
    def in_flight(self) -> bool:
        return bool(self.launched)

    def on_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient had its last backward pass of the step: start what is complete."""
        self._ready[self._bucket_of[p]] += 1
        self.launch(force=False)

    def launch(self, force: bool = True) -> List[Optional[Handle]]:
        """Start the buckets that are ready (``force``: all the rest, a missing gradient counting as
        zeros); returns the handles of the step so far (None where ``start`` had nothing to wait for)."""
        while len(self.launched) < len(self.buckets):
            b = len(self.launched)
            fg, lo, hi, ps = self.buckets[b]
            if not force and self._ready[b] < len(ps):
                break
            fg.gather_grads(ps)
            if self.start is not None:
                h = self.start(b)
            else:
                buf = self.dest(fg)
                if buf is not fg.grad:
                    buf[lo:hi].copy_(fg.grad[lo:hi])
                h = self.comm.allreduce_avg_async_(buf[lo:hi], f"{self.name}{self.tag}.{b}", wire=self.wire(fg))
            self.launched.append(h)
            if self.meter is not None:
                self.meter.issued(b, h)
        return self.launched

    def wait(self, handles: Sequence[Optional[Handle]], timeout: float, what: str) -> None:
        for h in handles:
            if h is not None:
                self.comm.wait(h, timeout, what)


