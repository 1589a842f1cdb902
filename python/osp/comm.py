"""Communication backends: one small interface, two engines.

``Comm`` offers what the optimizer needs: in-place allreduce-average (blocking or asynchronous with a
handle), wait, poll, broadcast, rank and size. ``HorovodComm`` runs on ``horovod.torch`` (NCCL on
GPUs, Gloo or MPI on CPUs); ``TorchComm`` on ``torch.distributed`` (NCCL or Gloo). ``get_comm("auto")``
picks Horovod when it is initialized, else an initialized default process group. Starting an engine
from a launcher's environment is ``osp.launcher.init_from_env``.
"""
from __future__ import annotations

import abc
import datetime
import os
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Dict, Iterator, Optional

import torch

from . import linkemu, teardown

_ALONE = threading.local()  # .depth: parts of a step this thread runs on this rank alone


def running_alone() -> bool:
    """Whether this thread runs a part of the step on this rank alone (HSP's extra micro-batches: the other ranks
    wait, or run a different number of them). No collective may be issued there: it would meet another rank's
    step (``osp.broadcast_buffers``' forward hook skips its broadcast)."""
    return getattr(_ALONE, "depth", 0) > 0


@contextmanager
def alone() -> Iterator[None]:
    """Mark what runs inside as this rank's alone (``running_alone``); nests."""
    _ALONE.depth = getattr(_ALONE, "depth", 0) + 1
    try:
        yield
    finally:
        _ALONE.depth -= 1


class Handle:
    """An in-flight allreduce of ``tensor`` (an average, or a sum) named ``name``; pass it to
    ``Comm.wait`` / ``Comm.poll`` of the communicator that started it. Compressed (``wire``), ``tensor`` is
    the buffer on the wire and ``target`` the caller's tensor, which receives the result when it lands."""

    __slots__ = ("tensor", "work", "done", "average", "name", "target", "resum", "due", "t0", "t1")

    def __init__(self, tensor: torch.Tensor, work: Any, average: bool = True, name: str = ""):
        self.tensor, self.work, self.done, self.average, self.name = tensor, work, False, average, name
        self.target: Optional[torch.Tensor] = None
        self.resum = False  # compressed: a sum was asked for, and the wire carried the average
        self.due: Optional[float] = None  # an emulated link's end of this collective (osp.linkemu), if one
        # when it was issued and completed (time.monotonic(); t1 None until known; an emulated link's ``due``
        # is applied by the reader, osp.meter.Meter, which measures the link by them)
        self.t0: Optional[float] = None
        self.t1: Optional[float] = None

    @property
    def result(self) -> torch.Tensor:
        return self.tensor if self.target is None else self.target


