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
        store = _restart_store(env, kw.get("timeout", dist.constants.default_pg_timeout))
        if store is not None:
            kw.update(store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
        dist.init_process_group(pg, **kw)
        return TorchComm()
    raise ValueError(f"osp: unknown backend {backend!r}: expected 'horovod' or 'torch'")


def _restart_store(env, timeout):
    """The store for a worker that torchrun may restart (``--max-restarts``), or None for the default.

    Why: torchrun (torch >= 2.4) keeps one TCPStore for every rendezvous round, and the process group's
    keys are the same in every round. A restarted worker can read the address that a worker of the
    previous round (now dead) left there, and Gloo then retries connecting to it until it gives up, or
    hangs: seen here in 3 of 6 restarts. So each restart gets keys of its own: a prefix with
    TORCHELASTIC_RESTART_COUNT, which all workers of one torchrun agent share. Workers of several agents
    (several nodes) may count restarts differently: there the fix is torchrun's own option, the
    environment variable TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (a new store every round)."""
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or env.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
            or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) == 0):
        return None
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1:
        raise RuntimeError(
            "osp: torchrun --max-restarts on several nodes shares one rendezvous store between rounds, where a "
            "restarted worker can find the address of a dead one and hang in init_process_group; set "
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in torchrun's environment (on every node)")
    import torch.distributed as dist

    store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]), is_master=False,
                          timeout=timeout)
    return dist.PrefixStore(f"osp/restart{env.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
