"""A slow link emulated in user space, for machines where links cannot be shaped (no root for tc).

    python -m osp.train --link 1gbit            # or 100mbit, 10gbit; with a latency: --link 1gbit,200us

Every collective the training job issues (osp's, and its contenders': Horovod's ``hvd.DistributedOptimizer``
and DDP) completes no earlier than an emulated link would carry it:

    seconds(bytes, N) = latency + 2(N-1)/N * 8 * bytes / rate          (one rank: 0, no link is crossed)

the ring allreduce's bytes per rank at ``rate`` bits/s, plus ``latency`` once per collective. The link is one
per process and carries one collective at a time: a collective starts when it is issued or when the one before
it on the link ends, whichever is later (``Link.reserve``), so collectives queue behind each other as on a real
link. The real collective runs as usual (on loopback, in well under the emulated time); whoever waits for it
then sleeps until the emulated end (``Link.hold``), and a poll says "not yet" until then. Nothing spins: the
host computes meanwhile, so compute overlaps communication as it would behind a real link.

Where it hooks in: osp's ``Comm`` (issue: ``reserve``; wait: ``hold``; poll: ``passed``), DDP through a
communication hook whose future completes at the emulated end (``ddp_hook``), and Horovod's optimizer through
its module's ``allreduce_async_`` and ``synchronize`` (``emulate_horovod_optimizer``).

What it is not: a network. The time runs from this rank's issue, so a peer that issues later delays the
collective by its lateness (the real collective waits for it) but adds no transfer time after it; flows do not
share the link's rate (they queue); Horovod's fusion is not seen (each tensor it sends is a collective here).
Real shaped links (network namespaces, tc) are what ``make bench`` and the root path of ``make demo`` use;
their figures are in docs/benchmarks.md.
"""
from __future__ import annotations

import heapq
import threading
import time
from typing import Optional

from .units import parse_bandwidth, parse_latency

__all__ = ["Link", "parse_rate", "parse_latency", "parse_link", "install", "uninstall", "current", "reserve",
           "passed", "hold", "remaining", "ddp_hook", "emulate_horovod_optimizer"]

def parse_rate(text: str) -> float:
    """A rate in bits per second, spelled in bits as tc writes it (``1gbit``, ``100mbit``): ``osp.units``'
    ``parse_bandwidth``, the one parser of link rates (byte and ``bps`` spellings refused, not guessed)."""
    return parse_bandwidth(text)


def parse_link(text: str) -> "Link":
    """``RATE`` or ``RATE,LATENCY`` (``1gbit``, ``1gbit,200us``) -> ``Link``."""
    rate, _, latency = str(text).partition(",")
    link = Link(parse_rate(rate), parse_latency(latency) if latency.strip() else 0.0)
    link.spec = str(text).strip()
    return link


