"""osp: two-stage synchronization (OSP) and friends for data-parallel PyTorch training.

    import osp
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters(), sync=osp.OSP())
"""
from . import ops
from .broadcast import broadcast_buffers, broadcast_optimizer_state, broadcast_parameters, sync_buffers
from .compression import Compression
from .launcher import init_from_env
from .modes import BSP, HSP, OSP, DSync
from .optimizer import DistributedOptimizer

__version__ = "0.1.0"

__all__ = ["ops", "Compression", "BSP", "OSP", "DSync", "HSP", "DistributedOptimizer", "broadcast_parameters",
           "broadcast_optimizer_state", "broadcast_buffers", "sync_buffers", "init_from_env", "__version__"]


def __getattr__(name):
    # osp.elastic imports Horovod, osp.lightning imports Lightning: only when asked for; osp.plan and
    # osp.profile (a callable module: osp.profile(model, loss_fn, batch)) are tools, and osp.horovod (Horovod's
    # API on torch.distributed) a way out of Horovod, loaded on first use
    if name in ("elastic", "horovod", "lightning", "plan", "profile"):
        import importlib

        return importlib.import_module("." + name, __name__)
    raise AttributeError(f"module 'osp' has no attribute {name!r}")
