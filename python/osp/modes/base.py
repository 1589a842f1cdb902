"""The interface every synchronization mode implements (docs/design.md, "Where the code lives").

A mode is two classes in one module: its options (``osp.BSP(...)``, ``osp.OSP(...)``, ...), which a
user passes as ``sync=`` and which validate themselves, and its runtime (a ``Mode``), which the
options ``build`` for one ``DistributedOptimizer``. The optimizer owns the ``torch.optim`` surface,
the flat groups and the backward hooks, and calls its mode at four points:

- ``on_ready(p)``: ``p``'s gradient had its last backward pass of the step (a mode may start
  averaging from here); ``end_backward()``: the step's last backward pass ended; ``restart()``: the
  gradients were zeroed or replaced since, so the step's accumulation starts again;
- ``step(inp)``: ``optimizer.step()``; returns the step's record for ``stats()``;
- ``flush()``: finish everything in flight and apply exact updates (replicas bitwise equal after);
- ``state_dict()`` / ``load_state_dict()``: the mode's own part of the checkpoint; ``load_state_dict``
  also follows every replacement of the wrapped optimizer's state (a load, a broadcast, a new world);
- ``stats()``: the mode's own figures.

and reads three attributes: ``grad_is_average`` (``.grad`` is the average after backward, as with DDP;
then the mode also offers ``synchronize()``), ``in_flight`` and ``accepts_closure``. That is the whole
interface, as small as a DDP communication hook's or torchft's LocalSGD's: the mode knows only the
``Context`` it is handed, never the optimizer object.
"""
from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from .. import agreement, ops
from ..arrivals import Arrivals
from ..comm import Comm
from ..compression import Compression, Compressor, wire_dtype
from ..layout import FlatGroup
from ..warn import warn

_CHECK_BLOCK = 1 << 16  # elements per block of the non-finite scan (spreads it over threads and CUDA blocks)


@dataclass(frozen=True)
class Clip:
    """A clipping request for the coming step (``opt.clip_grad_norm_`` / ``opt.clip_grad_value_``): the
    averaged gradient clipped by its 2-norm (``kind="norm"``, ``value`` = max_norm) or every element into
    ``[-value, value]`` (``kind="value"``), as torch.nn.utils' functions clip DDP's averaged ``.grad``."""
    kind: str  # "norm" or "value"
    value: float


@dataclass
class StepInput:
    """What one ``step()`` is asked to do besides the update."""
    compute_s: float  # seconds since the previous step returned
    #: GradScaler: multiply this rank's gradients by this first (a float64 device scalar: no host sync)
    unscale: Optional[torch.Tensor] = None
    #: GradScaler: the loss scale the backward ran under (a float64 device scalar)
    backward_scale: Optional[torch.Tensor] = None
    clip: Optional[Clip] = None  # clip the averaged gradient (clip_grad_norm_ / clip_grad_value_)
    passes: int = 1  # backward passes of the step before step() (backward_passes_per_step)
    #: the gradients were changed in place after backward in a way their version counters do not show
    #: (a GradScaler's ``unscale_``, whose kernel leaves them alone)
    grads_changed: bool = False
    #: parameters whose ``.grad`` was changed in place or replaced between backward and ``step()``
    edited: List[str] = field(default_factory=list)
    #: a GradScaler's ``(grad_scale, found_inf)`` for a wrapped optimizer that unscales itself (``fused``),
    #: where ``.grad`` is the average (BSP)
    amp: Optional[tuple] = None
    #: where this rank's own gradient moves the parameters provisionally (OSP's deferred blocks, DSync's
    #: local update), multiply it by this first: under HSP, what makes it this rank's own mean
    provisional: float = 1.0
    #: ``step(closure)`` (modes with ``accepts_closure``): the user's extra micro-batch
    closure: Optional[Callable[[], object]] = None

