"""Synchronization modes, one module each; ``base`` holds the interface they share."""
from .base import Context, Mode, Options
from .bsp import BSP
from .dsync import DSync
from .hsp import HSP
from .osp import OSP

__all__ = ["Context", "Mode", "Options", "BSP", "OSP", "DSync", "HSP"]
