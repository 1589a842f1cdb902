"""Fewer bytes on the wire: gradients cast to float16 or bfloat16 for their collectives, as Horovod's
``compression=hvd.Compression.fp16`` and DDP's ``fp16_compress_hook`` do.

A compressed average is: divide by the number of ranks, cast to the wire's dtype, sum, cast back
(``osp.comm.Comm``, ``wire=``). Dividing first keeps the sum within the range of the ranks' own values:
an fp16 sum of fp16 gradients overflows where their average would not. Every rank receives the same
bits, so replicas stay bitwise equal (I1), and the update is computed from the decompressed average, as
a replay of the same compressed averaging gives it (I3, to float tolerance). A step whose decompressed
average is not finite is skipped on every rank alike (each mode's non-finite check), and under OSP a
rank whose deferred gradient would not fit float16's range says so in the side channel, so that the step is
skipped before stage 2 starts.

``compression=`` on ``osp.DistributedOptimizer`` takes ``osp.Compression.none / fp16 / bf16`` or Horovod's
``hvd.Compression.none / fp16`` (the class, as Horovod's examples pass it, or an instance). OSP can send its
two stages differently: ``osp.OSP(stage2_compression=osp.Compression.fp16)`` sends the deferred blocks, the
less important ones, in fp16 while the critical blocks keep the optimizer's ``compression``.
"""
from __future__ import annotations

from typing import Optional

import torch


class Compressor:
    """A wire format: ``dtype`` the gradients travel in (None: their own)."""

    __slots__ = ("name", "dtype")

    def __init__(self, name: str, dtype: Optional[torch.dtype]):
        self.name, self.dtype = name, dtype

    def __repr__(self):
        return f"osp.Compression.{self.name}"

    def __reduce__(self):  # pickled (a mode's options travel between ranks) as the one instance
        return (resolve, (self.name,))

    def compress(self, tensor: torch.Tensor):
        """Horovod's ``Compressor.compress``: ``(tensor on the wire, what decompress needs)`` (a floating-point
        tensor cast to ``dtype``; others as they are)."""
        if self.dtype is None or not tensor.is_floating_point():
            return tensor, None
        return tensor.to(self.dtype), tensor.dtype

    def decompress(self, tensor: torch.Tensor, ctx):
        """Horovod's ``Compressor.decompress``: back to the dtype ``compress`` was given."""
        return tensor if ctx is None else tensor.to(ctx)


class Compression:
    """Horovod's ``hvd.Compression`` for osp: ``none``, ``fp16`` and ``bf16``."""

    none = Compressor("none", None)
    fp16 = Compressor("fp16", torch.float16)
    bf16 = Compressor("bf16", torch.bfloat16)


_BY_NAME = {c.name: c for c in (Compression.none, Compression.fp16, Compression.bf16)}
_HOROVOD = {"NoneCompressor": Compression.none, "FP16Compressor": Compression.fp16}


def resolve(compression) -> Compressor:
    """``compression`` as one of ``Compression``'s: None, a ``Compressor``, its name, or Horovod's
    ``Compression.none`` / ``Compression.fp16`` (class or instance). Anything else raises ``ValueError``."""
    if compression is None:
        return Compression.none
    if isinstance(compression, Compressor):
        return compression
    if isinstance(compression, str) and compression in _BY_NAME:
        return _BY_NAME[compression]
    cls = compression if isinstance(compression, type) else type(compression)
    if cls.__module__.startswith("horovod.") and cls.__name__ in _HOROVOD:
        return _HOROVOD[cls.__name__]
    raise ValueError(
        f"osp: compression={getattr(cls, '__qualname__', compression)!r} is not one osp knows: expected "
        "osp.Compression.none, .fp16 or .bf16, 'none', 'fp16', 'bf16', or Horovod's hvd.Compression.none / "
        "hvd.Compression.fp16")


def wire_dtype(compression: Compressor, param_dtype: torch.dtype) -> Optional[torch.dtype]:
    """The dtype gradients of ``param_dtype`` travel in: the compressor's where it is narrower (fp16 and
    bf16 gradients travel as they are), else None."""
    if compression.dtype is None or not param_dtype.is_floating_point:
        return None
    if torch.finfo(param_dtype).bits <= torch.finfo(compression.dtype).bits:
        return None
    return compression.dtype


def fits(grad: torch.Tensor, wire: Optional[torch.dtype]) -> torch.Tensor:
    """A device bool: whether ``grad`` is within ``wire``'s range (its average, divided before the cast,
    then sums within it too). True where nothing is cast or the range is float32's (bfloat16)."""
    if wire is None or torch.finfo(wire).max >= torch.finfo(torch.float32).max or not grad.numel():
        return torch.ones((), dtype=torch.bool, device=grad.device)
    # a margin for the rounding of the cast and of the sum's partial results
    return grad.abs().max() <= torch.finfo(wire).max * (1 - 2 ** -8)
