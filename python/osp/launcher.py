"""Launcher glue: start an engine from the environment horovodrun, mpirun or torchrun set up."""
from __future__ import annotations

import datetime
import os
from typing import Mapping, Optional, Tuple

import torch

from .comm import Comm, HorovodComm, TorchComm

# the rank an MPI launcher gives each process: Open MPI (OMPI_COMM_WORLD_RANK, and PMIX_RANK from its PMIx), MPICH
# and Intel MPI (PMI_RANK), MVAPICH (MV2_COMM_WORLD_RANK)
MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def detect_backend(env: Optional[Mapping[str, str]] = None) -> Tuple[str, str]:
    """Which engine the launcher that started this process means, and why: ``("horovod" | "torch" | "single",
    reason)``.

    - ``horovodrun --gloo`` sets ``HOROVOD_RANK``: horovod.
    - torchrun (or a prepared ``env://``) sets ``RANK``: torch.
    - Under MPI (``horovodrun`` without ``--gloo`` runs ``mpirun``, which sets no ``HOROVOD_*`` variable; plain
      ``mpirun``): horovod where horovodrun launched it (its Open MPI settings ``pml ob1``, ``btl ^openib`` reach
      the ranks as ``OMPI_MCA_pml`` / ``OMPI_MCA_btl``); torch where ``MASTER_ADDR`` is set (an address for
      torch.distributed's rendezvous, as ``mpirun -x MASTER_ADDR`` passes it); else horovod if it was built with
      MPI (MPI itself then brings the ranks together), else torch.
    - Nothing of these: one process (``single``)."""
    env = os.environ if env is None else env
    if "HOROVOD_RANK" in env or "HOROVOD_HOSTNAME" in env:
        return "horovod", "horovodrun (Gloo) set HOROVOD_RANK"
    if "RANK" in env:
        return "torch", "RANK is set (torchrun)"
    mpi = next((k for k in MPI_RANK_VARS if k in env), None)
    if mpi is None:
        return "single", "no launcher: one process"
    if env.get("OMPI_MCA_pml") == "ob1" and env.get("OMPI_MCA_btl") == "^openib":
        return "horovod", f"horovodrun over MPI ({mpi} and horovodrun's Open MPI settings are set)"
    if "MASTER_ADDR" in env:
        return "torch", f"mpirun ({mpi} is set) with MASTER_ADDR for torch.distributed"
    if _horovod_mpi_built():
        return "horovod", f"mpirun ({mpi} is set), no MASTER_ADDR for torch.distributed: Horovod over MPI"
    return "torch", f"mpirun ({mpi} is set); this Horovod has no MPI, so torch.distributed"


# how many ranks a launcher started: torchrun (and a prepared env://), horovodrun --gloo, Open MPI, MPICH / Intel MPI,
# MVAPICH
LAUNCHED_SIZE_VARS = ("WORLD_SIZE", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "MV2_COMM_WORLD_SIZE")


def launched_size(env: Optional[Mapping[str, str]] = None) -> Tuple[int, str]:
    """How many ranks the launcher that started this process started, and the variable that says so: ``(1, "")``
    without a launcher (or under Horovod Elastic, whose worlds change as hosts come and go)."""
    env = os.environ if env is None else env
    if env.get("HOROVOD_ELASTIC") == "1":
        return 1, ""
    for var in LAUNCHED_SIZE_VARS:
        if env.get(var, "").isdigit():
            return int(env[var]), var
    return 1, ""


def check_launched(comm: Comm, env: Optional[Mapping[str, str]] = None) -> None:
    """A launcher started N > 1 ranks and the engine came up with one (``torchrun ... --backend horovod``: each
    ``hvd.init()`` alone; a process group initialized with ``world_size=1``): every process would train alone and
    exit 0, a job split silently. Raised, naming both. (Only a world of one is refused: a smaller engine world can
    be meant, as ``hvd.init(comm=[...])`` on some of ``mpirun``'s ranks.)"""
    n, var = launched_size(env)
    if n <= 1 or comm.name not in ("horovod", "torch") or not comm.active():
        return
    if comm.world_size() == 1:
        raise RuntimeError(
            f"osp: the launcher started {n} ranks ({var}={n}) but the {comm.name} engine came up with 1: every "
            f"process would train alone. Start the engine the launcher is for (torchrun: backend='torch' / "
            f"init_process_group(); horovodrun or mpirun: backend='horovod' / hvd.init())")


def _horovod_mpi_built() -> bool:
    try:
        import horovod.torch as hvd

        return bool(hvd.mpi_built())
    except Exception:  # noqa: BLE001 - not installed, or broken: then not Horovod
        return False


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
        comm = HorovodComm()
        check_launched(comm)
        return comm
    if backend == "torch":
        pg = "gloo"  # the engine follows the model, not the machine: a CPU model on a GPU host still needs Gloo
        if dev.type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK",
                                                                                   "0"))))
            pg = "nccl"
        init_process_group(pg, timeout_s)
        comm = TorchComm()
        check_launched(comm)
        return comm
    raise ValueError(f"osp: unknown backend {backend!r}: expected 'horovod' or 'torch'")


def init_process_group(pg: str, timeout_s: Optional[float] = None) -> None:
    """``torch.distributed.init_process_group(pg)`` from the launcher's environment: torchrun's variables, or an
    MPI launcher's (Open MPI's ``OMPI_COMM_WORLD_*``, MPICH's ``PMI_*``) copied into torchrun's names, with
    ``MASTER_ADDR`` / ``MASTER_PORT`` defaulting to 127.0.0.1:29500; under ``torchrun --max-restarts``, a
    rendezvous store of each restart's own (``_restart_store``)."""
    import torch.distributed as dist

    env = os.environ
    if "RANK" not in env and "OMPI_COMM_WORLD_RANK" in env:
        env["RANK"] = env["OMPI_COMM_WORLD_RANK"]
        env["WORLD_SIZE"] = env["OMPI_COMM_WORLD_SIZE"]
        env["LOCAL_RANK"] = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
        if "OMPI_COMM_WORLD_LOCAL_SIZE" in env:
            env.setdefault("LOCAL_WORLD_SIZE", env["OMPI_COMM_WORLD_LOCAL_SIZE"])
    elif "RANK" not in env and "PMI_RANK" in env and "PMI_SIZE" in env:  # MPICH, Intel MPI
        env["RANK"], env["WORLD_SIZE"] = env["PMI_RANK"], env["PMI_SIZE"]
        env["LOCAL_RANK"] = env.get("MPI_LOCALRANKID", "0")
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", "29500")
    kw = {}
    if timeout_s is not None:
        kw["timeout"] = datetime.timedelta(seconds=timeout_s)
    store = _restart_store(env, kw.get("timeout", dist.constants.default_pg_timeout))
    if store is not None:
        kw.update(store=store, rank=int(env["RANK"]), world_size=int(env["WORLD_SIZE"]))
    dist.init_process_group(pg, **kw)


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
