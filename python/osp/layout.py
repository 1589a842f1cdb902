"""Flat buffers and block geometry.

The parameters of one param group, dtype and device live in one flat buffer (parameters become views
into it, as DDP's gradient_as_bucket_view and FSDP's flat parameters do); gradients likewise. The
buffer is padded with zeros to a whole number of blocks, so every block is full: a packed buffer of k
blocks holds k * block_size elements, which the caller knows without asking the device.
"""
from __future__ import annotations

from typing import Dict, List, Optional

import torch


class FlatGroup:
    """Flat storage and block geometry for ``params`` (same dtype and device, one param group)."""

    def __init__(self, params: List[torch.nn.Parameter], names: List[str], group_index: int,
                 block_size: Optional[int]):
        """``block_size=None``: the whole group is one block (no padding): for modes that move the
        whole gradient and never split it."""
        self.params, self.names, self.group_index = params, names, group_index
        self.dtype, self.device = params[0].dtype, params[0].device
        self.index = {id(p): i for i, p in enumerate(params)}
        self.offsets, off = [], 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        # a block never exceeds the group (a larger one would only pad it with zeros)
        self.block_size = block_size = min(block_size or off, off) or 1
        self.nblocks = max(1, -(-off // block_size))
        self.padded = self.nblocks * block_size
        self.param = torch.zeros(self.padded, dtype=self.dtype, device=self.device)
        self.grad = torch.zeros_like(self.param)
        with torch.no_grad():
            for p, o in zip(params, self.offsets):
                v = self.param[o:o + p.numel()].view_as(p)
                v.copy_(p.detach())
                p.data = v
        self.grad_views = [self.view(self.grad, i) for i in range(len(params))]
        # first and last block of each parameter, to find the parameters a block set touches
        self.block_span = [(o // block_size, (o + max(p.numel(), 1) - 1) // block_size)
                           for p, o in zip(params, self.offsets)]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of a flat buffer laid out like this group."""
        p, o = self.params[i], self.offsets[i]
        return flat[o:o + p.numel()].view_as(p)

    def gather_grads(self, params=None) -> None:
        """Make the flat gradient hold the gradients of ``params`` (default: all); a missing gradient
        counts as zeros (as in Horovod). Afterwards each ``p.grad`` is a view into the flat gradient."""
        for i in range(len(self.params)) if params is None else [self.index[id(p)] for p in params]:
            p, gv = self.params[i], self.grad_views[i]
            g = p.grad
            if g is None:
                gv.zero_()
            elif g.layout != torch.strided:
                raise ValueError(
                    f"osp: parameter {self.names[i]!r} has a sparse gradient (layout {g.layout}); "
                    "osp averages dense gradients only (use a dense embedding, sparse=False)")
            elif g.data_ptr() != gv.data_ptr() or g.shape != gv.shape:
                gv.copy_(g)
            p.grad = gv

    def zero_grad(self) -> None:
        self.grad.zero_()
        for p, gv in zip(self.params, self.grad_views):
            p.grad = gv

    def touched(self, block_mask: torch.Tensor) -> List[int]:
        """Indices of the parameters that have an element in a block where ``block_mask`` is set
        (reads the mask on the host)."""
        m = block_mask.tolist()
        return [i for i, (b0, b1) in enumerate(self.block_span) if any(m[b0:b1 + 1])]


class Workspace:
    """Buffers of one flat group's size kept across steps, by name: fresh 100 MB allocations every
    step cost more in page faults than the kernels that fill them. Each user owns its own."""

    def __init__(self, fg: FlatGroup):
        self.fg = fg
        self._bufs: Dict[str, torch.Tensor] = {}

    def __call__(self, name: str, numel: Optional[int] = None) -> torch.Tensor:
        """The first ``numel`` elements (default: all ``fg.padded``) of buffer ``name``."""
        buf = self._bufs.get(name)
        if buf is None:
            buf = self._bufs[name] = torch.empty(self.fg.padded, dtype=self.fg.dtype, device=self.fg.device)
        return buf if numel is None else buf[:numel]

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())