class Comm(abc.ABC):
    """The engine interface osp needs; subclasses implement the abstract methods."""

    name = "base"

    def __init__(self):
        self._inflight: Dict[int, Handle] = {}  # started, not yet waited for: completed at exit (teardown)
        teardown.register()

    @property
    @abc.abstractmethod
    def rank(self) -> int:
        raise NotImplementedError

    @property
    @abc.abstractmethod
    def size(self) -> int:
        raise NotImplementedError

    def allreduce_avg_async_(self, tensor: torch.Tensor, name: str, wire: Optional[torch.dtype] = None) -> Handle:
        """Start averaging ``tensor`` in place across ranks; complete it with ``wait``. ``wire``: the dtype it
        travels in (``osp.compression``), where that is not its own."""
        return self._allreduce_async_(tensor, name, True, wire)

    def allreduce_sum_async_(self, tensor: torch.Tensor, name: str, wire: Optional[torch.dtype] = None) -> Handle:
        """Start summing ``tensor`` in place across ranks. A sum is never fused by Horovod with the
        averages (their scale factors differ), so it cannot move their reduction boundaries."""
        return self._allreduce_async_(tensor, name, False, wire)

    def _allreduce_async_(self, tensor: torch.Tensor, name: str, average: bool,
                          wire: Optional[torch.dtype] = None) -> Handle:
        target = None
        if wire is not None and wire != tensor.dtype and tensor.is_floating_point():
            # compressed as Horovod's Compression.fp16 does (cast, reduce, cast back), but divided by the
            # number of ranks before the cast: the sum on the wire then stays within the range of the
            # ranks' own values (an fp16 sum of fp16 values would overflow where their average does not)
            target, tensor = tensor, tensor.div(self.size).to(wire)
            average_on_wire = False
        else:
            average_on_wire = average
        h = Handle(tensor, None, average_on_wire, name)
        if target is not None:
            h.target, h.resum = target, not average
        if tensor.numel() == 0:
            h.done = True
            return h
        h.t0 = time.monotonic()
        h.work = self._start(tensor, name, average_on_wire)
        h.due = linkemu.reserve(tensor.numel() * tensor.element_size(), self.size)  # None: no emulated link
        self._watch(h)
        inflight = self._handles()
        if not inflight:
            teardown.busy(self)  # completed at exit if nobody waits for it
        inflight[id(h)] = h
        return h

    @abc.abstractmethod
    def _start(self, tensor: torch.Tensor, name: str, average: bool) -> Any:
        """Start the engine's allreduce (average or sum) of ``tensor``; returns its work object."""
        raise NotImplementedError

    def _watch(self, handle: Handle) -> None:
        """Have ``handle.t1`` set when the engine completes the collective, where the engine can say (a
        callback); by default it is set when osp finds it done (``_landed``)."""
        return None

    @abc.abstractmethod
    def _complete(self, handle: Handle, timeout: Optional[float] = None) -> bool:
        """Complete the engine's work of ``handle`` with the engine's own wait (the average is then in
        its tensor, for the work queued after it on a CUDA stream); ``False`` when ``timeout`` (seconds)
        passed first."""
        raise NotImplementedError

    def late(self, timeout: float, device: Optional[torch.device] = None) -> "Comm":
        """A communicator for collectives that complete behind the next step's (OSP's stage 2): one
        whose collectives an engine that runs a communicator's collectives in issue order (NCCL, one
        stream per process group) does not queue the next step's first collectives behind. Made once
        per ``Comm`` (every rank calls it at the same point, as it may be a collective); this one by
        default, where the engine offers nothing better. ``device``: where the tensors live."""
        return self

    def _finish(self, handle: Handle) -> torch.Tensor:
        if not handle.done:
            self._complete(handle)
            linkemu.hold(handle.due)
            self._landed(handle)
        return handle.result

    def _landed(self, handle: Handle) -> None:
        if not handle.done:
            if handle.t1 is None:
                handle.t1 = time.monotonic()
            if handle.target is not None:  # decompressed: the average, times the ranks where a sum was asked
                handle.target.copy_(handle.tensor)
                if handle.resum:
                    handle.target.mul_(self.size)
            handle.done = True
            handle.work = None  # the engine's work object may hold the process group and its threads
            inflight = self._handles()
            inflight.pop(id(handle), None)
            if not inflight:
                teardown.idle(self)

    def pending(self) -> list:
        """The collectives started here that nobody has waited for yet."""
        return list(self._handles().values())

    def forget_pending(self) -> None:
        """The engine was restarted (Horovod Elastic's reset): the collectives in flight are gone with it."""
        self._handles().clear()
        teardown.idle(self)

    def _handles(self) -> Dict[int, Handle]:
        # set in __init__; also for a subclass whose __init__ does not call Comm's
        return self.__dict__.setdefault("_inflight", {})

    @abc.abstractmethod
    def poll(self, handle: Handle) -> bool:
        raise NotImplementedError

    def active(self) -> bool:
        """Whether the engine is still up (its work can still be waited for)."""
        return True

    def world_size(self) -> int:
        """The engine's whole world (``size`` is this communicator's: a process set's, a group's)."""
        return self.size

    @property
    def ranks_key(self) -> tuple:
        """Which ranks this communicator spans, as a key: the optimizers built on one set of ranks are
        counted apart from those on another (a Horovod process set's optimizers are built by its ranks
        only)."""
        return (self.name,)

    @property
    def prefix(self) -> str:
        """How the names of an optimizer's collectives begin (then its number among ``ranks_key``'s)."""
        return "osp"

    @property
    def elastic(self) -> bool:
        """Whether ranks may join while others train (Horovod Elastic): then no collective may run
        outside the elastic run function."""
        return False

    def check_dtype(self, dtype: torch.dtype, what: str) -> None:
        """Raise ``ValueError`` if this engine cannot average tensors of ``dtype``."""
        return None

    def wait(self, handle: Handle, timeout: Optional[float] = None, what: str = "allreduce") -> torch.Tensor:
        """Wait for ``handle``; with ``timeout`` (seconds), raise ``TimeoutError`` instead of waiting
        forever on a peer that died or stalled."""
        if handle.done:
            return handle.result
        if not self._complete(handle, timeout):
            raise TimeoutError(
                f"osp: {what} on rank {self.rank} did not complete within {timeout:g} s; a "
                "peer may have died or stalled (raise DistributedOptimizer(timeout=...) if "
                "steps are legitimately this slow)")
        linkemu.hold(handle.due)
        self._landed(handle)
        return handle.result

    def done_within(self, handle: Handle, seconds: float, max_pause: float = 1e-3) -> bool:
        """Poll ``handle`` for up to ``seconds``, sleeping between polls (at most ``max_pause`` s);
        whether it completed. Only for a non-blocking test (HSP's "ready"), and for engines without
        a timed wait (Horovod's)."""
        deadline = time.monotonic() + seconds
        pause = min(2e-5, max_pause)
        while not self.poll(handle):
            now = time.monotonic()
            if now > deadline:
                return False
            # behind an emulated link nothing lands before its end: sleep until then, not in short pauses
            time.sleep(max(pause, min(linkemu.remaining(getattr(handle, "due", None)), deadline - now)))
            pause = min(pause * 2, max_pause)
        return True

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.allgather_object(obj)[root]

    @abc.abstractmethod
    def broadcast_(self, tensor: torch.Tensor, root: int, name: str) -> None:
        raise NotImplementedError

    @abc.abstractmethod
    def allgather_object(self, obj: Any) -> list:
        raise NotImplementedError

    def allreduce_avg_(self, tensor: torch.Tensor, name: str, timeout: Optional[float] = None) -> torch.Tensor:
        return self.wait(self.allreduce_avg_async_(tensor, name), timeout, name)