def _rate_words(bps: float) -> str:
    for unit, mult in (("Tbit/s", 1e12), ("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= mult:
            return f"{bps / mult:g} {unit}"
    return f"{bps:g} bit/s"


class Link:
    """One emulated link: ``rate`` bits/s, ``latency`` s per collective; collectives queue on it in issue order.

    ``reserve(nbytes, n)`` books a collective and returns when it ends (``time.monotonic()`` seconds); ``hold``
    sleeps until then. Thread-safe. Counts what it did: ``collectives``, ``link_s`` (their emulated times) and
    ``held_s`` (time a waiter slept past the real collective's end: what the emulation added)."""

    def __init__(self, rate: float, latency: float = 0.0):
        if not rate > 0:
            raise ValueError(f"link rate must be > 0 bits/s, got {rate!r}")
        if not latency >= 0:
            raise ValueError(f"link latency must be >= 0 s, got {latency!r}")
        self.rate, self.latency = float(rate), float(latency)
        self.spec = f"{self.rate:g}bit,{self.latency * 1e6:g}us"  # as osp.train --link takes it
        self._lock = threading.Lock()
        self._free_at = 0.0
        self.collectives, self.link_s, self.held_s = 0, 0.0, 0.0

    def seconds(self, nbytes: int, n: int) -> float:
        """The emulated time of one allreduce of ``nbytes`` bytes over ``n`` ranks (0 with one rank)."""
        if n <= 1:
            return 0.0
        return self.latency + 2.0 * (n - 1) / n * 8.0 * nbytes / self.rate

    def reserve(self, nbytes: int, n: int, now: Optional[float] = None) -> Optional[float]:
        """Book a collective issued ``now``: it starts when the link is free and ends ``seconds`` later; returns
        that end (None with one rank: nothing crosses a link)."""
        dt = self.seconds(nbytes, n)
        if dt <= 0:
            return None
        now = time.monotonic() if now is None else now
        with self._lock:
            start = max(now, self._free_at)
            self._free_at = start + dt
            self.collectives += 1
            self.link_s += dt
            return self._free_at

    def hold(self, due: Optional[float]) -> None:
        """Sleep until ``due`` (a ``reserve`` result; None: return at once)."""
        left = remaining(due)
        if left > 0:
            with self._lock:
                self.held_s += left
            time.sleep(left)
            while time.monotonic() < due:  # sleep may wake a little early on some kernels
                time.sleep(max(due - time.monotonic(), 1e-5))

    def describe(self) -> str:
        """``emulated link: 1 Gbit/s, 200 us per collective (user space; not a real network)``"""
        return (f"emulated link: {_rate_words(self.rate)}, {self.latency * 1e6:g} us per collective "
                "(user space; not a real network)")

    def summary(self) -> dict:
        return {"rate_bps": self.rate, "latency_s": self.latency, "collectives": self.collectives,
                "link_s": self.link_s, "held_s": self.held_s}

    def __repr__(self):
        return f"Link({_rate_words(self.rate)}, {self.latency * 1e6:g} us)"


# -- the process's link, for osp's Comm --------------------------------------------------------------------------
_LINK: Optional[Link] = None


def install(link: Optional[Link]) -> Optional[Link]:
    """Make ``link`` the one every osp ``Comm`` of this process books its collectives on (None: none); returns
    the one it replaces."""
    global _LINK
    old, _LINK = _LINK, link
    return old


def uninstall() -> None:
    install(None)


def current() -> Optional[Link]:
    return _LINK


def reserve(nbytes: int, n: int) -> Optional[float]:
    """Book a collective on the installed link; its end, or None (no link installed, or one rank)."""
    return None if _LINK is None else _LINK.reserve(nbytes, n)


def remaining(due: Optional[float]) -> float:
    """Seconds until ``due`` (0 when None or past)."""
    return 0.0 if due is None else max(0.0, due - time.monotonic())


def passed(due: Optional[float]) -> bool:
    return due is None or time.monotonic() >= due


def hold(due: Optional[float]) -> None:
    """Sleep until ``due`` on the installed link's account (None: return at once)."""
    if due is None:
        return
    if _LINK is not None:
        _LINK.hold(due)
    else:
        left = remaining(due)
        if left > 0:
            time.sleep(left)


# -- delayed completion of futures (DDP) -------------------------------------------------------------------------
class _Timer:
    """One daemon thread completing futures at their due times (``at``): nothing spins, and the thread that
    completed the real collective (Gloo's) is never held."""

    def __init__(self):
        self._heap, self._cond, self._seq, self._thread = [], threading.Condition(), 0, None

    def at(self, due: float, fn) -> None:
        with self._cond:
            self._seq += 1
            heapq.heappush(self._heap, (due, self._seq, fn))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="osp-linkemu", daemon=True)
                self._thread.start()
            self._cond.notify()

    def _run(self):
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                _, _, fn = heapq.heappop(self._heap)
            fn()


_TIMER = _Timer()


def delay_future(fut, due: Optional[float], link: Optional[Link] = None):
    """A ``torch.futures.Future`` with ``fut``'s value (or error) that completes no earlier than ``due``."""
    import torch

    if due is None:
        return fut
    out = torch.futures.Future()

    def landed(f):
        try:
            value, error = f.value(), None
        except Exception as e:  # noqa: BLE001 - passed on to whoever waits
            value, error = None, e
        late = remaining(due)
        if link is not None and late > 0:
            with link._lock:
                link.held_s += late

        def complete():
            if error is not None:
                out.set_exception(error)
            else:
                out.set_result(value)
        if late > 0:
            _TIMER.at(due, complete)
        else:
            complete()
    fut.add_done_callback(landed)
    return out


def ddp_hook(link: Link, compression: str = "none"):
    """A DDP communication hook (``ddp.register_comm_hook(None, hook)``): DDP's own ``allreduce_hook`` (or its
    ``fp16_compress_hook`` / ``bf16_compress_hook`` for ``compression``), its future completing no earlier than
    ``link`` carries the bucket's bytes on the wire."""
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = {"none": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
             "bf16": default_hooks.bf16_compress_hook}.get(compression)
    if inner is None:
        raise ValueError(f"the link emulation wraps DDP's allreduce, fp16 and bf16 hooks, not {compression!r}: "
                         "it cannot tell how many bytes another hook sends")

    def hook(state, bucket):
        buf = bucket.buffer()
        wire = 2 if compression in ("fp16", "bf16") else buf.element_size()
        due = link.reserve(buf.numel() * wire, dist.get_world_size(state))
        return delay_future(inner(state, bucket), due, link)
    hook.__name__ = f"linkemu_{inner.__name__}"
    return hook


def emulate_horovod_optimizer(link: Link) -> None:
    """Route ``hvd.DistributedOptimizer``'s collectives over ``link``: its module's ``allreduce_async_`` and
    ``grouped_allreduce_async_`` book each collective (the bytes of the tensors it sends, compressed ones as
    sent), and its ``synchronize(handle)`` returns no earlier than the booked end. For this process, once."""
    import horovod.torch.optimizer as hopt

    if getattr(hopt, "_osp_linkemu", None) is not None:
        hopt._osp_linkemu["link"] = link
        return
    state = {"link": link, "due": {}}
    real_async, real_grouped, real_sync = hopt.allreduce_async_, hopt.grouped_allreduce_async_, hopt.synchronize

    def booked(handle, tensors, process_set):
        n = process_set.size() if process_set is not None else hopt.size()
        state["due"][handle] = state["link"].reserve(sum(t.numel() * t.element_size() for t in tensors), n)
        return handle

    def allreduce_async_(tensor, *args, **kwargs):
        return booked(real_async(tensor, *args, **kwargs), [tensor], kwargs.get("process_set"))

    def grouped_allreduce_async_(tensors, *args, **kwargs):
        return booked(real_grouped(tensors, *args, **kwargs), list(tensors), kwargs.get("process_set"))

    def synchronize(handle):
        out = real_sync(handle)
        state["link"].hold(state["due"].pop(handle, None))
        return out

    hopt.allreduce_async_, hopt.grouped_allreduce_async_, hopt.synchronize = (allreduce_async_,
                                                                             grouped_allreduce_async_, synchronize)
    hopt._osp_linkemu = state
