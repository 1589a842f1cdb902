"""The side channel: a few fp32 numbers every OSP step sums across ranks next to stage 1.

Fields: how many flat gradients hold an inf or nan on some rank (the step is then skipped on every
rank), the ``auto`` budget's measurements (bandwidth in MB/s; the backward window stage 1 overlaps and
the previous iteration, in ms), two checksums of the critical-block mask each rank chose, whether
parameters were edited while a correction was pending, and whether gradients were changed after
backward packed them (``stale``). The buffer is its own
fp32 tensor on the parameters' device, whatever their dtype: measurements summed across ranks in
fp16 would overflow. Encoding launches only small fills and copies on the device (no host sync);
decoding reads the summed buffer once (the step's one sync) and raises if the ranks chose
different blocks, which would otherwise corrupt training silently (e.g. GPUs of different
generations contracting FMAs differently when scoring).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

import torch

FIELDS = ("nonfinite", "bandwidth_mbps", "mask_sum1", "mask_sum2", "edited", "stale", "backward_ms",
          "iteration_ms")
# then one field per parameter: 1 where this rank has a gradient for it (summed: present on some rank)
# Checksums are weighted sums of the mask modulo small primes: integers below 2^11, so their sum over
# up to 2^13 ranks is exact in fp32. A sum, not an average: exact, and Horovod never fuses it with the
# averaged stage-1 buffers (fusion would move their reduction boundaries from run to run).
_PRIMES = (2039, 2029)


@dataclass
class Side:
    """The decoded side channel, measurements averaged over ranks (identical on every rank)."""
    nonfinite: bool
    bandwidth: float  # bytes/s
    edited: bool  # some rank's parameters were changed between steps where a correction was pending
    stale: bool  # some rank's gradients were changed after backward packed them
    backward: float  # s: from the first gradient ready to the end of backward
    iteration: float  # s: the previous step's whole iteration (compute and step)
    presence: List[float]  # per parameter: how many ranks have a gradient for it


class MaskChecksum:
    """Two checksums of a block mask, computed on its device without a sync."""

    def __init__(self, nblocks: int, device: torch.device):
        g = torch.Generator().manual_seed(0x05F)
        self.weights = [torch.randint(1, p, (nblocks,), generator=g, dtype=torch.int64).to(device)
                        for p in _PRIMES]

    def __call__(self, mask: torch.Tensor) -> List[torch.Tensor]:
        m = mask.to(torch.int64)
        return [torch.remainder((m * w).sum(), p) for w, p in zip(self.weights, _PRIMES)]


def encode(out: torch.Tensor, nonfinite: torch.Tensor, checksums: Sequence[torch.Tensor], *, bandwidth=0.0,
           edited=0.0, stale=0.0, backward=0.0, iteration=0.0) -> torch.Tensor:
    """Fill ``out`` (fp32, ``len(FIELDS)`` + one per parameter, on the parameters' device) for this
    rank (times in seconds, bandwidth in bytes/s; a value may be a device tensor); the presence fields
    are the caller's."""
    values = {"nonfinite": nonfinite, "bandwidth_mbps": bandwidth / 1e6,
              "mask_sum1": checksums[0], "mask_sum2": checksums[1],
              "edited": edited, "stale": stale, "backward_ms": backward * 1e3, "iteration_ms": iteration * 1e3}
    for i, name in enumerate(FIELDS):
        v = values[name]
        if torch.is_tensor(v):
            out[i].copy_(v.reshape(()))
        else:
            out[i].fill_(float(v))
    return out


def read(t: torch.Tensor) -> List[float]:
    """The host values of a small device tensor (the one sync). Meta tensors carry no values (a
    shape-only run, e.g. to check a model's plumbing): they read as zeros."""
    if t.device.type == "meta":
        return [0.0] * t.numel()
    return t.tolist()


def decode(total: torch.Tensor, own: torch.Tensor, size: int, step: int) -> Side:
    """Decode the buffer summed over ranks, ``total``; ``own`` is this rank's buffer before the sum
    (a copy). Raises ``RuntimeError`` on every rank when the ranks chose different critical blocks."""
    t, o = read(total), read(own)
    for i in (FIELDS.index("mask_sum1"), FIELDS.index("mask_sum2")):
        if round(t[i]) != round(o[i]) * size:
            raise RuntimeError(
                f"osp: ranks chose different critical blocks at step {step} (mask checksum {o[i]:.0f} on this "
                f"rank, {t[i] / size:.3f} on average over {size} ranks); continuing would make the replicas diverge. "
                "The block scores must be bitwise equal on every rank: check that all ranks run the same "
                "osp, torch and hardware kind")
    n = len(FIELDS)
    f = dict(zip(FIELDS, t))
    return Side(nonfinite=f["nonfinite"] > 0, bandwidth=f["bandwidth_mbps"] / size * 1e6,
                edited=f["edited"] > 0,
                stale=f["stale"] > 0, backward=f["backward_ms"] / size * 1e-3,
                iteration=f["iteration_ms"] / size * 1e-3, presence=t[n:])