class HorovodComm(Comm):
    name = "horovod"

    def __init__(self, process_set=None):
        """``process_set``: a Horovod ProcessSet this rank belongs to (``hvd.DistributedOptimizer``'s
        ``process_set=``); every collective runs on it, and ``rank`` / ``size`` are within it."""
        import horovod.torch as hvd

        if not hvd.is_initialized():
            raise RuntimeError("osp: backend 'horovod' needs hvd.init() first")
        super().__init__()
        self.hvd = hvd
        self.ps = hvd.global_process_set if process_set is None else process_set
        if self.ps is not hvd.global_process_set:
            if self.ps.process_set_id is None:
                raise ValueError(f"osp: process_set {self.ps} is not registered with Horovod (pass it to hvd.init("
                                 "process_sets=[...]) or hvd.add_process_set() first)")
            if not self.ps.included():
                raise ValueError(f"osp: this rank ({hvd.rank()}) is not in process_set {self.ps.ranks}; build the "
                                 "optimizer only on the ranks of its process set")

    @property
    def rank(self) -> int:
        return self.ps.rank()

    @property
    def size(self) -> int:
        return self.ps.size()

    def world_size(self) -> int:
        return self.hvd.size()

    @property
    def ranks_key(self) -> tuple:
        return (self.name, self.ps.process_set_id)

    @property
    def prefix(self) -> str:
        return "osp" if self.ps is self.hvd.global_process_set else f"osp.set{self.ps.process_set_id}."

    def _root(self, root: int) -> int:
        # osp's roots are ranks within the communicator, Horovod's are global ranks
        return root if self.ps is self.hvd.global_process_set else sorted(self.ps.ranks)[root]

    def _start(self, tensor, name, average):
        return self.hvd.allreduce_async_(tensor, name=name, op=self.hvd.Average if average else self.hvd.Sum,
                                         process_set=self.ps)

    def _complete(self, handle, timeout=None):
        # Horovod's synchronize() has no timeout: bound it by polling first (its torch ops block the
        # host in synchronize() in any case, on GPUs too, so polling costs only the pauses' latency).
        # Horovod has no second communicator of the same ranks (no duplicate process sets); on GPUs
        # HOROVOD_NUM_NCCL_STREAMS=2 spreads its collectives over two streams instead (docs/design.md)
        if timeout is not None and not self.done_within(handle, timeout, max_pause=2e-4):
            return False
        self.hvd.synchronize(handle.work)
        return True

    def poll(self, handle):
        return handle.done or (linkemu.passed(handle.due) and bool(self.hvd.poll(handle.work)))

    def active(self):
        return bool(self.hvd.is_initialized())

    @property
    def elastic(self):
        return os.environ.get("HOROVOD_ELASTIC") == "1"  # set by horovodrun for elastic workers

    _warned_streams = False

    def late(self, timeout, device=None):
        """Horovod has no second communicator of the same ranks (no duplicate process sets): this one. Its
        NCCL path runs its collectives round-robin over HOROVOD_NUM_NCCL_STREAMS streams (default 1, where
        stage 1 queues behind the last stage 2); said once on GPUs when it is 1."""
        if device is not None and device.type == "cuda" and not HorovodComm._warned_streams \
                and os.environ.get("HOROVOD_NUM_NCCL_STREAMS", "1").strip() == "1":
            HorovodComm._warned_streams = True
            warnings.warn(
                "osp: Horovod runs its NCCL collectives on one stream (HOROVOD_NUM_NCCL_STREAMS=1), in issue order, "
                "so OSP's stage 1 of a step waits behind the last step's stage 2. Launch with horovodrun "
                "--num-nccl-streams 2 (or set HOROVOD_NUM_NCCL_STREAMS=2 before hvd.init()), or use the "
                "torch.distributed backend, where stage 2 has a process group of its own", RuntimeWarning,
                stacklevel=4)
        return self

    def check_dtype(self, dtype, what):
        if dtype == torch.bfloat16:  # Horovod 0.28 has no bfloat16 collectives, on CPUs or GPUs
            raise ValueError(f"osp: {what} is bfloat16, which Horovod cannot allreduce; use float32 or "
                             "float16 parameters with Horovod, or the torch.distributed backend")

    def broadcast_object(self, obj, root=0):
        # Horovod names the collective after type(obj) unless told: ranks passing None would hang
        return self.hvd.broadcast_object(obj, root_rank=self._root(root), name="osp.broadcast_object",
                                         process_set=self.ps)

    def broadcast_(self, tensor, root, name):
        self.hvd.broadcast_(tensor, self._root(root), name=name, process_set=self.ps)

    def allgather_object(self, obj):
        if self.ps is self.hvd.global_process_set:
            return self.hvd.allgather_object(obj)
        # Horovod 0.28's allgather_object has no process_set: the same, on the set
        import pickle

        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        sizes = self.hvd.allgather(torch.tensor([data.numel()]), name="osp.allgather_object.sz", process_set=self.ps)
        gathered = self.hvd.allgather(data, name="osp.allgather_object.t", process_set=self.ps)
        out, o = [], 0
        for n in sizes.tolist():
            out.append(pickle.loads(gathered[o:o + n].numpy().tobytes()))
            o += n
        return out


