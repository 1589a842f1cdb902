"""The interface every synchronization mode implements (DESIGN.md, "Where the code lives").

A mode is two classes in one module: its options (``osp.BSP(...)``, ``osp.OSP(...)``, ...), which a
user passes as ``sync=`` and which validate themselves, and its runtime (a ``Mode``), which the
options ``build`` for one ``DistributedOptimizer``. The optimizer owns the ``torch.optim`` surface,
the flat groups and the backward hooks, and calls its mode at four points:

- ``on_grad(p)``: a backward pass produced ``p``'s gradient (a mode may start averaging from here);
- ``step(compute_s)``: ``optimizer.step()``; returns the step's record for ``stats()``;
- ``flush()``: finish everything in flight and apply exact updates (replicas bitwise equal after);
- ``state_dict()`` / ``load_state_dict()``: the mode's own part of the checkpoint.

The mode knows only the ``Context`` it is handed, never the optimizer object.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Callable, List, Optional

import torch

from .. import ops, sidechannel
from ..comm import Comm
from ..layout import FlatGroup

_CHECK_BLOCK = 1 << 16  # elements per block of the non-finite scan (spreads it over threads and CUDA blocks)


@dataclass
class Context:
    """What a mode works with."""
    optimizer: torch.optim.Optimizer  # the wrapped optimizer (its param groups, state and step)
    groups: List[FlatGroup]
    comm: Comm
    timeout: float  # seconds a collective may take before the step raises TimeoutError
    passes_per_step: int  # backward passes accumulated locally before each step
    on_synced: Callable[[], None]  # call where replicas are bitwise equal (the public sync callback)
    skip_sync: bool = False  # inside DistributedOptimizer.skip_synchronize()

    @property
    def nblocks(self) -> int:
        return sum(fg.nblocks for fg in self.groups)

    @property
    def nbytes(self) -> int:
        return sum(fg.padded * fg.param.element_size() for fg in self.groups)

    @property
    def device(self) -> torch.device:
        return self.groups[0].device

    def nonfinite(self, grads: Optional[List[torch.Tensor]] = None) -> torch.Tensor:
        """How many of the flat gradients (or ``grads``) hold an inf or nan: a device tensor, no sync."""
        grads = [fg.grad for fg in self.groups] if grads is None else grads
        return sum(ops.score_blocks(g, _CHECK_BLOCK, "max")[1].sum() for g in grads)

    def any_nonfinite(self, grads: Optional[List[torch.Tensor]] = None) -> bool:
        """Whether they do, read on the host (one sync)."""
        return bool(sidechannel.read(self.nonfinite(grads).reshape(1))[0])


class Options(abc.ABC):
    """A mode's options: validated at construction, compared across ranks by ``repr``."""

    name: str = ""
    #: elements per block of the flat layout (``None``: the whole group is one block)
    block_size: Optional[int] = None

    @abc.abstractmethod
    def build(self, ctx: Context) -> "Mode":
        """The runtime of this mode for one optimizer."""


class Mode(abc.ABC):
    """A mode's runtime: what it keeps across steps, and the calls the optimizer makes."""

    def __init__(self, options: Options, ctx: Context):
        self.options, self.ctx = options, ctx

    def on_grad(self, p: torch.Tensor) -> None:
        """A backward pass produced ``p``'s gradient."""
        return None

    @abc.abstractmethod
    def step(self, compute_s: float) -> dict:
        """The synchronized update. ``compute_s``: seconds since the previous step returned. Returns the
        step's record: ``critical_fraction``, ``bytes_stage1``, ``bytes_stage2``, ``stage1_s``,
        ``stage2_wait_s``, and ``skipped`` when the step was skipped on every rank."""

    def flush(self) -> int:
        """Finish all in-flight work and apply exact updates; returns how many steps this found
        skipped on every rank (non-finite averages)."""
        return 0

    @property
    def in_flight(self) -> bool:
        """Whether collectives or corrections are pending (then gradients and state are not final)."""
        return False

    def synchronize(self) -> None:
        raise RuntimeError(f"osp: synchronize() is for BSP; with {type(self.options).__name__} the gradient "
                           "a step applies is only known inside step()")

    def ready_for_zero_grad(self) -> None:
        """Raise if zeroing the gradients now would corrupt work in flight."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None

    def after_load(self) -> None:
        """The wrapped optimizer's state was replaced (loaded or broadcast)."""
        return None

    def stats(self) -> dict:
        """Mode-specific figures for ``DistributedOptimizer.stats()``."""
        return {}


def check_int(owner: str, name: str, value, lo: int, hi: Optional[int] = None) -> int:
    """``value`` must be an int (not a bool) in [lo, hi]; a ValueError naming what was got otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ValueError(f"osp: {owner}({name}) must be {want}, got {value!r}")
    return value


def check_share(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"osp: {owner}({name}) must be a number in [0, 1], got {value!r}")
    return float(value)