@dataclass
class Context:
    """What a mode works with."""
    optimizer: torch.optim.Optimizer  # the wrapped optimizer (its param groups, state and step)
    groups: List[FlatGroup]
    comm: Comm
    timeout: float  # seconds a collective may take before the step raises TimeoutError
    on_synced: Callable[[], None]  # call where replicas are bitwise equal (the public sync callback)
    prefix: str = "osp"  # names of this optimizer's collectives (unique per optimizer in a process)
    #: (flat group, parameter) of every parameter in the model's order (``named_parameters``)
    order: List[Tuple[int, int]] = field(default_factory=list)
    #: a context manager an extra micro-batch runs in (``Accumulation.extra``): its backward passes add
    #: to the step beyond ``backward_passes_per_step``; it yields a callable counting them
    extra_passes: Optional[Callable] = None
    #: the factor the average gets after its allreduce (``gradient_predivide_factor``; modes with
    #: ``grad_is_average`` only, the others are built with 1.0)
    postscale: float = 1.0
    #: this rank has joined (``DistributedOptimizer.join()``): its steps shadow the others' with no gradient
    joined: bool = False
    #: how many ranks had joined, as the last per-step record read said (``agreement.Agreement``)
    joined_ranks: int = 0
    #: during ``join()``: how many steps before the step that read it the first record counting every rank
    #: as joined was posted (None: none read yet). Every rank leaves ``join()`` ``Mode.record_lag`` steps
    #: after that record's step, whatever step read it here
    joined_age: Optional[int] = None
    #: what the gradients travel as (``osp.compression``; the per-step records always go as float32)
    compression: Compressor = Compression.none
    #: when this rank's previous step returned (``time.perf_counter()``; None before the first): the
    #: per-step records' arrival times count from here
    t_end: Optional[float] = None
    #: every rank's arrivals, from the per-step records (``osp.arrivals``; None: not kept)
    arrivals: Optional[Arrivals] = None

    def wire(self, fg) -> Optional[torch.dtype]:
        """The dtype flat group ``fg``'s gradient travels in, where it is not its own (None)."""
        return wire_dtype(self.compression, fg.dtype)

    @property
    def nparams(self) -> int:
        return sum(len(fg.params) for fg in self.groups)

    def scale_grads(self, factor, grads: Optional[List[torch.Tensor]] = None) -> None:
        """Multiply the flat gradients (or ``grads``) by ``factor``: a number, or a device scalar (no host
        sync), which multiplies in the gradients' compute precision as a number does (rounded to float32
        once, not to a float16 or bfloat16 gradient's dtype first)."""
        grads = [fg.grad for fg in self.groups] if grads is None else grads
        if factor is None or not grads:
            return
        if torch.is_tensor(factor):
            torch._foreach_mul_(grads, factor.to(device=grads[0].device, dtype=torch.float32))
        elif factor != 1.0:
            for g in grads:
                g.mul_(factor)

    def clip_(self, clip: "Clip", grads: Optional[List[torch.Tensor]] = None,
              absent: Optional[List[set]] = None) -> None:
        """Clip the flat gradients ``grads`` (one per flat group; default: the groups' own) as ``clip`` says.
        By value: every element into ``[-value, value]`` (``torch.nn.utils.clip_grad_value_``; padding and
        absent parameters hold zeros). By norm: exactly as ``torch.nn.utils.clip_grad_norm_(model.parameters(),
        ...)`` clips the parameters' gradients: per parameter a norm in the gradient's dtype, in the model's
        order, the norm of those, the factor ``max_norm / (norm + 1e-6)`` at most 1 (bitwise its arithmetic;
        the padding and the parameters in ``absent``, without a gradient, are not counted)."""
        grads = [fg.grad for fg in self.groups] if grads is None else grads
        if clip.kind == "value":
            for g in grads:
                g.clamp_(min=-clip.value, max=clip.value)
            return
        max_norm = clip.value
        absent = [set()] * len(grads) if absent is None else absent
        order = self.order or [(k, i) for k, fg in enumerate(self.groups) for i in range(len(fg.params))]
        views = [self.groups[k].view(grads[k], i) for k, i in order if i not in absent[k]]
        if not views:
            return
        total = torch.nn.utils.get_total_norm(views, 2.0)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))

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
        return bool(agreement.read(self.nonfinite(grads).reshape(1))[0])


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

    #: after the step's last backward, ``.grad`` holds the average on every rank (as with DDP), so
    #: gradient clipping and GradScaler work on it as usual; otherwise it holds this rank's own gradient
    #: and the mode unscales and clips inside ``step()``
    grad_is_average = False
    #: the mode may leave ``grad_is_average`` in a later step by itself (OSP ``auto`` on BSP's code): what needs
    #: ``.grad`` to stay the average between backward and ``step()`` (Horovod's ``synchronize()``) is refused
    #: from the start, not from whenever the mode decides
    may_defer = False
    #: ``step(closure)`` hands the mode ``StepInput.closure`` (HSP); other modes refuse a closure
    accepts_closure = False
    #: parameters the step's last backward pass will not reach are ready when it begins
    #: (``Accumulation``), so they hold back no bucket. For a mode where a later pass that reaches one
    #: is refused (BSP: the average is done) or handled (OSP packs a changed bucket again); DSync's
    #: buckets wait for the end of the step's backward (its average lands steps later: an early start
    #: buys little), HSP has none.
    ready_unreached_early = False
    #: the most steps after its own step that a per-step record (with the joined count) is read, the same
    #: on every rank: 0 where a step reads its own record (BSP, OSP, HSP with BSP); DSync's delay
    #: (``max_delay`` with ``"auto"``, where each rank reads at its own delay)
    record_lag = 0

    def on_ready(self, p: torch.Tensor) -> None:
        """``p``'s gradient had its last backward pass of the step."""
        return None

    def end_backward(self) -> None:
        """The step's last backward pass ended."""
        return None

    def restart(self) -> None:
        """The gradients were zeroed or replaced after a backward: drop what this step's backward
        passes started (every rank does the same)."""
        return None

    @abc.abstractmethod
    def step(self, inp: StepInput) -> dict:
        """The synchronized update. Returns the step's record: ``critical_fraction``,
        ``bytes_stage1``, ``bytes_stage2``, ``stage1_s``, ``stage2_wait_s``, ``skipped`` when the step
        was skipped on every rank, and ``overflow`` for a GradScaler: whether to count an overflow
        (identical on every rank)."""

    def flush(self) -> int:
        """Finish all in-flight work and apply exact updates; returns how many steps this found
        skipped on every rank (non-finite averages)."""
        return 0

    @property
    def in_flight(self) -> bool:
        """Whether collectives or corrections are pending (then gradients and state are not final)."""
        return False

    #: the step calls ``ctx.on_synced()`` itself where replicas are exact before it applies anything (HSP: once
    #: every rank is ready), so nothing at the step's start must wait for the other ranks
    synced_in_step: bool = False

    @property
    def exact(self) -> bool:
        """Whether the parameters and optimizer state are exact now, between steps (no provisional update
        waits for its correction): then they are bitwise equal on every rank (``osp.replicas`` checks here)."""
        return not self.in_flight

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """The wrapped optimizer's state was replaced (loaded or broadcast; take it over), and ``state``
        is the mode's own part of the checkpoint (``{}`` with a plain optimizer state dict)."""
        return None

    #: what the slow-rank warning (``osp.arrivals``) advises under this mode
    straggler_advice = "osp.HSP(max_extra=...) has the other ranks compute extra micro-batches meanwhile"

    def stats(self) -> dict:
        """Mode-specific figures for ``DistributedOptimizer.stats()``."""
        return {}