class _Released:
    """What a communicator's group is once osp released it at exit (``TorchComm.release_group``)."""

    def __repr__(self):
        return "<a process group osp made, destroyed and released at exit>"


_RELEASED = _Released()


class TorchComm(Comm):
    """torch.distributed: allreduce-sum then divide by the world size (Gloo has no AVG)."""

    name = "torch"

    def __init__(self, group=None):
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("osp: backend 'torch' needs torch.distributed.init_process_group() first")
        super().__init__()
        self.dist, self.group = dist, group
        self._late: Optional["TorchComm"] = None

    @property
    def rank(self) -> int:
        return self.dist.get_rank(self.group)

    @property
    def size(self) -> int:
        return self.dist.get_world_size(self.group)

    def world_size(self) -> int:
        return self.dist.get_world_size()

    @property
    def ranks_key(self) -> tuple:
        if self.group is None or self.group is _RELEASED:
            return (self.name,)
        return (self.name, tuple(self.dist.get_process_group_ranks(self.group)))

    @property
    def prefix(self) -> str:
        return "osp" if len(self.ranks_key) == 1 else "osp.ranks" + "_".join(map(str, self.ranks_key[1])) + "."

    def _start(self, tensor, name, average):
        return self.dist.all_reduce(tensor, group=self.group, async_op=True)

    def _watch(self, handle):
        # Gloo completes a CPU collective's future in its own thread when the collective ends: note the time
        # there. NCCL's future completes when the work is queued, which times nothing: osp's own wait does then
        if not handle.tensor.is_cuda and handle.work is not None:
            def done(_fut, h=handle):
                if h.t1 is None:
                    h.t1 = time.monotonic()
            handle.work.get_future().add_done_callback(done)

    def _complete(self, handle, timeout=None):
        if timeout is None or handle.tensor.is_cuda:
            # NCCL: stream-ordered, the current stream waits for the collective and the host does not
            # (a wait with a timeout would block the host); the group's own timeout is its watchdog's
            handle.work.wait()
        else:
            try:
                handle.work.wait(datetime.timedelta(seconds=timeout))
            except RuntimeError as e:  # Gloo: "Operation timed out!"; the work stays valid
                if "timed out" not in str(e).lower():
                    raise
                return False
        if handle.average:
            handle.tensor.div_(self.size)
        return True

    def late(self, timeout, device=None):
        """A second process group of the same ranks (made once, a collective of every rank): ProcessGroupNCCL
        runs one group's collectives in issue order on one stream, so OSP's stage 2 of step t would hold
        back stage 1 of step t+1 on the default group. Within a subgroup (``group=``), the subgroup."""
        if self.group is not None:
            return self
        if self._late is None:
            g = self.dist.new_group(timeout=datetime.timedelta(seconds=timeout))
            self._late = TorchComm(g)
            teardown.made_group(self._late)  # osp's own group: released at exit so its threads are joined
        return self._late

    def release_group(self) -> None:
        """Drop this communicator's reference to its process group (at exit, after the groups were destroyed):
        an optimizer the script still holds would otherwise keep the group, and Gloo's threads, alive into the
        interpreter's shutdown. Anything sent on it afterwards fails."""
        self.group = _RELEASED

    def poll(self, handle):
        return handle.done or (linkemu.passed(handle.due) and handle.work.is_completed())

    def active(self):
        return self.dist.is_initialized()

    def _root(self, root: int) -> int:
        # osp's roots are ranks within the communicator, torch.distributed's src a global rank
        return root if self.group is None else self.dist.get_global_rank(self.group, root)

    def broadcast_object(self, obj, root=0):
        box = [obj]
        self.dist.broadcast_object_list(box, src=self._root(root), group=self.group)
        return box[0]

    def broadcast_(self, tensor, root, name):
        self.dist.broadcast(tensor, self._root(root), group=self.group)

    def allgather_object(self, obj):
        out = [None] * self.size
        self.dist.all_gather_object(out, obj, group=self.group)
        return out


