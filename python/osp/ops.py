"""Typed wrappers of the osp kernels, and a pure-PyTorch reference of every one of them.

The references are the test oracle and the fallback when the extension ``osp._C`` is missing (a
warning says so once). Layout: a flat tensor of ``n`` elements is cut into ``ceil(n / block_size)``
blocks; the last block may be short. A *packed* buffer is the concatenation of selected blocks, each
with its true length, in the order of ``block_ids`` (pack/unpack) or in ascending block order
(split/merge with a per-block mask).

On CUDA the block kernels run over a grid of (block, chunk) work items whose shape is host arithmetic
(``csrc/launch.h``, visible on any build as ``torch.ops.osp.launch_shape``); split/merge/sgd_step_into_
take a mask's prefix sum once computed (:func:`mask_positions`, ``positions=``) instead of computing it
on every call.
"""
from __future__ import annotations

import math
import warnings
from typing import Optional, Tuple

import torch

try:
    from . import _C  # noqa: F401  (registers torch.ops.osp.*)

    HAS_EXTENSION = True
except ImportError as e:  # pragma: no cover - exercised only without a build
    HAS_EXTENSION = False
    _IMPORT_ERROR = e

METRICS = {"l2": 0, "l1": 1, "max": 2, "relative": 3}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_warned = False


def _use_extension() -> bool:
    global _warned
    if not HAS_EXTENSION and not _warned:
        warnings.warn(
            f"osp._C could not be imported ({_IMPORT_ERROR}); using the pure-PyTorch reference "
            "kernels, which are slower. Reinstall osp (pip install -e .) to build it.",
            RuntimeWarning,
            stacklevel=3,
        )
        _warned = True
    return HAS_EXTENSION


