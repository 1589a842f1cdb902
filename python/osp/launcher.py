"""Launcher glue: start an engine from the environment horovodrun, mpirun or torchrun set up."""
from __future__ import annotations

import datetime
import os
from typing import Optional

import torch

from .comm import Comm, HorovodComm, TorchComm


def init_from_env(backend: str, timeout_s: Optional[float] = None, device="cpu") -> Comm:
    """Start the engine of ``backend`` from the launcher's environment and return its Comm.

    ``device`` is where the model lives: ``"cpu"`` (default) or ``"cuda"``. With ``"cuda"`` each rank
    takes the GPU of its local rank (``torch.cuda.set_device``). ``horovod``: ``hvd.init()``
    (horovodrun or mpirun). ``torch``: a Gloo process group for CPU models, NCCL for CUDA ones, from
    torchrun's variables, or from Open MPI's (``OMPI_COMM_WORLD_*``) when started by ``mpirun``, with
    ``MASTER_ADDR``/``MASTER_PORT`` from the environment.
    """
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"osp: init_from_env(device) must be 'cpu' or 'cuda', got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("osp: init_from_env(device='cuda') but torch sees no CUDA device")
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.init()
        if dev.type == "cuda":
            torch.cuda.set_device(hvd.local_rank())
        return HorovodComm()
    if backend == "torch":
        import torch.distributed as dist

        env = os.environ
        if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env:
            env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
            env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
            env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        env.setdefault("MASTER_ADDR", "127.0.0.1")
        env.setdefault("MASTER_PORT", "29500")
        # the engine follows the model, not the machine: a CPU model on a GPU host still needs Gloo
        pg = "gloo"
        if dev.type == "cuda":
            torch.cuda.set_device(int(env.get("LOCAL_RANK", "0")))
            pg = "nccl"
        kw = {}
        if timeout_s is not None:
            kw["timeout"] = datetime.timedelta(seconds=timeout_s)
        dist.init_process_group(pg, **kw)
        return TorchComm()
    raise ValueError(f"osp: unknown backend {backend!r}: expected 'horovod' or 'torch'")
