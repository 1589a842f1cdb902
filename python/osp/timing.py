"""Time as the device sees it, for the decisions that depend on it (HSP's extras, OSP(auto)'s budget).

On a CPU the host's clock times the work, which runs where it is called. On a GPU the host only
enqueues it: ``perf_counter`` around a forward and backward measures how long queueing took, and around
a stream-ordered wait, nothing. There an ``Interval`` records two CUDA events on the current stream and
reads their elapsed time once both completed (``Event.query()``, never a sync); ``wait_done`` polls an
event until the device got there (for HSP, which must know when its own work finished).

``traced(name)`` puts a method in a ``torch.profiler.record_function`` range, so a user's profiler trace
(TensorBoard, Perfetto) shows where osp's time goes, as Horovod's timeline does: ``osp.stage1.bucket``,
``osp.stage1.launch``, ``osp.stage1.wait``, ``osp.side_channel``, ``osp.stage2.launch``,
``osp.stage2.wait``, ``osp.correction``, ``osp.dsync.wait``, ``osp.dsync.replay``, ``osp.hsp.extra``,
``osp.hsp.wait``, ``osp.bsp.allreduce`` (``RANGES``). Without a profiler a range costs about a microsecond.
"""
from __future__ import annotations

import functools
import time
from typing import Optional

import torch
from torch.profiler import record_function


class Interval:
    """The time between ``start()`` and ``stop()`` on ``device``'s current stream: a host clock on a CPU,
    CUDA events on a GPU (``seconds()`` is None until the device got to ``stop()``)."""

    __slots__ = ("cuda", "_begin", "_end")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._begin = self._end = None  # perf_counter() values on a CPU, recorded CUDA events on a GPU

    def _mark(self):
        if not self.cuda:
            return time.perf_counter()
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def start(self) -> "Interval":
        self._begin, self._end = self._mark(), None
        return self

    @property
    def stopped(self) -> bool:
        return self._end is not None

    def stop(self) -> "Interval":
        self._end = self._mark()
        return self

    def seconds(self) -> Optional[float]:
        """The interval, once known (None before ``stop()``, and on a GPU before the device got there)."""
        if self._begin is None or self._end is None:
            return None
        if self.cuda:
            return self._begin.elapsed_time(self._end) * 1e-3 if self._end.query() else None
        return self._end - self._begin

    def wait(self, pause: float = 5e-5) -> Optional[float]:
        """Poll until the device got to ``stop()`` (a CPU is there already); the interval."""
        if self.cuda:
            wait_done(self._end, pause)
        return self.seconds()


def wait_here(device: torch.device) -> None:
    """On a GPU, poll until the device ran everything queued so far on the current stream (no sync);
    nothing on a CPU, where the work ran when it was called."""
    if device.type == "cuda":
        Interval(device).stop().wait()


def wait_done(event, pause: float = 5e-5) -> None:
    """Poll a CUDA event until the device got to it: the host waits, as a sync would, but without one
    (``torch.cuda.set_sync_debug_mode`` sees none, and nothing else is drained)."""
    while not event.query():
        time.sleep(pause)


#: every range osp's steps mark (docs/design.md, "Where the time goes")
RANGES = ("osp.stage1.bucket", "osp.stage1.launch", "osp.stage1.wait", "osp.side_channel", "osp.stage2.launch",
          "osp.stage2.wait", "osp.correction", "osp.dsync.wait", "osp.dsync.replay", "osp.hsp.extra", "osp.hsp.wait",
          "osp.bsp.allreduce")


def traced(name: str):
    """Run the decorated function in the profiler range ``name`` (one of ``RANGES``)."""
    assert name in RANGES, name

    def deco(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            with record_function(name):
                return fn(*args, **kwargs)
        return wrapper
    return deco


def span(name: str):
    """The profiler range ``name`` (one of ``RANGES``) as a context manager, around a block."""
    assert name in RANGES, name
    return record_function(name)