def num_blocks(numel: int, block_size: int) -> int:
    return 0 if numel == 0 else -(-numel // block_size)


def _metric_id(metric: str) -> int:
    if metric not in METRICS:
        raise ValueError(f"osp: unknown metric {metric!r}: expected one of {sorted(METRICS)}")
    return METRICS[metric]


# the CUDA implementations register themselves only in a build with CUDA
_CUDA_BUILT = HAS_EXTENSION and torch._C._dispatch_has_kernel_for_dispatch_key("osp::score_blocks", "CUDA")


def _check_dense(t: Optional[torch.Tensor], name: str) -> None:
    # The dispatcher's own messages (a sparse tensor, a device without a kernel) name no argument.
    if t is None:
        return
    if t.layout != torch.strided:
        raise RuntimeError(f"osp: {name} must be a dense tensor, got layout {t.layout}")
    if t.is_cuda and HAS_EXTENSION and not _CUDA_BUILT:
        raise RuntimeError(f"osp: {name} is on {t.device} but osp._C was built without CUDA (rebuild with "
                           "FORCE_CUDA=1 and nvcc on PATH)")


def _check_block_size(block_size) -> None:
    if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
        raise ValueError(f"osp: block_size must be a positive integer, got {block_size!r}")


def packed_numel(numel: int, block_ids: torch.Tensor, block_size: int) -> int:
    """Length of the buffer that packs ``block_ids`` of a flat tensor of ``numel`` elements.

    On a CUDA tensor whose length is not a multiple of ``block_size`` this syncs once (it must know
    whether the short last block is among the ids)."""
    nb = num_blocks(numel, block_size)
    k = block_ids.numel()
    if k == 0 or numel % block_size == 0:
        return k * block_size
    has_last = bool((block_ids == nb - 1).any())
    return k * block_size - (has_last * (nb * block_size - numel))


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """The int64 exclusive prefix sum of a per-block mask: ``positions[b]`` is how many blocks before
    ``b`` are selected (nonzero). Compute it once per mask and pass it as ``positions=`` to
    :func:`split_blocks`, :func:`merge_blocks` and :func:`sgd_step_into_`, which otherwise compute it on
    every call (on CUDA: launches and allocations per call). A slice stays valid with the same slice of
    the mask: ``split_blocks(flat[a * bs:b * bs], mask[a:b], bs, ..., positions=positions[a:b])`` (the
    kernels count from the slice's first entry). Two launches, no sync."""
    if mask.dtype not in (torch.bool, torch.uint8):
        raise RuntimeError(f"osp: mask must be bool or uint8, got {mask.dtype}")
    if mask.dim() != 1:
        raise RuntimeError(f"osp: mask must be 1-D, got {mask.dim()}-D")
    pos = torch.zeros(mask.numel() + 1, dtype=torch.int64, device=mask.device)
    torch.cumsum(mask if mask.dtype == torch.bool else mask != 0, 0, dtype=torch.int64, out=pos[1:])
    return pos[:-1]


def mask_numels(numel: int, mask: torch.Tensor, block_size: int) -> Tuple[int, int]:
    """(critical, deferred) packed lengths for a per-block mask (syncs once on CUDA)."""
    nb = num_blocks(numel, block_size)
    if mask.dim() != 1 or mask.numel() != nb:
        raise RuntimeError(f"osp: mask must have one entry per block ({nb}), got {mask.numel()}")
    if nb == 0:
        return 0, 0
    sel = int((mask != 0).sum())
    short_by = nb * block_size - numel
    last = bool(mask[nb - 1])
    return sel * block_size - (short_by if last else 0), (nb - sel) * block_size - (0 if last else short_by)


# ---------------------------------------------------------------------------------------------
# Public wrappers


def score_blocks(
    grad: torch.Tensor, block_size: int, metric: str = "l2", param: Optional[torch.Tensor] = None,
    eps: float = 1e-8,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One fused pass: fp32 score per block and whether any element of ``grad`` is non-finite.

    Returns ``(scores, nonfinite)``: ``scores`` is float32 ``[nblocks]``; ``nonfinite`` an int32
    ``[1]`` tensor on ``grad``'s device, 1 when some element is inf or nan (no sync is made).
    Metrics: ``l2`` sum of squares, ``l1`` sum of |g|, ``max`` max |g|, ``relative`` sum of
    |g| / (|w| + eps) with ``param`` the flat parameter.
    """
    _check_block_size(block_size)
    mid = _metric_id(metric)
    _check_dense(grad, "grad")
    _check_dense(param, "param")
    if _use_extension():
        return torch.ops.osp.score_blocks(grad, param, block_size, mid, eps)
    return ref_score_blocks(grad, block_size, metric, param, eps)


def pack_blocks(
    flat: torch.Tensor, block_ids: torch.Tensor, block_size: int, out: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Gather the blocks ``block_ids`` (int64, any order, distinct) of ``flat`` into one buffer.

    On CUDA the ids are validated (in range, distinct) with one small kernel and one device sync per
    call, and sizing ``out`` when it is not given costs another: pack/unpack are for tests and
    benchmarks, not any training step's path (which uses :func:`split_blocks` with a mask)."""
    _check_block_size(block_size)
    _check_dense(flat, "flat")
    if out is None:
        _check_ids_tensor(block_ids)
        out = torch.empty(packed_numel(flat.numel(), block_ids, block_size), dtype=flat.dtype,
                          device=flat.device)
    if _use_extension():
        torch.ops.osp.pack_blocks(flat, block_ids, block_size, out)
    else:
        ref_pack_blocks(flat, block_ids, block_size, out)
    return out


def unpack_blocks(
    buf: torch.Tensor, block_ids: torch.Tensor, block_size: int, flat: torch.Tensor,
    accumulate: bool = False,
) -> None:
    """Scatter ``buf`` (packed as by :func:`pack_blocks`) back into ``flat``, in place.
    With ``accumulate=True`` the blocks are added instead of copied. On CUDA the ids are validated
    with one device sync per call, as in :func:`pack_blocks` (not on any training step's path)."""
    _check_block_size(block_size)
    if _use_extension():
        torch.ops.osp.unpack_blocks(buf, block_ids, block_size, flat, accumulate)
    else:
        ref_unpack_blocks(buf, block_ids, block_size, flat, accumulate)


def _check_packed(op: str, flat: torch.Tensor, block_size: int, deferred_blocks: Optional[int],
                  critical: Optional[torch.Tensor], deferred: Optional[torch.Tensor]) -> None:
    """The packed buffers' lengths against the blocks the caller knows the mask sets (``deferred_blocks``
    unset, the rest set), on the host and without a device sync. The CPU kernels check the lengths
    against the mask itself; the CUDA kernels cannot without a sync and stop at a buffer's end, so a
    sizing bug would leave blocks silently unpacked or uncorrected there."""
    if deferred_blocks is None:
        return
    nb = flat.numel() // block_size
    if flat.numel() % block_size or not 0 <= deferred_blocks <= nb:
        raise RuntimeError(f"osp: {op}: expected a flat buffer of whole blocks with {deferred_blocks} deferred, "
                           f"got {flat.numel()} elements in blocks of {block_size}")
    for name, buf, blocks in (("critical", critical, nb - deferred_blocks), ("deferred", deferred, deferred_blocks)):
        if buf is not None and buf.numel() != blocks * block_size:
            raise RuntimeError(f"osp: {op}: the {name} buffer must hold {blocks} blocks of {block_size} "
                               f"({blocks * block_size} elements), got {buf.numel()} elements")


def split_blocks(
    flat: torch.Tensor, mask: torch.Tensor, block_size: int,
    critical: Optional[torch.Tensor] = None, deferred: Optional[torch.Tensor] = None,
    deferred_blocks: Optional[int] = None, *, positions: Optional[torch.Tensor] = None,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """One pass over ``flat``: blocks with ``mask`` set go to ``critical``, the others to
    ``deferred``, each in ascending block order. With neither output given both are allocated (which
    costs a device sync on CUDA, to size them); with one given, the other side is skipped (None).
    ``deferred_blocks``: how many blocks the mask leaves unset, where the caller knows it: the buffers'
    lengths are then checked against it (on every device, without a sync). ``positions``: the mask's
    :func:`mask_positions` (sliced like the mask), so they are not computed again; the CPU checks them
    against the mask."""
    _check_block_size(block_size)
    _check_dense(flat, "flat")
    _check_packed("split_blocks", flat, block_size, deferred_blocks, critical, deferred)
    if critical is None and deferred is None:
        nc, nd = mask_numels(flat.numel(), mask, block_size)
        critical, deferred = flat.new_empty(nc), flat.new_empty(nd)
    if _use_extension():
        torch.ops.osp.split_blocks(flat, mask, block_size, critical, deferred, positions)
    else:
        ref_split_blocks(flat, mask, block_size, critical, deferred)
    return critical, deferred


def merge_blocks(
    critical: Optional[torch.Tensor], deferred: Optional[torch.Tensor], mask: torch.Tensor,
    block_size: int, flat: torch.Tensor, deferred_blocks: Optional[int] = None, *,
    positions: Optional[torch.Tensor] = None,
) -> None:
    """Inverse of :func:`split_blocks`, in place on ``flat``; a ``None`` side is left untouched
    (``deferred_blocks`` and ``positions`` as there)."""
    _check_block_size(block_size)
    _check_packed("merge_blocks", flat, block_size, deferred_blocks, critical, deferred)
    if _use_extension():
        torch.ops.osp.merge_blocks(critical, deferred, mask, block_size, flat, positions)
    else:
        ref_merge_blocks(critical, deferred, mask, block_size, flat)


def sgd_step_(
    param: torch.Tensor, grad: torch.Tensor, momentum_buffer: Optional[torch.Tensor], *, lr: float,
    momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False,
    maximize: bool = False, first: bool = False,
) -> None:
    """One ``torch.optim.SGD`` step on contiguous buffers, in place on ``param`` and
    ``momentum_buffer``. ``first``: the momentum buffer did not exist before this step."""
    if _use_extension():
        torch.ops.osp.sgd_step_(param, grad, momentum_buffer, lr, momentum, dampening, weight_decay,
                                nesterov, maximize, first)
    else:
        ref_sgd_step_(param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize, first=first)


def sgd_step_into_(
    param: torch.Tensor, momentum_buffer: Optional[torch.Tensor], snap_param: torch.Tensor,
    snap_momentum: Optional[torch.Tensor], grad: torch.Tensor, mask: torch.Tensor, block_size: int, *,
    lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
    nesterov: bool = False, maximize: bool = False, first: bool = False, deferred_blocks: Optional[int] = None,
    positions: Optional[torch.Tensor] = None,
) -> None:
    """The ``torch.optim.SGD`` step of the blocks of the flat ``param`` where ``mask`` is not set, from
    packed inputs: ``snap_param``, ``snap_momentum`` and ``grad`` hold just those blocks (as
    :func:`split_blocks` packs the deferred side). The results are written to the blocks' places in
    ``param`` and ``momentum_buffer``; the packed inputs and the other blocks are left as they are.
    Bitwise :func:`sgd_step_` on the packed buffers followed by :func:`merge_blocks` of both into
    their flat places, in one pass (``deferred_blocks`` and ``positions`` as for :func:`split_blocks`)."""
    _check_block_size(block_size)
    for buf in (snap_param, snap_momentum, grad):
        _check_packed("sgd_step_into_", param, block_size, deferred_blocks, None, buf)
    if _use_extension():
        torch.ops.osp.sgd_step_into_(param, momentum_buffer, snap_param, snap_momentum, grad, mask, block_size,
                                     lr, momentum, dampening, weight_decay, nesterov, maximize, first, positions)
    else:
        ref_sgd_step_into_(param, momentum_buffer, snap_param, snap_momentum, grad, mask, block_size, lr=lr,
                           momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                           nesterov=nesterov, maximize=maximize, first=first)


def adam_step_(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
    max_exp_avg_sq: Optional[torch.Tensor], *, step: float, lr: float, beta1: float = 0.9,
    beta2: float = 0.999, eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False,
    maximize: bool = False, decoupled: bool = False,
) -> None:
    """One ``torch.optim.Adam`` (``decoupled=True``: ``AdamW``) step on contiguous buffers, in
    place on ``param`` and the state. ``step`` is the step count after this step's increment.

    On the CPU in fp32 it is bitwise torch.optim's own step (single-tensor and foreach, float
    hyper-parameters): its square root is torch's own CPU sqrt, which where torch has MKL is MKL's and
    not correctly rounded (it differs from ``std::sqrt`` in about one element in 150, and Adam divides a
    gradient of rounding noise by its own root mean square). On CUDA the square root is the correctly
    rounded one, as torch's CUDA sqrt is. In fp16/bf16 it may differ from torch.optim in the last bit:
    the LGP correction takes torch's own step there."""
    if _use_extension():
        torch.ops.osp.adam_step_(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, float(step), lr,
                                 beta1, beta2, eps, weight_decay, amsgrad, maximize, decoupled)
    else:
        ref_adam_step_(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, step=step, lr=lr,
                       beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                       maximize=maximize, decoupled=decoupled)


# ---------------------------------------------------------------------------------------------
# Pure-PyTorch references (oracle and fallback). They check the same things the kernels check.


def _check_ids_tensor(ids: torch.Tensor) -> None:
    if ids.dtype != torch.int64:
        raise TypeError(f"osp: block_ids must be int64, got {ids.dtype}")
    if ids.dim() != 1:
        raise ValueError(f"osp: block_ids must be 1-D, got {ids.dim()}-D")


def _ref_check_ids(ids: torch.Tensor, numel: int, block_size: int) -> None:
    _check_ids_tensor(ids)
    nb = num_blocks(numel, block_size)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= nb):
        raise IndexError(f"osp: block ids out of range: expected 0 <= id < {nb}, got "
                         f"min {int(ids.min())} and max {int(ids.max())}")
    if ids.numel() != ids.unique().numel():
        raise ValueError("osp: block_ids holds an id more than once")


def _blocks(flat: torch.Tensor, block_size: int):
    return list(flat.reshape(-1).split(block_size))


def ref_score_blocks(grad, block_size, metric="l2", param=None, eps=1e-8):
    _check_block_size(block_size)
    _metric_id(metric)
    g = grad.reshape(-1).float()
    nonfinite = torch.tensor([int(not bool(torch.isfinite(g).all()))], dtype=torch.int32,
                             device=grad.device)
    if g.numel() == 0:
        return g.new_empty(0), nonfinite
    pad = num_blocks(g.numel(), block_size) * block_size - g.numel()
    if metric == "relative":
        if param is None:
            raise ValueError("osp: metric 'relative' needs the flat parameter, got None")
        t = g.abs() / (param.reshape(-1).float().abs() + eps)
    elif metric == "l2":
        t = g * g
    else:
        t = g.abs()
    t = torch.nn.functional.pad(t, (0, pad)).view(-1, block_size)
    scores = t.amax(1) if metric == "max" else t.sum(1)
    return scores, nonfinite


def ref_pack_blocks(flat, block_ids, block_size, out):
    _ref_check_ids(block_ids, flat.numel(), block_size)
    blocks = _blocks(flat, block_size)
    parts = [blocks[i] for i in block_ids.tolist()]
    out.copy_(torch.cat(parts) if parts else flat.new_empty(0))
    return out


def ref_unpack_blocks(buf, block_ids, block_size, flat, accumulate=False):
    _ref_check_ids(block_ids, flat.numel(), block_size)
    blocks = _blocks(flat, block_size)
    o = 0
    for i in block_ids.tolist():
        n = blocks[i].numel()
        if accumulate:
            blocks[i].add_(buf[o:o + n])
        else:
            blocks[i].copy_(buf[o:o + n])
        o += n


def ref_split_blocks(flat, mask, block_size, critical, deferred):
    blocks = _blocks(flat, block_size)
    m = mask.tolist()
    crit = [b for b, s in zip(blocks, m) if s]
    rest = [b for b, s in zip(blocks, m) if not s]
    if critical is not None and crit:
        critical.copy_(torch.cat(crit))
    if deferred is not None and rest:
        deferred.copy_(torch.cat(rest))
    return critical, deferred


def ref_merge_blocks(critical, deferred, mask, block_size, flat):
    oc = od = 0
    for b, s in zip(_blocks(flat, block_size), mask.tolist()):
        n = b.numel()
        if s:
            if critical is not None:
                b.copy_(critical[oc:oc + n])
            oc += n
        else:
            if deferred is not None:
                b.copy_(deferred[od:od + n])
            od += n


def ref_sgd_step_(param, grad, momentum_buffer, *, lr, momentum=0.0, dampening=0.0, weight_decay=0.0,
                  nesterov=False, maximize=False, first=False):
    """torch.optim.SGD's own single-tensor step on these buffers."""
    from torch.optim.sgd import _single_tensor_sgd

    bufs = [None if (first or momentum == 0.0) else momentum_buffer]
    _single_tensor_sgd([param], [grad], bufs, None, None, weight_decay=weight_decay,
                       momentum=momentum, lr=lr, dampening=dampening, nesterov=nesterov,
                       maximize=maximize, has_sparse_grad=False)
    if momentum != 0.0 and first:
        momentum_buffer.copy_(bufs[0])


def ref_sgd_step_into_(param, momentum_buffer, snap_param, snap_momentum, grad, mask, block_size, *, lr,
                       momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False,
                       first=False):
    """:func:`ref_sgd_step_` on copies of the packed inputs, merged into their flat places."""
    p = snap_param.clone()
    m = None
    if momentum != 0.0:
        m = torch.empty_like(p) if first else snap_momentum.clone()
    ref_sgd_step_(p, grad, m, lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                  nesterov=nesterov, maximize=maximize, first=first)
    ref_merge_blocks(None, p, mask, block_size, param)
    if m is not None:
        ref_merge_blocks(None, m, mask, block_size, momentum_buffer)


def ref_adam_step_(param, grad, exp_avg, exp_avg_sq, max_exp_avg_sq, *, step, lr, beta1=0.9,
                   beta2=0.999, eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False,
                   decoupled=False):
    """torch.optim.Adam's own single-tensor step on these buffers."""
    from torch.optim.adam import _single_tensor_adam

    step_t = torch.tensor(float(step) - 1.0)
    _single_tensor_adam([param], [grad], [exp_avg], [exp_avg_sq],
                        [max_exp_avg_sq] if amsgrad else [], [step_t], None, None, amsgrad=amsgrad,
                        has_complex=False, beta1=beta1, beta2=beta2, lr=lr,
                        weight_decay=weight_decay, eps=eps, maximize=maximize, capturable=False,
                        differentiable=False, decoupled_weight_decay=decoupled)


# ---------------------------------------------------------------------------------------------
# Fake (meta) kernels, so the ops work under torch.compile / FakeTensor and pass opcheck.

if HAS_EXTENSION:

    @torch.library.register_fake("osp::score_blocks")
    def _(grad, param, block_size, metric, eps):
        nb = 0 if grad.numel() == 0 else math.ceil(grad.numel() / block_size)
        return grad.new_empty(nb, dtype=torch.float32), grad.new_empty(1, dtype=torch.int32)

    for _name in ("pack_blocks", "unpack_blocks", "split_blocks", "merge_blocks", "sgd_step_",
                  "sgd_step_into_", "adam_step_"):
        torch.library.register_fake(f"osp::{_name}")(lambda *args, **kwargs: None)