class LocalComm(Comm):
    """One rank alone, no engine: what a ``DistributedOptimizer`` gets on a rank outside its process set
    (``process_set=``), where Horovod's own optimizer registers no hooks and steps on the rank's gradient alone.
    Every collective is the identity (the average of one), so every mode steps as ``torch.optim`` does."""

    name = "local"

    @property
    def rank(self) -> int:
        return 0

    @property
    def size(self) -> int:
        return 1

    def _start(self, tensor, name, average):
        return None

    def _complete(self, handle, timeout=None):
        return True

    def poll(self, handle):
        return True

    def broadcast_(self, tensor, root, name):
        return None

    def allgather_object(self, obj):
        return [obj]


def horovod_initialized() -> bool:
    try:
        import horovod.torch as hvd
    except ImportError:
        return False
    try:
        return bool(hvd.is_initialized())
    except Exception:
        return False


def get_comm(backend: str | Comm = "auto") -> Comm:
    """``"auto"`` (Horovod when initialized, else torch.distributed), ``"horovod"``, ``"torch"``,
    or a ready ``Comm``."""
    if isinstance(backend, Comm):
        return backend
    if backend == "auto":
        if horovod_initialized():
            return HorovodComm()
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return TorchComm()
        raise RuntimeError(
            "osp: backend='auto' found neither an initialized Horovod (call hvd.init()) nor an "
            "initialized torch.distributed process group (call init_process_group())")
    if backend == "horovod":
        return HorovodComm()
    if backend == "torch":
        return TorchComm()
    raise ValueError(f"osp: unknown backend {backend!r}: expected 'auto', 'horovod', 'torch' or a Comm")
