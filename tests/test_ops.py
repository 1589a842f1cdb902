"""Kernels against their pure-PyTorch references, bad input, opcheck, and the exact optimizer steps
against torch.optim. Written once per device: CUDA cases skip only when there is no GPU."""
from itertools import product

import pytest
import torch

from osp import ops

assert ops.HAS_EXTENSION, "osp._C did not build; these tests check the compiled kernels"

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DEVICES = ["cpu", "cuda"]
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def grid(*axes):
    """The product of the axes as pytest params; a case on "cuda" skips only when there is no GPU."""
    return [pytest.param(*c, marks=[NO_CUDA] if "cuda" in c else []) for c in product(*axes)]
BS = 32
SIZES = [0, 1, BS - 1, BS, BS + 1, 37 * BS + 5, 64 * BS]
METRICS = ["l2", "l1", "max", "relative"]
# ATen's vector kernels use fused multiply-adds only where the CPU has them.
CPU_HAS_FMA = torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def poison(t):
    return t.fill_(float("nan"))


def rand(n, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g).to(dtype=dtype, device=device)


def random_ids(nb, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(nb, generator=g)[:k].to(torch.int64)


def score_tol(dtype):
    return dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("device,dtype,n,metric", grid(DEVICES, DTYPES, SIZES, METRICS))
def test_score_blocks(device, dtype, n, metric):
    g = rand(n, dtype, device)
    w = rand(n, dtype, device, seed=1)
    scores, nf = ops.score_blocks(g, BS, metric, param=w)
    ref, ref_nf = ops.ref_score_blocks(g, BS, metric, param=w)
    assert scores.dtype == torch.float32 and scores.shape == (ops.num_blocks(n, BS),)
    torch.testing.assert_close(scores, ref, **score_tol(dtype))
    assert int(nf) == 0 == int(ref_nf)


@pytest.mark.parametrize("device,dtype,bad", grid(DEVICES, DTYPES, ["inf", "-inf", "nan"]))
def test_score_blocks_flags_nonfinite(device, dtype, bad):
    n = 9 * BS + 3
    for pos in (0, 5 * BS + 17, n - 1):
        g = rand(n, dtype, device)
        g[pos] = float(bad)
        for metric in METRICS:
            _, nf = ops.score_blocks(g, BS, metric, param=torch.ones_like(g))
            assert int(nf) == 1, (metric, pos)


@pytest.mark.parametrize("device,dtype,n", grid(DEVICES, DTYPES, SIZES))
def test_pack_unpack(device, dtype, n):
    flat = rand(n, dtype, device)
    nb = ops.num_blocks(n, BS)
    cases = {"none": torch.empty(0, dtype=torch.int64), "all": torch.arange(nb),
             "reversed": torch.arange(nb).flip(0), "some": random_ids(nb, (nb + 1) // 2)}
    for label, ids in cases.items():
        ids = ids.to(device)
        ref = flat.new_empty(ops.packed_numel(n, ids, BS))
        ops.ref_pack_blocks(flat, ids, BS, ref)
        out = poison(torch.empty_like(ref))
        got = ops.pack_blocks(flat, ids, BS, out=out)
        assert got is out
        assert torch.equal(out, ref), label
        assert torch.equal(ops.pack_blocks(flat, ids, BS), ref), label
        # unpack into a poisoned flat: exactly the listed blocks are written
        target = poison(torch.empty_like(flat))
        expect = target.clone()
        ops.ref_unpack_blocks(ref, ids, BS, expect)
        ops.unpack_blocks(ref, ids, BS, target)
        assert torch.equal(target.isnan(), expect.isnan()), label
        assert torch.equal(target[~target.isnan()], expect[~expect.isnan()]), label
        # accumulate adds
        acc = flat.clone()
        ops.unpack_blocks(ref, ids, BS, acc, accumulate=True)
        expect = flat.clone()
        ops.ref_unpack_blocks(ref, ids, BS, expect, accumulate=True)
        assert torch.equal(acc, expect), label


@pytest.mark.parametrize("device,dtype,n", grid(DEVICES, DTYPES, SIZES))
def test_split_merge(device, dtype, n):
    flat = rand(n, dtype, device)
    nb = ops.num_blocks(n, BS)
    g = torch.Generator().manual_seed(n)
    masks = [torch.zeros(nb, dtype=torch.bool), torch.ones(nb, dtype=torch.bool),
             torch.rand(nb, generator=g) < 0.3]
    if nb:
        m = torch.zeros(nb, dtype=torch.bool)
        m[-1] = True  # only the short last block critical
        masks.append(m)
    for mask in masks:
        mask = mask.to(device)
        nc, nd = ops.mask_numels(n, mask, BS)
        rc, rd = flat.new_empty(nc), flat.new_empty(nd)
        ops.ref_split_blocks(flat, mask, BS, rc, rd)
        c, d = poison(flat.new_empty(nc)), poison(flat.new_empty(nd))
        ops.split_blocks(flat, mask, BS, c, d)
        assert torch.equal(c, rc) and torch.equal(d, rd)
        # the same as pack with the sorted ids of each side
        ids = mask.nonzero().flatten()
        assert torch.equal(c, ops.pack_blocks(flat, ids, BS))
        back = poison(torch.empty_like(flat))
        ops.merge_blocks(c, d, mask, BS, back)
        assert torch.equal(back, flat)
        # one side only: the other side's blocks stay as they were
        half = poison(torch.empty_like(flat))
        ops.merge_blocks(c, None, mask, BS, half)
        expect = poison(torch.empty_like(flat))
        ops.ref_merge_blocks(c, None, mask, BS, expect)
        assert torch.equal(half.isnan(), expect.isnan())
        assert torch.equal(half[~half.isnan()], expect[~expect.isnan()])
        c2, d2 = ops.split_blocks(flat, mask, BS)
        assert torch.equal(c2, rc) and torch.equal(d2, rd)


@pytest.mark.parametrize("device", grid(DEVICES))
def test_bad_input_is_a_clear_error(device):
    flat = rand(5 * BS + 3, torch.float32, device)
    ids = torch.tensor([1, 3], device=device)
    out = flat.new_empty(2 * BS)
    with pytest.raises(RuntimeError, match="appears more than once|more than once"):
        ops.pack_blocks(flat, torch.tensor([1, 1], device=device), BS, out=out)
    with pytest.raises(RuntimeError, match=r"out of range: expected 0 <= id < 6"):
        ops.pack_blocks(flat, torch.tensor([1, 6], device=device), BS, out=out)
    with pytest.raises(RuntimeError, match="out of range"):
        ops.pack_blocks(flat, torch.tensor([-1, 2], device=device), BS, out=out)
    with pytest.raises((RuntimeError, TypeError), match="block_ids must be int64, got Int"):
        ops.pack_blocks(flat, ids.int(), BS, out=out)
    with pytest.raises(RuntimeError, match="flat must be float32, float16 or bfloat16, got Double"):
        ops.pack_blocks(flat.double(), ids, BS, out=out.double())
    with pytest.raises(RuntimeError, match="out must be Half like flat, got Float"):
        ops.pack_blocks(flat.half(), ids, BS, out=out)
    with pytest.raises(RuntimeError, match=f"out must have {2 * BS} elements, got {2 * BS + 1}"):
        ops.pack_blocks(flat, ids, BS, out=flat.new_empty(2 * BS + 1))
    with pytest.raises(RuntimeError, match="must be contiguous"):
        ops.pack_blocks(flat[::2], ids, BS, out=out)
    with pytest.raises(RuntimeError, match="buf must have"):
        ops.unpack_blocks(flat.new_empty(3), ids, BS, flat)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got 0"):
        ops.pack_blocks(flat, ids, 0)
    with pytest.raises(ValueError, match="block_size must be a positive integer, got -4"):
        ops.score_blocks(flat, -4)[0]
    with pytest.raises(RuntimeError, match="block_size must be a positive integer, got 0"):
        torch.ops.osp.score_blocks(flat, None, 0, 0, 1e-8)
    with pytest.raises(ValueError, match="unknown metric 'l3'"):
        ops.score_blocks(flat, BS, "l3")[0]
    with pytest.raises(RuntimeError, match="metric must be 0"):
        torch.ops.osp.score_blocks(flat, None, BS, 7, 1e-8)
    with pytest.raises(RuntimeError, match="'relative' needs the flat parameter"):
        ops.score_blocks(flat, BS, "relative")[0]
    with pytest.raises(RuntimeError, match="param must have"):
        ops.score_blocks(flat, BS, "relative", param=flat[:-1])[0]
    with pytest.raises(RuntimeError, match="mask must have one entry per block \\(6\\), got 5"):
        ops.split_blocks(flat, torch.ones(5, dtype=torch.bool, device=device), BS)
    with pytest.raises(RuntimeError, match="mask must be bool or uint8, got Float"):
        torch.ops.osp.split_blocks(flat, torch.ones(6, device=device), BS, None, None)
    if device == "cpu":  # on CUDA the lengths would cost a sync per call: the kernels stay inside the buffers
        with pytest.raises(RuntimeError, match="critical must have"):
            torch.ops.osp.split_blocks(flat, torch.ones(6, dtype=torch.bool, device=device), BS,
                                       flat.new_empty(3), None)
    with pytest.raises(RuntimeError, match="out must not overlap flat"):
        ops.pack_blocks(flat, ids, BS, out=flat[:2 * BS])
    with pytest.raises(RuntimeError, match="flat must not overlap buf"):
        ops.unpack_blocks(flat[BS:3 * BS], ids, BS, flat)
    mask = torch.tensor([True, False, True, False, False, False], device=device)
    with pytest.raises(RuntimeError, match="deferred must not overlap flat"):
        ops.split_blocks(flat, mask, BS, flat.new_empty(2 * BS), flat[-(3 * BS + 3):])
    with pytest.raises(RuntimeError, match="flat must not overlap critical"):
        ops.merge_blocks(flat[BS:3 * BS], None, mask, BS, flat)
    with pytest.raises(RuntimeError, match="dense"):
        ops.score_blocks(flat.to_sparse(), BS)[0]
    with pytest.raises(RuntimeError, match="momentum_buffer, got None"):
        ops.sgd_step_(flat, flat, None, lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="grad must have"):
        ops.sgd_step_(flat, flat[:-1], None, lr=0.1)
    with pytest.raises(RuntimeError, match="amsgrad needs max_exp_avg_sq"):
        ops.adam_step_(flat, flat, flat.clone(), flat.clone(), None, step=1, lr=0.1, amsgrad=True)
    with pytest.raises(RuntimeError, match=r"\(>= 1\), got 0"):
        ops.adam_step_(flat, flat, flat.clone(), flat.clone(), None, step=0, lr=0.1)


@pytest.mark.parametrize("device,dtype", grid(DEVICES, DTYPES))
def test_uint8_mask_any_nonzero_selects(device, dtype):
    """A uint8 mask selects every block whose byte is nonzero, whatever the value: the lengths and the
    offsets agree, and nothing is written past the buffers (a guard region stays untouched)."""
    n = 4 * BS - 5
    flat = rand(n, dtype, device)
    m8 = torch.tensor([2, 0, 1, 255], dtype=torch.uint8, device=device)
    mb = m8 != 0
    assert ops.mask_numels(n, m8, BS) == ops.mask_numels(n, mb, BS) == (3 * BS - 5, BS)
    store = poison(flat.new_empty(4 * BS + 64))
    c, d = store[:3 * BS - 5], store[3 * BS:4 * BS]
    ops.split_blocks(flat, m8, BS, c, d)
    rc, rd = ops.split_blocks(flat, mb, BS)
    assert torch.equal(c, rc) and torch.equal(d, rd)
    assert store[3 * BS - 5:3 * BS].isnan().all() and store[4 * BS:].isnan().all()
    back = poison(flat.new_empty(n + 64))
    ops.merge_blocks(c, d, m8, BS, back[:n])
    assert torch.equal(back[:n], flat) and back[n:].isnan().all()


@pytest.mark.parametrize("device", grid(DEVICES))
def test_huge_block_size_is_one_block(device):
    flat = rand(3 * BS + 1, torch.float32, device)
    for bs in (2**40, 2**62, 2**63 - 1):
        scores = ops.score_blocks(flat, bs, "l1")[0]
        assert scores.shape == (1,)
        torch.testing.assert_close(scores[0], flat.abs().sum())
        assert ops.split_blocks(flat, torch.ones(1, dtype=torch.bool, device=device), bs)[0].numel() == flat.numel()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mixed_devices_refused():
    flat = torch.randn(4 * BS)
    with pytest.raises(RuntimeError, match="block_ids must be on cpu"):
        torch.ops.osp.pack_blocks(flat, torch.tensor([0], device="cuda"), BS, flat.new_empty(BS))
    with pytest.raises(RuntimeError, match="grad must be on"):
        ops.sgd_step_(flat.cuda(), flat, None, lr=0.1)


@pytest.mark.parametrize("device", grid(DEVICES))
def test_opcheck(device):
    n = 7 * BS + 3
    flat = rand(n, torch.float32, device)
    ids = torch.tensor([4, 0, 7], device=device)
    mask = torch.tensor([1, 0, 0, 1, 0, 1, 0, 1], dtype=torch.bool, device=device)
    nc, nd = ops.mask_numels(n, mask, BS)
    st = [flat.clone() for _ in range(3)]
    cases = [
        (torch.ops.osp.score_blocks.default, (flat, None, BS, 0, 1e-8)),
        (torch.ops.osp.score_blocks.default, (flat, flat.abs(), BS, 3, 1e-8)),
        (torch.ops.osp.pack_blocks.default, (flat, ids, BS, flat.new_empty(2 * BS + 3))),
        (torch.ops.osp.unpack_blocks.default, (flat[: 2 * BS + 3].clone(), ids, BS, flat.clone(), False)),
        (torch.ops.osp.split_blocks.default, (flat, mask, BS, flat.new_empty(nc), flat.new_empty(nd))),
        (torch.ops.osp.merge_blocks.default, (flat[:nc].clone(), flat[:nd].clone(), mask, BS, flat.clone())),
        (torch.ops.osp.sgd_step_.default,
         (flat.clone(), flat, flat.clone(), 0.1, 0.9, 0.0, 0.0, False, False, False)),
        (torch.ops.osp.sgd_step_into_.default,
         (flat.clone(), flat.clone(), flat[:nd].clone(), flat[:nd].clone(), flat[:nd].clone(), mask, BS, 0.1, 0.9,
          0.0, 0.0, False, False, False)),
        (torch.ops.osp.adam_step_.default, (flat.clone(), flat, st[0], st[1].abs(), st[2].abs(), 2.0,
                                            1e-3, 0.9, 0.999, 1e-8, 0.0, True, False, False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


# ------------------------------------------------------------------------------------------------
# Exact optimizer steps against torch.optim over several steps.

SGD_CASES = [
    dict(lr=0.1),
    dict(lr=0.1, momentum=0.9),
    dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=1e-2),
    dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=5e-3),
    dict(lr=0.1, momentum=0.9, maximize=True, weight_decay=1e-3),
    dict(lr=0.1, weight_decay=0.1, maximize=True),
]
ADAM_CASES = [
    ("Adam", dict(lr=1e-3)),
    ("Adam", dict(lr=1e-2, betas=(0.8, 0.95), weight_decay=1e-2)),
    ("Adam", dict(lr=1e-3, amsgrad=True, weight_decay=1e-3)),
    ("Adam", dict(lr=1e-3, maximize=True, eps=1e-6)),
    ("Adam", dict(lr=1e-3, betas=(0.3, 0.9))),  # lerp weight >= 0.5: the other branch
    ("AdamW", dict(lr=1e-3)),
    ("AdamW", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("AdamW", dict(lr=1e-3, weight_decay=0.05, maximize=True)),
]
STEPS = 6


def max_ulps(a, b):
    """Largest distance in units in the last place between two tensors of the same dtype."""
    assert a.dtype == b.dtype
    if a.dtype == torch.float32:
        ia, ib = a.view(torch.int32).long(), b.view(torch.int32).long()
    else:
        ia, ib = a.view(torch.int16).long(), b.view(torch.int16).long()
    return int((ia - ib).abs().max()) if a.numel() else 0


def scaled_error(a, b):
    """max |a - b| in units of eps(dtype) * max |b|: 1.0 is one ulp at the tensor's largest value.
    Non-finite elements (fp16 Adam overflows with eps=1e-8, in torch.optim too) must coincide."""
    fin = torch.isfinite(b)
    assert torch.equal(fin, torch.isfinite(a)), "non-finite elements differ"
    assert torch.equal(a[~fin].nan_to_num(), b[~fin].nan_to_num()), "non-finite elements differ"
    a, b = a[fin], b[fin]
    if b.numel() == 0:
        return 0.0
    scale = float(b.float().abs().max()) * torch.finfo(b.dtype).eps
    return float((a.float() - b.float()).abs().max()) / scale if scale else 0.0


def assert_steps_match(ours, theirs, dtype, exact):
    for name, a, b in zip(("param", "state 1", "state 2", "state 3"), ours, theirs):
        if exact:
            assert torch.equal(a, b), f"{name}: {int((a != b).sum())} elements differ"
        else:
            # fp16/bf16 on the CPU and CUDA round differently from torch.optim: allow an ulp of the
            # tensor's scale per step.
            err = scaled_error(a, b)
            assert err <= STEPS, f"{name}: {err:.2f} ulps of the tensor's scale apart"


@pytest.mark.parametrize("device,dtype,case", grid(DEVICES, DTYPES, range(len(SGD_CASES))))
def test_sgd_step_matches_torch_optim(device, dtype, case):
    kw = SGD_CASES[case]
    n = 4099
    p_ref = torch.nn.Parameter(rand(n, dtype, device))
    opt = torch.optim.SGD([p_ref], foreach=False, **kw)
    p = p_ref.detach().clone()
    buf = torch.zeros_like(p)
    momentum = kw.get("momentum", 0.0)
    for step in range(STEPS):
        g = rand(n, dtype, device, seed=100 + step)
        p_ref.grad = g.clone()
        opt.step()
        ops.sgd_step_(p, g, buf if momentum else None, first=step == 0,
                      **{k: v for k, v in kw.items()})
        ref_buf = opt.state[p_ref].get("momentum_buffer")
        ours = [p] + ([buf] if momentum else [])
        theirs = [p_ref.detach()] + ([ref_buf] if momentum else [])
        # bitwise on a CPU with FMA in fp32; fp16/bf16 scalar tails round alpha differently
        exact = device == "cpu" and dtype == torch.float32 and CPU_HAS_FMA
        assert_steps_match(ours, theirs, dtype, exact)


def into_masks(nb, seed):
    """Masks for sgd_step_into_: none, all and a random third selected, and only the short last block
    deferred (the packed inputs then end with it)."""
    g = torch.Generator().manual_seed(seed)
    last_only = torch.ones(nb, dtype=torch.bool)
    last_only[-1] = False
    return [torch.zeros(nb, dtype=torch.bool), torch.ones(nb, dtype=torch.bool), torch.rand(nb, generator=g) < 0.3,
            last_only]


@pytest.mark.parametrize("device,dtype,case", grid(DEVICES, DTYPES, range(len(SGD_CASES))))
def test_sgd_step_into_is_step_then_merge(device, dtype, case):
    """The deferred blocks' step from packed snapshots, written straight to the flat buffers, is bitwise
    sgd_step_ on the packed buffers followed by merge_blocks into the flat ones; the selected blocks
    and the packed inputs are left alone; over several steps, the first (no momentum yet) included."""
    kw = SGD_CASES[case]
    momentum = kw.get("momentum", 0.0)
    n = 37 * BS + 5
    for mi, mask in enumerate(into_masks(ops.num_blocks(n, BS), case)):
        mask = mask.to(device)
        nd = ops.mask_numels(n, mask, BS)[1]
        p, m = rand(n, dtype, device, seed=mi), rand(n, dtype, device, seed=50 + mi)
        p_ref, m_ref = p.clone(), m.clone()
        for step in range(3):
            first = step == 0
            snap_p, snap_m = ops.split_blocks(p, mask, BS)[1].clone(), ops.split_blocks(m, mask, BS)[1].clone()
            # what the provisional update left in the flat buffers: overwritten on the deferred blocks
            p.add_(1.0)
            m.add_(1.0)
            p_ref.copy_(p)
            m_ref.copy_(m)
            g = rand(nd, dtype, device, seed=100 + step)
            kept_p, kept_m, kept_g = snap_p.clone(), snap_m.clone(), g.clone()
            ops.sgd_step_into_(p, m if momentum else None, snap_p, None if first else snap_m, g, mask, BS,
                               first=first, **kw)
            rp, rm = snap_p.clone(), snap_m.clone()
            ops.sgd_step_(rp, g, rm if momentum else None, first=first, **kw)
            ops.merge_blocks(None, rp, mask, BS, p_ref)
            if momentum:
                ops.merge_blocks(None, rm, mask, BS, m_ref)
            assert torch.equal(p, p_ref), f"mask {mi} step {step}: param differs"
            assert torch.equal(m, m_ref), f"mask {mi} step {step}: momentum differs"
            assert torch.equal(snap_p, kept_p) and torch.equal(snap_m, kept_m) and torch.equal(g, kept_g)


def test_sgd_step_into_bad_input_is_a_clear_error():
    n = 5 * BS + 3
    p, m = rand(n, torch.float32, "cpu"), rand(n, torch.float32, "cpu")
    mask = torch.tensor([1, 0, 0, 1, 0, 0], dtype=torch.bool)
    nd = ops.mask_numels(n, mask, BS)[1]
    snap, g = rand(nd, torch.float32, "cpu"), rand(nd, torch.float32, "cpu")
    with pytest.raises(RuntimeError, match=f"snap_param must have {nd} elements, got {nd - 1}"):
        ops.sgd_step_into_(p, None, snap[1:], None, g, mask, BS, lr=0.1)
    with pytest.raises(RuntimeError, match=f"grad must have {nd} elements, got {n}"):
        ops.sgd_step_into_(p, None, snap, None, p.clone(), mask, BS, lr=0.1)
    with pytest.raises(RuntimeError, match="sgd_step_into with momentum 0.9 needs a momentum_buffer, got None"):
        ops.sgd_step_into_(p, None, snap, snap.clone(), g, mask, BS, lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="after the first step needs snap_momentum, got None"):
        ops.sgd_step_into_(p, m, snap, None, g, mask, BS, lr=0.1, momentum=0.9)
    with pytest.raises(RuntimeError, match="mask must have one entry per block"):
        ops.sgd_step_into_(p, None, snap, None, g, mask[1:], BS, lr=0.1)
    with pytest.raises(RuntimeError, match="param must not overlap snap_param"):
        ops.sgd_step_into_(p, None, p[:nd], None, g, mask, BS, lr=0.1)


@pytest.mark.parametrize("device,dtype,case", grid(DEVICES, DTYPES, range(len(ADAM_CASES))))
def test_adam_step_matches_torch_optim(device, dtype, case):
    cls, kw = ADAM_CASES[case]
    n = 4099
    p_ref = torch.nn.Parameter(rand(n, dtype, device))
    opt = getattr(torch.optim, cls)([p_ref], foreach=False, **kw)
    p = p_ref.detach().clone()
    ea, es, mx = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
    beta1, beta2 = kw.get("betas", (0.9, 0.999))
    wd = kw.get("weight_decay", 1e-2 if cls == "AdamW" else 0.0)
    amsgrad = kw.get("amsgrad", False)
    for step in range(1, STEPS + 1):
        g = rand(n, dtype, device, seed=200 + step)
        p_ref.grad = g.clone()
        opt.step()
        ops.adam_step_(p, g, ea, es, mx if amsgrad else None, step=step, lr=kw["lr"], beta1=beta1,
                       beta2=beta2, eps=kw.get("eps", 1e-8), weight_decay=wd, amsgrad=amsgrad,
                       maximize=kw.get("maximize", False), decoupled=cls == "AdamW")
        st = opt.state[p_ref]
        ours = [p, ea, es] + ([mx] if amsgrad else [])
        theirs = [p_ref.detach(), st["exp_avg"], st["exp_avg_sq"]] + (
            [st["max_exp_avg_sq"]] if amsgrad else [])
        # bitwise on a CPU with FMA in fp32: the kernel takes torch's own sqrt (MKL's, not correctly rounded)
        assert_steps_match(ours, theirs, dtype, exact=device == "cpu" and dtype == torch.float32 and CPU_HAS_FMA)


@pytest.mark.skipif(not CPU_HAS_FMA, reason="ATen's CPU kernels use fused multiply-adds with AVX2/AVX512 only")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("n", [8191, 3 * 8192 + 5, 100003])
@pytest.mark.parametrize("case", range(len(ADAM_CASES)))
def test_adam_step_bitwise_across_pieces_and_threads(case, n, threads):
    """The CPU kernel runs over pieces of 8192 elements (torch's sqrt on each, and the update of one
    piece in a loop with the second moment of the next), in parallel: bitwise torch.optim (fp32) at any
    length and thread count, also where the square root of an element holds a nan or an inf."""
    cls, kw = ADAM_CASES[case]
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        p_ref = torch.nn.Parameter(rand(n, torch.float32, "cpu"))
        opt = getattr(torch.optim, cls)([p_ref], foreach=False, **kw)
        p = p_ref.detach().clone()
        ea, es, mx = torch.zeros_like(p), torch.zeros_like(p), torch.zeros_like(p)
        beta1, beta2 = kw.get("betas", (0.9, 0.999))
        wd = kw.get("weight_decay", 1e-2 if cls == "AdamW" else 0.0)
        amsgrad = kw.get("amsgrad", False)
        for step in range(1, 4):
            g = rand(n, torch.float32, "cpu", seed=300 + step) * (1e-9 if step == 2 else 1.0)
            if step == 3:
                g[[5, n // 2, n - 1]] = torch.tensor([float("nan"), float("inf"), float("-inf")])
            p_ref.grad = g.clone()
            opt.step()
            ops.adam_step_(p, g, ea, es, mx if amsgrad else None, step=step, lr=kw["lr"], beta1=beta1,
                           beta2=beta2, eps=kw.get("eps", 1e-8), weight_decay=wd, amsgrad=amsgrad,
                           maximize=kw.get("maximize", False), decoupled=cls == "AdamW")
            st = opt.state[p_ref]
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), [p, ea, es, mx],
                                  [p_ref.detach(), st["exp_avg"], st["exp_avg_sq"], st.get("max_exp_avg_sq")]):
                if b is None:
                    continue
                same = (a == b) | (a.isnan() & b.isnan())
                assert bool(same.all()), f"step {step}: {name} differs in {int((~same).sum())} elements"
    finally:
        torch.set_num_threads(prev)


def test_reference_fallback_matches_kernels():
    """The pure-PyTorch references agree with the kernels on one mixed case (the fallback path)."""
    n = 11 * BS + 7
    flat = rand(n, torch.float32, "cpu")
    ids = torch.tensor([10, 2, 11, 5])
    a = ops.pack_blocks(flat, ids, BS)
    b = ops.ref_pack_blocks(flat, ids, BS, torch.empty_like(a))
    assert torch.equal(a, b)
    mask = torch.tensor([1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 0, 0], dtype=torch.bool)
    nd = ops.mask_numels(n, mask, BS)[1]
    snap, snap_m, g = (rand(nd, torch.float32, "cpu", seed=s) for s in (1, 2, 3))
    outs = []
    for fn in (ops.sgd_step_into_, ops.ref_sgd_step_into_):
        p, m = flat.clone(), flat.clone()
        fn(p, m, snap, snap_m, g, mask, BS, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-2)
        outs.append((p, m))
    assert_steps_match(outs[0], outs[1], torch.float32, exact=CPU_HAS_FMA)


@pytest.mark.parametrize("device", ["cpu"] + (["cuda"] if torch.cuda.is_available() else []))
def test_packed_lengths_checked_on_the_host(device):
    """Where the caller knows how many blocks are deferred, the wrappers check the packed buffers' lengths
    on the host, on every device and without a sync (the CUDA kernels stop at a buffer's end instead of
    raising, so a sizing bug would leave blocks silently unpacked or uncorrected there)."""
    flat = torch.zeros(64, device=device)
    mask = torch.tensor([True, False, True, False], device=device)
    crit, short = torch.empty(32, device=device), torch.empty(16, device=device)
    with pytest.raises(RuntimeError, match="deferred buffer must hold 2 blocks of 16"):
        ops.split_blocks(flat, mask, 16, crit, short, deferred_blocks=2)
    with pytest.raises(RuntimeError, match="critical buffer must hold 3 blocks"):
        ops.merge_blocks(crit, None, mask, 16, flat, deferred_blocks=1)
    with pytest.raises(RuntimeError, match="sgd_step_into_: the deferred buffer must hold 2 blocks"):
        ops.sgd_step_into_(flat, None, short, None, short, mask, 16, lr=0.1, deferred_blocks=2)
    ops.split_blocks(flat, mask, 16, crit, torch.empty(32, device=device), deferred_blocks=2)  # right lengths pass


# ------------------------------------------------------------------------------------------------
# Mask positions, block shapes across the CUDA launch shapes (csrc/launch.h), huge block sizes.

HUGE = 2**63 - 1
# (n, bs), each with a short last block: a thread per block, thread groups of 2 to 128 threads, a CTA per
# block, several chunks (CTAs) per block, one huge block, a block size past any int32 (launch.h's shapes)
SHAPES = [(1000, 1), (1001, 3), (5000, 17), (3 * 33 + 5, 33), (1003, 100), (2007, 200), (3 * 500 + 1, 500),
          (4 * 1000 + 7, 1000), (4 * 2000 + 3, 2000), (2 * 4000 + 9, 4000), (3 * 5000 + 17, 5000),
          (2 * 12288 + 5, 12288), (20000, 20000), (20001, HUGE), (9000, 2**40)]


def _masks(nb, seed):
    g = torch.Generator().manual_seed(seed)
    ms = [torch.rand(nb, generator=g) < 0.4, torch.zeros(nb, dtype=torch.bool), torch.ones(nb, dtype=torch.bool)]
    if nb > 1:
        last = torch.zeros(nb, dtype=torch.bool)
        last[-1] = True
        ms.append(last)
    return ms


@pytest.mark.parametrize("device", grid(DEVICES))
def test_mask_positions(device):
    m = torch.tensor([True, False, True, True, False, False, True], device=device)
    want = torch.tensor([0, 1, 1, 2, 3, 3, 3], device=device)
    assert torch.equal(ops.mask_positions(m), want) and ops.mask_positions(m).dtype == torch.int64
    m8 = torch.tensor([2, 0, 1, 255, 0, 0, 7], dtype=torch.uint8, device=device)
    assert torch.equal(ops.mask_positions(m8), want)
    assert ops.mask_positions(m[:0]).shape == (0,)
    with pytest.raises(RuntimeError, match="mask must be bool or uint8, got torch.float32"):
        ops.mask_positions(m.float())


@pytest.mark.parametrize("device,dtype", grid(DEVICES, DTYPES))
def test_positions_give_the_same_results(device, dtype):
    """split/merge/sgd_step_into_ with the mask's positions (whole, or sliced like the mask, as the
    buckets pass them) give bitwise what they give computing the positions themselves."""
    bs, nb = 16, 23
    n = nb * bs
    flat = rand(n, dtype, device)
    for mi, full in enumerate(_masks(nb, 7)):
        for kind in ("bool", "uint8"):
            mask = (full.to(torch.uint8) * 3 if kind == "uint8" else full).to(device)
            pos = ops.mask_positions(mask)
            for a, b in ((0, nb), (0, 5), (5, 17), (17, nb), (nb - 1, nb)):
                part, m, p = flat[a * bs:b * bs], mask[a:b], pos[a:b]
                nc, nd = ops.mask_numels(part.numel(), m, bs)
                c, d = ops.split_blocks(part, m, bs)
                c2, d2 = poison(flat.new_empty(nc)), poison(flat.new_empty(nd))
                ops.split_blocks(part, m, bs, c2, d2, positions=p)
                assert torch.equal(c, c2) and torch.equal(d, d2), (mi, kind, a, b)
                back = poison(torch.empty_like(part))
                ops.merge_blocks(c2, d2, m, bs, back, positions=p)
                assert torch.equal(back, part), (mi, kind, a, b)
                snap, g = rand(nd, dtype, device, seed=1), rand(nd, dtype, device, seed=2)
                outs = []
                for kw in ({}, {"positions": p}):
                    q, mb = part.clone(), part.clone()
                    ops.sgd_step_into_(q, mb, snap, snap.clone(), g, m, bs, lr=0.1, momentum=0.9, **kw)
                    outs.append((q, mb))
                assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1]), (mi, kind, a, b)


@pytest.mark.parametrize("device", grid(DEVICES))
def test_bad_positions_are_a_clear_error(device):
    bs, nb = 8, 6
    flat = rand(nb * bs, torch.float32, device)
    mask = torch.tensor([True, False, True, False, False, True], device=device)
    pos = ops.mask_positions(mask)
    c, d = ops.split_blocks(flat, mask, bs)
    with pytest.raises(RuntimeError, match="positions must be int64, got Int"):
        ops.split_blocks(flat, mask, bs, c, d, positions=pos.int())
    with pytest.raises(RuntimeError, match=r"positions must have one entry per block like the mask \(6\)"):
        ops.merge_blocks(c, d, mask, bs, flat.clone(), positions=pos[1:])
    with pytest.raises(RuntimeError, match="positions must be contiguous"):
        ops.split_blocks(flat, mask, bs, c, d, positions=torch.stack([pos, pos], 1)[:, 0])
    if device == "cpu":  # the CPU checks the values; the CUDA kernels skip impossible positions
        with pytest.raises(RuntimeError, match="positions do not match the mask: 1 blocks are selected before block 1"):
            ops.split_blocks(flat, mask, bs, c, d, positions=torch.zeros(nb, dtype=torch.int64))
        with pytest.raises(RuntimeError, match="positions do not match the mask"):  # sliced unlike the mask
            ops.merge_blocks(None, d[:2 * bs], mask[3:], bs, flat[3 * bs:].clone(), positions=pos[2:5])
        with pytest.raises(RuntimeError, match="positions do not match the mask"):
            ops.sgd_step_into_(flat.clone(), None, d, None, d.clone(), mask, bs, lr=0.1, positions=pos.flip(0))


@pytest.mark.parametrize("device", grid(DEVICES))
def test_opcheck_with_positions(device):
    n, bs = 7 * BS + 3, BS
    flat = rand(n, torch.float32, device)
    mask = torch.tensor([1, 0, 0, 1, 0, 1, 0, 1], dtype=torch.bool, device=device)
    pos = ops.mask_positions(mask)
    nc, nd = ops.mask_numels(n, mask, BS)
    cases = [
        (torch.ops.osp.split_blocks.default, (flat, mask, bs, flat.new_empty(nc), flat.new_empty(nd), pos)),
        (torch.ops.osp.merge_blocks.default, (flat[:nc].clone(), flat[:nd].clone(), mask, bs, flat.clone(), pos)),
        (torch.ops.osp.sgd_step_into_.default,
         (flat.clone(), flat.clone(), flat[:nd].clone(), flat[:nd].clone(), flat[:nd].clone(), mask, bs, 0.1, 0.9,
          0.0, 0.0, False, False, False, pos)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args)


@pytest.mark.parametrize("device,dtype", grid(DEVICES, DTYPES))
def test_block_shapes_match_the_reference(device, dtype):
    """Every block kernel on sizes that take each launch shape (a thread per block, thread groups, a CTA
    per block, several CTAs per block with a short last block, one huge block): the same as the
    references; scores: max exactly, sums to tolerance, and bitwise the same on a second run."""
    for n, bs in SHAPES:
        flat = rand(n, dtype, device, seed=n)
        w = rand(n, dtype, device, seed=n + 1)
        nb = ops.num_blocks(n, bs)
        for metric in METRICS:
            scores, nf = ops.score_blocks(flat, bs, metric, param=w)
            ref, _ = ops.ref_score_blocks(flat, min(bs, n), metric, param=w)  # its padding: bs <= n
            assert scores.shape == (nb,) and int(nf) == 0, (n, bs, metric)
            if metric == "max":
                assert torch.equal(scores, ref), (n, bs)
            else:
                torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-4)
            assert torch.equal(scores, ops.score_blocks(flat, bs, metric, param=w)[0]), (n, bs, metric)
        for mask in _masks(nb, n):
            mask = mask.to(device)
            nc, nd = ops.mask_numels(n, mask, bs)
            rc, rd = flat.new_empty(nc), flat.new_empty(nd)
            ops.ref_split_blocks(flat, mask, bs, rc, rd)
            c, d = poison(flat.new_empty(nc)), poison(flat.new_empty(nd))
            ops.split_blocks(flat, mask, bs, c, d, positions=ops.mask_positions(mask))
            assert torch.equal(c, rc) and torch.equal(d, rd), (n, bs)
            back = poison(torch.empty_like(flat))
            ops.merge_blocks(c, d, mask, bs, back)
            assert torch.equal(back, flat), (n, bs)
            ids = mask.nonzero().flatten().flip(0)
            packed = ops.pack_blocks(flat, ids, bs)
            assert torch.equal(packed, ops.ref_pack_blocks(flat, ids, bs, torch.empty_like(packed))), (n, bs)
            acc, expect = flat.clone(), flat.clone()
            ops.unpack_blocks(packed, ids, bs, acc, accumulate=True)
            ops.ref_unpack_blocks(packed, ids, bs, expect, accumulate=True)
            assert torch.equal(acc, expect), (n, bs)
            snap, g = rand(nd, dtype, device, seed=3), rand(nd, dtype, device, seed=4)
            p, m = flat.clone(), flat.clone()
            ops.sgd_step_into_(p, m, snap, snap.clone(), g, mask, bs, lr=0.1, momentum=0.9)
            rp, rm = snap.clone(), snap.clone()
            ops.sgd_step_(rp, g, rm, lr=0.1, momentum=0.9)
            p_ref, m_ref = flat.clone(), flat.clone()
            ops.merge_blocks(None, rp, mask, bs, p_ref)
            ops.merge_blocks(None, rm, mask, bs, m_ref)
            assert torch.equal(p, p_ref) and torch.equal(m, m_ref), (n, bs)


@pytest.mark.parametrize("device", grid(DEVICES))
def test_huge_block_size_in_every_kernel(device):
    """bs = 2**63 - 1 is one block in every kernel (a kernel recomputing (n + bs - 1) / bs would see none
    and write nothing, or leave the scores uninitialised)."""
    n = 9 * 4096 + 5
    flat = rand(n, torch.float32, device)
    for bs in (2**40, 2**62, HUGE):
        assert torch.equal(ops.score_blocks(flat, bs, "max")[0], flat.abs().max().reshape(1))
        _, nf = ops.score_blocks(torch.cat([flat, flat.new_full((1,), float("inf"))]), bs)
        assert int(nf) == 1
        one = torch.zeros(1, dtype=torch.int64, device=device)
        assert torch.equal(ops.pack_blocks(flat, one, bs), flat)
        target = poison(torch.empty_like(flat))
        ops.unpack_blocks(flat, one, bs, target)
        assert torch.equal(target, flat)
        for sel in (True, False):
            mask = torch.tensor([sel], device=device)
            c, d = ops.split_blocks(flat, mask, bs, positions=ops.mask_positions(mask))
            assert torch.equal(c if sel else d, flat)
            back = poison(torch.empty_like(flat))
            ops.merge_blocks(c, d, mask, bs, back)
            assert torch.equal(back, flat)
        p = poison(torch.empty_like(flat))
        ops.sgd_step_into_(p, None, flat, None, torch.zeros_like(flat), torch.tensor([False], device=device), bs,
                           lr=0.1)
        assert torch.equal(p, flat)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_mixed_devices_name_the_argument():
    """A tensor on the wrong device, even one this call does not read, is named before any device guard."""
    flat = torch.randn(4 * BS)
    mask = torch.tensor([True, False, True, False])
    with pytest.raises(RuntimeError, match="param must be on cpu like grad, got cuda"):
        torch.ops.osp.score_blocks(flat, flat.cuda(), BS, 0, 1e-8)
    with pytest.raises(RuntimeError, match="momentum_buffer must be on cpu like param, got cuda"):
        ops.sgd_step_(flat, flat.clone(), flat.cuda(), lr=0.1)
    with pytest.raises(RuntimeError, match="positions must be on cpu like flat, got cuda"):
        ops.split_blocks(flat, mask, BS, flat.new_empty(2 * BS), None, positions=ops.mask_positions(mask).cuda())
    with pytest.raises(RuntimeError, match="out must be on cuda:0 like flat, got cpu"):
        torch.ops.osp.pack_blocks(flat.cuda(), torch.tensor([0], device="cuda"), BS, flat[:BS].clone())
