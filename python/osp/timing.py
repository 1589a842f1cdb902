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

    __slots__ = ("cuda", "_t0", "_t1", "_e0", "_e1")

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._t0 = self._t1 = None
        self._e0 = self._e1 = None

    def start(self) -> "Interval":
        if self.cuda:
            self._e0 = torch.cuda.Event(enable_timing=True)
            self._e0.record()
        else:
            self._t0 = time.perf_counter()
        self._e1 = self._t1 = None
        return self

    @property
    def stopped(self) -> bool:
        return self._e1 is not None or self._t1 is not None

    def stop(self) -> "Interval":
        if self.cuda:
            self._e1 = torch.cuda.Event(enable_timing=True)
            self._e1.record()
        else:
            self._t1 = time.perf_counter()
        return self

    def seconds(self) -> Optional[float]:
        """The interval, once known (None before ``stop()``, and on a GPU before the device got there)."""
        if self.cuda:
            if self._e0 is None or self._e1 is None or not self._e1.query():
                return None
            return self._e0.elapsed_time(self._e1) * 1e-3
        if self._t0 is None or self._t1 is None:
            return None
        return self._t1 - self._t0

    def wait(self, pause: float = 5e-5) -> float:
        """Poll until the device got to ``stop()`` (a CPU is there already); the interval."""
        if self.cuda:
            wait_done(self._e1, pause)
        return self.seconds()


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
