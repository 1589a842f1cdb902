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
        # each parameter's shape, and its strides where it keeps them (dense, not row-major: channels_last)
        self.shapes = [p.shape for p in params]
        self.strides = [_kept_strides(p, n) for p, n in zip(params, names)]
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
            for i, p in enumerate(params):
                v = self.view(self.param, i)
                v.copy_(p.detach())
                p.data = v
        self._ptrs = [p.data_ptr() for p in params]
        # p.grad is an alias of its slice of the flat gradient with a version counter of its own (a view
        # would share the flat buffer's): in-place changes to one gradient (zero_(), clipping, another
        # backward accumulating into it) show in that gradient's ``_version`` alone
        self.grad_views = [self._alias(self.grad, i) for i in range(len(params))]
        self.absent: set = set()  # parameters whose gradient was None when gathered this step
        self.sparse_as_dense = False  # a sparse gradient is made dense when gathered (else refused)
        # first and last block of each parameter, to find the parameters a block set touches
        self.block_span = [(o // block_size, (o + max(p.numel(), 1) - 1) // block_size)
                           for p, o in zip(params, self.offsets)]

    def view(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of a flat buffer laid out like this group: its elements in the parameter's
        memory order (row-major, or as its strides were when wrapped, e.g. channels_last)."""
        shape, strides, o = self.shapes[i], self.strides[i], self.offsets[i]
        part = flat[o:o + shape.numel()]
        return part.view(shape) if strides is None else part.as_strided(shape, strides)

    def _alias(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """Parameter ``i``'s part of ``flat`` as a tensor of its own (not a view: own version counter)."""
        v = self.view(flat, i)
        if not v.numel():
            return v
        t = torch.empty(0, dtype=flat.dtype, device=flat.device)
        return t.set_(flat.untyped_storage(), v.storage_offset(), v.shape, v.stride())

    def gather_grads(self, params=None) -> None:
        """Make the flat gradient hold the gradients of ``params`` (default: all); a missing gradient
        counts as zeros (as in Horovod) and is noted in ``absent``, and stays None for the user, as torch
        leaves it. Afterwards each other ``p.grad`` is its alias into the flat gradient."""
        for i in range(len(self.params)) if params is None else [self.index[id(p)] for p in params]:
            p, gv = self.params[i], self.grad_views[i]
            g = p.grad
            if g is None:
                gv.zero_()
                self.absent.add(i)
                continue
            elif g.layout != torch.strided:
                if not self.sparse_as_dense:
                    raise ValueError(
                        f"osp: parameter {self.names[i]!r} has a sparse gradient (layout {g.layout}); "
                        "osp averages dense gradients: pass sparse_as_dense=True (as with Horovod), or use a "
                        "dense embedding (sparse=False)")
                gv.copy_(g.to_dense())
            elif g.data_ptr() != gv.data_ptr() or g.shape != gv.shape:
                gv.copy_(g)
            p.grad = gv

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim``'s: ``set_to_none=False`` zeroes the gradients that exist and leaves a
        gradient that is None as it is (the step then leaves that parameter alone)."""
        if not set_to_none:  # accumulated into in place; set to None, each is overwritten when gathered
            self.grad.zero_()
        for p, gv in zip(self.params, self.grad_views):
            p.grad = None if set_to_none or p.grad is None else gv

    def set_grads(self, absent=()) -> None:
        """Point each ``p.grad`` at its alias, or at None where ``absent`` (indices) says so: the wrapped
        optimizer then leaves those parameters alone, as ``torch.optim`` does."""
        for i, (p, gv) in enumerate(zip(self.params, self.grad_views)):
            p.grad = None if i in absent else gv

    def check_params(self) -> None:
        """Raise if a parameter stopped being a view of the flat buffer (``model.to(...)``, ``.half()``,
        ``p.data = ...`` after wrapping): it would train alone on each rank."""
        for i, (p, ptr) in enumerate(zip(self.params, self._ptrs)):
            if p.data_ptr() != ptr or p.dtype != self.dtype or p.device != self.device:
                v = self.view(self.param, i)
                raise RuntimeError(
                    f"osp: parameter {self.names[i]!r} no longer lives where the optimizer was wrapped around it "
                    f"(it was {self.dtype} {list(v.shape)} on {self.device} in osp's flat buffer; now it is "
                    f"{p.dtype} {list(p.shape)} on {p.device}, with storage of its own): model.to(...), "
                    ".half(), .float() or `p.data = ...` after wrapping. Convert or move the model first, then "
                    "build and wrap the optimizer")

    def touched(self, block_mask: torch.Tensor) -> List[int]:
        """Indices of the parameters that have an element in a block where ``block_mask`` is set
        (reads the mask on the host)."""
        m = block_mask.tolist()
        return [i for i, (b0, b1) in enumerate(self.block_span) if any(m[b0:b1 + 1])]


def memory_layout(p: torch.Tensor):
    """How ``p``'s elements lie in its memory, as osp's flat buffer keeps them: None for row-major (and for a
    parameter with gaps, a slice, which becomes row-major: the layout torch gives its gradient), the strides
    of a dense one that is not row-major (channels_last, a transposed weight; None where a dimension of size
    1 places nothing), or ``"overlapping"`` where elements share memory (expanded). Every rank must have
    the same: the flat buffers are averaged element by element, in memory order."""
    if p.is_contiguous():
        return None
    # by increasing stride (dimensions of size 1 place nothing): dense where each stride is the number of
    # elements the smaller ones span, overlapping where one is within what they span
    extent, dense = 0, True  # extent: the farthest element from the first over the dimensions so far
    for stride, size in sorted((st, sz) for st, sz in zip(p.stride(), p.shape) if sz > 1):
        if stride <= extent:
            return "overlapping"
        dense = dense and stride == extent + 1
        extent += stride * (size - 1)
    return tuple(st if sz > 1 else None for st, sz in zip(p.stride(), p.shape)) if dense else None


def _kept_strides(p: torch.Tensor, name: str) -> Optional[tuple]:
    """The strides ``p``'s view of a flat buffer gets (``memory_layout``): None for row-major, ``p``'s own
    where its memory is dense and not row-major, so the kernels that run on it and on its gradient (torch
    gives a gradient the parameter's strides) stay those the user chose. A parameter whose elements share
    memory cannot become a view of its own elements: refused."""
    kept = memory_layout(p)
    if kept == "overlapping":
        raise ValueError(
            f"osp: parameter {name!r} has elements that share memory (shape {list(p.shape)}, strides "
            f"{list(p.stride())}: expanded, or made by as_strided); expected a parameter whose elements are "
            "distinct (contiguous, channels_last, or any dense layout), as osp moves each element into a "
            "flat buffer of its own, where they would train apart. Make it one with .contiguous() (or "
            ".clone()) before building the optimizer, or keep it out of the optimizer")
    return None if kept is None else tuple(p.stride())


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


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


class EditProbe:
    """Notices parameters changed between steps while an exact correction is pending (a weight clamp,
    ``load_state_dict``, ...), which the correction would silently overwrite. Two signs: a parameter's
    own version counter (in-place ops on it, ``copy_``), and a sample of the values, the first
    ``SAMPLE`` elements of every ``chunk`` (edits through ``p.data``, which has a counter of its own; an
    edit confined to unsampled elements can pass unnoticed). Costs a copy of 1/64 of the parameters
    per step."""

    SAMPLE = 64

    def __init__(self, groups: List[FlatGroup], chunk: Optional[int] = None):
        self.groups, self.chunk = groups, chunk
        self._samples: Optional[List[torch.Tensor]] = None
        self._versions: List[int] = []

    def _view(self, fg: FlatGroup) -> torch.Tensor:
        chunk = min(self.chunk or fg.block_size, fg.padded)
        n, k = fg.padded // chunk, min(self.SAMPLE, chunk)
        return fg.param.as_strided((n, k), (chunk, 1))

    def record(self) -> None:
        self._samples = [self._view(fg).clone() for fg in self.groups]
        self._versions = [sum(p._version for p in fg.params) for fg in self.groups]

    def clear(self) -> None:
        self._samples = None

    def edited(self, masks: Optional[List[Optional[torch.Tensor]]] = None) -> torch.Tensor:
        """Whether a parameter changed since ``record()`` where ``masks`` (per group one flag per chunk,
        or None: the whole group is free to change) is set: a device bool, no sync."""
        out = torch.zeros((), dtype=torch.bool, device=self.groups[0].device)
        if self._samples is None:
            return out
        for i, (fg, old) in enumerate(zip(self.groups, self._samples)):
            if masks is not None and masks[i] is None:
                continue
            if sum(p._version for p in fg.params) != self._versions[i]:
                return torch.ones((), dtype=torch.bool, device=fg.device)
            diff = (_bits(self._view(fg)) != _bits(old)).any(dim=1)  # bits: a nan equals itself
            if masks is not None:
                diff = diff & masks[i]
            out = out | diff.any()
        return out
