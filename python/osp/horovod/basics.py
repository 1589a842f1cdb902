"""``osp.horovod``'s engine: ``init`` / ``shutdown``, the ranks and sizes, what is built, and process sets, on
torch.distributed (Gloo for CPU tensors, NCCL for CUDA ones where torch has it), started from torchrun's (or an
MPI launcher's) environment."""
from __future__ import annotations

import enum
import os
import socket
from typing import Dict, List, Optional, Sequence

import torch
import torch.distributed as dist

from .. import teardown


class ReduceOp(enum.IntEnum):
    """Horovod's reduction ops, with Horovod's values (``hvd.Average == 0``...): code that compares them, or
    passes Horovod's own, reads the same."""

    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average, Sum, Adasum, Min, Max, Product = (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Adasum, ReduceOp.Min,
                                           ReduceOp.Max, ReduceOp.Product)


class HorovodInternalError(RuntimeError):
    """A collective failed (a peer died or the engine was torn down): what Horovod raises, and what
    ``osp.horovod.elastic.run`` turns into a restart from the last commit."""


class CollectiveMismatchError(RuntimeError):
    """The ranks issued collectives that differ (kind, dtype, shape, op, root): raised on every rank, where Horovod's
    coordinator raises its own error (a ``RuntimeError`` too)."""


class HostsUpdatedInterrupt(RuntimeError):
    """Horovod Elastic's signal that hosts were added or removed. Under torchrun a change of membership restarts
    every worker, so osp never raises it; it exists for scripts that catch it."""

    def __init__(self, skip_sync=False):
        super().__init__("hosts updated")
        self.skip_sync = skip_sync


class _World:
    """What ``init()`` found: whether osp made the process group, the topology, the process sets."""

    def __init__(self):
        self.initialized = False
        self.made_group = False
        self.local_rank = self.local_size = self.cross_rank = self.cross_size = 0
        self.homogeneous = True
        self.sets: Dict[int, "ProcessSet"] = {}
        self.next_id = 1


_world = _World()


def _need_init() -> None:
    if not _world.initialized:
        raise ValueError("Horovod has not been initialized; use hvd.init().")


class ProcessSet:
    """Horovod's ``ProcessSet``: a subset of the ranks that run collectives together, here a torch.distributed
    group. Register it with ``init(process_sets=[...])`` or ``add_process_set()``: every rank must (a group is made
    by all ranks, in the same order); unlike Horovod, no ``HOROVOD_DYNAMIC_PROCESS_SETS`` is needed for
    ``add_process_set`` after ``init``. Roots of broadcasts are global ranks, as in Horovod. A set built from an
    mpi4py communicator is refused: name its ranks."""

    process_set_id: Optional[int] = None
    ranks: Optional[List[int]] = None
    mpi_comm = None

    def __init__(self, ranks_or_comm: Sequence[int]):
        try:
            ranks = sorted(ranks_or_comm)
        except TypeError:
            raise ValueError("osp.horovod: a ProcessSet is built from a list of ranks (an mpi4py communicator is "
                             f"not supported: name its ranks), got {ranks_or_comm!r}") from None
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise ValueError(f"osp.horovod: ProcessSet ranks must be integers, got {ranks_or_comm!r}")
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"osp.horovod: ProcessSet ranks must be distinct, got {ranks_or_comm!r}")
        self.ranks = ranks
        self._group = None

    @property
    def group(self):
        """The torch.distributed group of this set (``None``: the default group, for the global set)."""
        self._check_registered()
        return self._group

    def _check_registered(self) -> None:
        _need_init()
        if self.process_set_id is None:
            raise ValueError(f"osp.horovod: {self} is not registered: pass it to hvd.init(process_sets=[...]) or "
                             "hvd.add_process_set() (on every rank) first")

    def size(self) -> Optional[int]:
        if self.process_set_id is None:
            return None
        return len(self.ranks)

    def rank(self) -> Optional[int]:
        """This rank's place within the set (as Horovod: a ValueError outside it)."""
        if self.process_set_id is None:
            return None
        if not self.included():
            raise ValueError("Process is not part of provided process set.")
        return self.ranks.index(dist.get_rank())

    def included(self) -> Optional[bool]:
        if self.ranks is None:
            return None
        return dist.get_rank() in self.ranks

    def _check_member(self, what: str) -> None:
        self._check_registered()
        if not self.included():
            raise ValueError(f"osp.horovod: {what} on {self}, which does not include this rank "
                             f"({dist.get_rank()}): run it on the set's ranks only")

    def _osp_comm(self):
        """The communicator of an ``osp.DistributedOptimizer(process_set=self)`` (``osp.keywords.backend_for``):
        the set's group, or, on a rank outside it, none (the rank steps alone, as under Horovod)."""
        from ..comm import LocalComm, TorchComm

        self._check_registered()
        if not self.included():
            return LocalComm()
        return TorchComm(self._group)

    def release_group(self) -> None:
        """At exit, after the groups were destroyed (``osp.teardown``): let go of the group."""
        self._group = None

    def _invalidate(self) -> None:
        self.process_set_id = None
        self._group = None

    def __str__(self):
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __repr__ = __str__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0


