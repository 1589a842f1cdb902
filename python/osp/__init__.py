"""osp: two-stage synchronization (OSP) and friends for data-parallel PyTorch training."""
from . import ops

__version__ = "0.1.0"
__all__ = ["ops", "__version__"]