def warn_grad_edits(mode: Mode, edited: List[str]) -> None:
    """Where ``.grad`` is this rank's own gradient at ``step()`` and the mode takes it from there (OSP,
    HSP), a change between backward and ``step()`` (``StepInput.edited``) acts on each rank's gradient
    alone: said once per mode."""
    if not edited or getattr(mode, "_warned_edits", False):
        return
    mode._warned_edits = True
    warn(
        f"osp: the gradients of {len(edited)} parameter(s) (e.g. {edited[0]!r}) were changed in "
        f"place between backward() and step(), e.g. by torch.nn.utils.clip_grad_norm_. Under "
        f"{mode.options.name.upper()} .grad holds each rank's own gradient at that point, not the "
        "average, so such a change acts on every rank's gradient separately (e.g. clips each by its "
        "own norm). To clip by the norm of the averaged gradient, as under DDP, call "
        "opt.clip_grad_norm_(max_norm) instead. This warning is shown once.")


def edited_error(mode: str) -> RuntimeError:
    """Parameters were changed between steps while ``mode``'s exact updates were pending: by the user's code
    between steps, or inside the forward (``nn.Embedding(max_norm=...)``), where no flush() can run."""
    return RuntimeError(
        "osp: parameters were changed between steps (in place, e.g. a weight clamp, a projection or "
        f"model.load_state_dict, or inside the forward) while {mode}'s exact updates of earlier steps were "
        "pending; they would overwrite the change. Between steps: call opt.flush() on every rank before "
        "changing parameters (then the change is kept exactly), or use osp.BSP(). Inside the forward, where "
        "flush() cannot run: an in-forward in-place edit (nn.Embedding(max_norm=...) renormalizes the rows it "
        "looks up, in place, in every forward) acts on provisional weights and cannot be corrected exactly "
        "under osp.OSP() or osp.DSync(). Use osp.BSP() or osp.HSP() (there, as under DDP, each rank renormalizes "
        "the rows its own batch looks up), or drop max_norm and renormalize after opt.flush() (or at BSP steps), "
        "the same rows on every rank: with torch.no_grad(): torch.embedding_renorm_(emb.weight, ids, max_norm, "
        "2.0)")


def check_int(owner: str, name: str, value, lo: int, hi: Optional[int] = None) -> int:
    """``value`` must be an int (not a bool) in [lo, hi]; a ValueError naming what was got otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        want = f"an integer >= {lo}" if hi is None else f"an integer in [{lo}, {hi}]"
        raise ValueError(f"osp: {owner}({name}) must be {want}, got {value!r}")
    return value


def check_positive(owner: str, name: str, value) -> float:
    """``value`` must be a positive number (not a bool); a ValueError naming what was got otherwise."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and value > 0):
        raise ValueError(f"osp: {owner}({name}) must be a positive number, got {value!r}")
    return float(value)


def check_share(owner: str, name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
        raise ValueError(f"osp: {owner}({name}) must be a number in [0, 1], got {value!r}")
    return float(value)
