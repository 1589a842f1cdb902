"""``import osp.horovod as hvd``: the part of ``horovod.torch`` that training scripts use, on torch.distributed, with no
Horovod installed. Launch with torchrun (or mpirun)::

    import osp.horovod as hvd          # was: import horovod.torch as hvd
    hvd.init()
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())   # BSP, as Horovod's
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

    torchrun --nproc-per-node 4 train.py          # was: horovodrun -np 4 python train.py

``DistributedOptimizer`` is osp's, in every mode (``sync=osp.OSP()`` for the two-stage sync; BSP by default, so that
the one-line swap trains as Horovod did). What does not carry over, and why, is in each function's docstring and in
docs/horovod.md ("Leaving Horovod"): collectives are matched by their order on every rank, not by name; no Adasum,
timeline, reducescatter or MPI communicators; Elastic runs as torchrun restarts from the last commit
(``osp.horovod.elastic``).
"""
from __future__ import annotations

from ..compression import Compression
from . import elastic
from .basics import (
    Adasum,
    Average,
    CollectiveMismatchError,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    add_process_set,
    ccl_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
from .functions import (
    DistributedOptimizer,
    allgather_object,
    broadcast_object,
    broadcast_optimizer_state,
    broadcast_parameters,
    join,
)
from .ops import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    poll,
    reducescatter,
    reducescatter_async,
    sparse_allreduce_async,
    synchronize,
)

try:  # torch's: synchronizes batch statistics over the default group (CUDA tensors), as Horovod's
    from torch.nn import SyncBatchNorm
except ImportError:  # pragma: no cover
    SyncBatchNorm = None

__all__ = [
    "init", "shutdown", "is_initialized", "rank", "size", "local_rank", "local_size", "cross_rank", "cross_size",
    "is_homogeneous", "mpi_built", "gloo_built", "nccl_built", "cuda_built", "rocm_built", "ddl_built", "ccl_built",
    "mpi_enabled", "gloo_enabled", "mpi_threads_supported", "start_timeline", "stop_timeline",
    "ProcessSet", "global_process_set", "add_process_set", "remove_process_set",
    "Average", "Sum", "Adasum", "Min", "Max", "Product", "ReduceOp", "HorovodInternalError",
    "HostsUpdatedInterrupt", "Compression", "DistributedOptimizer", "SyncBatchNorm",
    "broadcast_parameters", "broadcast_optimizer_state", "broadcast_object", "allgather_object", "join",
    "allreduce", "allreduce_", "allreduce_async", "allreduce_async_", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "allgather", "allgather_async", "grouped_allgather",
    "grouped_allgather_async", "broadcast", "broadcast_", "broadcast_async", "broadcast_async_", "alltoall",
    "alltoall_async", "reducescatter", "reducescatter_async", "grouped_reducescatter", "grouped_reducescatter_async",
    "sparse_allreduce_async", "CollectiveMismatchError", "barrier", "poll", "synchronize", "elastic",
]