def _register(ps: ProcessSet) -> ProcessSet:
    if not isinstance(ps, ProcessSet):
        ps = ProcessSet(ps)
    size = dist.get_world_size()
    if not ps.ranks or ps.ranks[0] < 0 or ps.ranks[-1] >= size:
        raise ValueError(f"osp.horovod: a process set's ranks must lie in 0..{size - 1}, got {ps.ranks}")
    if any(s.ranks == ps.ranks for s in _world.sets.values()) or ps.ranks == list(range(size)):
        raise ValueError(f"Attempted to add a duplicate process set: {ps}")
    ps._group = dist.new_group(ps.ranks)  # every rank makes every group, in the same order
    ps.process_set_id = _world.next_id
    _world.next_id += 1
    _world.sets[ps.process_set_id] = ps
    teardown.made_group(ps)
    return ps


def add_process_set(process_set) -> ProcessSet:
    """Register a process set (a ``ProcessSet`` or a list of ranks) and return it; every rank calls it, in the same
    order. A set with the ranks of one already registered raises ``ValueError``, as in Horovod."""
    _need_init()
    return _register(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Forget a registered process set (every rank calls it); ``False`` for the global set or one not
    registered."""
    _need_init()
    pid = process_set.process_set_id
    if pid is None or pid == 0 or _world.sets.get(pid) is not process_set:
        return False
    del _world.sets[pid]
    group = process_set._group
    process_set._invalidate()
    if group is not None:
        dist.destroy_process_group(group)
    return True


def _pg_backend() -> str:
    """Gloo for CPU tensors, and NCCL for CUDA ones where torch has NCCL and sees a GPU: Horovod reduces tensors of
    either kind in one job, and so does a group of both backends."""
    if torch.cuda.is_available() and dist.is_nccl_available():
        return "cpu:gloo,cuda:nccl"
    return "gloo"


def init(comm=None, process_sets=None) -> None:
    """``hvd.init()``: start torch.distributed from torchrun's environment (or mpirun's: Open MPI's and MPICH's
    variables are read, with ``MASTER_ADDR`` / ``MASTER_PORT`` from the environment, default 127.0.0.1:29500), or a
    world of one process when no launcher started this one. A process group the script made already is used as it
    is. ``process_sets``: ``ProcessSet`` s to register, or ``"dynamic"`` (accepted; every set is dynamic here).
    ``comm`` (an mpi4py communicator or a list of ranks: Horovod on a subset of MPI's ranks) is refused: launch
    that many ranks, or use a process set. Calling it again does nothing."""
    if comm is not None:
        raise ValueError("osp.horovod: init(comm=...) (Horovod on an MPI communicator or a subset of ranks) is not "
                         "supported on torch.distributed: launch the ranks you want, or use "
                         "hvd.add_process_set(ranks) for collectives on a subset")
    if _world.initialized:
        return
    if not dist.is_available():
        raise RuntimeError("osp.horovod: this torch was built without torch.distributed")
    if not dist.is_initialized():
        from ..launcher import detect_backend, init_process_group

        kind, _ = detect_backend()
        if kind == "single":
            dist.init_process_group(_pg_backend(), store=dist.HashStore(), rank=0, world_size=1)
        else:
            init_process_group(_pg_backend())
        _world.made_group = True
    teardown.register()
    _topology()
    _world.initialized = True
    global_process_set.ranks = list(range(dist.get_world_size()))
    if process_sets is not None and process_sets != "dynamic":
        for ps in process_sets:
            _register(ps)


def _topology() -> None:
    """Horovod's local and cross ranks, from every rank's host name: ``local_rank`` counts the ranks of this host
    before this one, ``cross_rank`` the hosts before this one among the ranks of the same local rank."""
    host = os.environ.get("OSP_HOSTNAME") or socket.gethostname()
    hosts: list = [None] * dist.get_world_size()
    dist.all_gather_object(hosts, host)
    me = dist.get_rank()
    mine = [r for r, h in enumerate(hosts) if h == host]
    _world.local_rank, _world.local_size = mine.index(me), len(mine)
    same_local = [r for r in range(len(hosts))
                  if [q for q, h in enumerate(hosts) if h == hosts[r]].index(r) == _world.local_rank]
    _world.cross_rank, _world.cross_size = same_local.index(me), len(same_local)
    counts = {h: hosts.count(h) for h in hosts}
    _world.homogeneous = len(set(counts.values())) == 1


def shutdown() -> None:
    """``hvd.shutdown()``: destroy the process group if ``init()`` made it (one the script made stays), and
    forget the process sets. ``init()`` may be called again afterwards."""
    if not _world.initialized:
        return
    for ps in list(_world.sets.values()):
        ps._invalidate()
    _world.sets.clear()
    if _world.made_group and dist.is_initialized():
        dist.destroy_process_group()
    _world.__init__()


def is_initialized() -> bool:
    return _world.initialized


def size() -> int:
    _need_init()
    return dist.get_world_size()


def rank() -> int:
    _need_init()
    return dist.get_rank()


def local_rank() -> int:
    _need_init()
    return _world.local_rank


def local_size() -> int:
    _need_init()
    return _world.local_size


def cross_rank() -> int:
    _need_init()
    return _world.cross_rank


def cross_size() -> int:
    _need_init()
    return _world.cross_size


def is_homogeneous() -> bool:
    """Whether every host runs the same number of ranks."""
    _need_init()
    return _world.homogeneous


def _backends() -> str:
    return str(dist.get_backend()) if dist.is_initialized() else ""


# what is built: torch.distributed's, answered truthfully (Horovod answers for its own build)
def mpi_built() -> bool:
    """Whether this torch has torch.distributed's MPI backend (osp.horovod itself never runs on it)."""
    return dist.is_available() and dist.is_mpi_available()


def gloo_built() -> bool:
    return dist.is_available() and dist.is_gloo_available()


def nccl_built() -> int:
    """NCCL's version code (as Horovod: e.g. 22105) where this torch has NCCL, else 0."""
    if not (dist.is_available() and dist.is_nccl_available() and torch.cuda.is_available()):
        return 0
    major, minor, patch = torch.cuda.nccl.version()
    return major * 10000 + minor * 100 + patch if (major, minor) >= (2, 9) else major * 1000 + minor * 100 + patch


def cuda_built() -> bool:
    return torch.backends.cuda.is_built() and torch.version.cuda is not None


def rocm_built() -> bool:
    return torch.version.hip is not None


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def mpi_enabled() -> bool:
    """False: the collectives run on torch.distributed, never on MPI (mpirun may still start the ranks)."""
    return False


def gloo_enabled() -> bool:
    return "gloo" in _backends()


def mpi_threads_supported() -> bool:
    _need_init()
    return False


def start_timeline(file_path, mark_cycles=False) -> None:
    raise NotImplementedError("osp.horovod: Horovod's timeline is not available on torch.distributed; "
                              "torch.profiler records the collectives (record_shapes=True names them)")


def stop_timeline() -> None:
    raise NotImplementedError("osp.horovod: Horovod's timeline is not available on torch.distributed; "
                              "use torch.profiler")
