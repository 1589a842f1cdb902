"""What only a GPU can show (`make gpu-check` runs this file): the CUDA kernels bitwise equal to the CPU
kernels in fp32 on odd sizes and block sizes; one block of the whole tensor (``block_size=2**63 - 1``) in
memory the caching allocator left full of NaN; the steady-state ops, and whole steps of every mode after
warm-up, without a host sync (a step's one allowed read is ``osp.agreement.read``); whole steps of every
mode on one CUDA rank (OneRankComm, Gloo, NCCL) equal to the plain optimizer.

Every test skips, saying why, where torch sees no CUDA device. Where it does, a build of osp._C without
its CUDA kernels is a failure, not a skip."""
from __future__ import annotations

import contextlib
import sys

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_optimizer import OneRankComm, tiny_model

import osp
from osp import ops


def _no_cuda_reason():
    if torch.version.cuda is None:
        return f"no CUDA: torch {torch.__version__} is built without CUDA"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    return None


NO_CUDA = _no_cuda_reason()
pytestmark = pytest.mark.skipif(NO_CUDA is not None, reason=NO_CUDA or "")


@pytest.fixture(autouse=True)
def _cuda_kernels_built():
    assert ops.HAS_EXTENSION and ops._CUDA_BUILT, (
        "osp._C has no CUDA kernels (torch.ops.osp has none registered for CUDA): rebuild it with FORCE_CUDA=1 "
        "and nvcc on PATH (make gpu-check does)")


SIZES = [1, 17, 1000003]
BLOCKS = [1, 7, 4096, 65537]
HUGE = 2 ** 63 - 1  # one block, whatever the size; block arithmetic in int64 must not overflow
METRICS = ["l2", "l1", "max", "relative"]
NAN = float("nan")


def rand(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, generator=g)


def random_mask(nb, seed, kind="random"):
    if kind == "none":
        return torch.zeros(nb, dtype=torch.bool)
    if kind == "all":
        return torch.ones(nb, dtype=torch.bool)
    g = torch.Generator().manual_seed(seed)
    return torch.rand(nb, generator=g) < 0.4


def random_ids(nb, seed):
    """A third of the blocks (at least one), in random order."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(nb, generator=g)[:max(1, nb // 3)]


def nan_like(t):
    return torch.full_like(t, NAN)


def assert_bitwise(got, want, what):
    """``got`` (on the GPU) holds bit for bit what ``want`` (on the CPU) holds; NaN payloads included."""
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, f"{what}: {got.shape} {got.dtype} != " \
                                                                f"{want.shape} {want.dtype}"
    diff = got.view(torch.int32) != want.view(torch.int32)
    if bool(diff.any()):
        i = int(diff.nonzero()[0])
        pytest.fail(f"{what}: {int(diff.sum())} of {want.numel()} elements differ, the first at {i}: "
                    f"{got[i].item()!r} on CUDA, {want[i].item()!r} on the CPU")


def assert_adam_param(got, want, what):
    """Adam's parameter: the CPU kernel takes torch's CPU sqrt (MKL's, not correctly rounded: about 0.65% of
    values 1 ulp off), CUDA's sqrt is correctly rounded; the parameter may differ by one ulp of its denominator,
    so at most 1 ulp of the update's scale (its moments must be bitwise, ``assert_bitwise``)."""
    got = got.cpu()
    assert got.shape == want.shape and got.dtype == want.dtype, what
    diff = (got.double() - want.double()).abs()
    bound = 2 * torch.finfo(want.dtype).eps * want.double().abs().clamp(min=1e-3)
    bad = diff > bound
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        pytest.fail(f"{what}: {int(bad.sum())} of {want.numel()} elements beyond 2 ulps, the first at {i}: "
                    f"{got[i].item()!r} on CUDA, {want[i].item()!r} on the CPU")


@contextlib.contextmanager
def sync_errors():
    """Any host sync inside raises (torch.cuda.set_sync_debug_mode("error")); the work queued before is
    finished first, so only the syncs of the body count."""
    torch.cuda.synchronize()
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(prev)


def test_sync_debug_mode_catches_a_sync():
    """The sync tests below can fail: a plain .item() inside sync_errors() raises."""
    t = torch.ones(1, device="cuda")
    with pytest.raises(RuntimeError, match="synchroniz"):
        with sync_errors():
            t.item()


# -- the kernels against the CPU kernels, fp32 -----------------------------------------------------


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_score_blocks_match_cpu(n, bs, metric):
    """max bitwise; the sums to a relative 1e-5 (another summation order); two runs bitwise equal."""
    g, w = rand(n, 1), rand(n, 2)
    param = w if metric == "relative" else None
    want, want_nf = ops.score_blocks(g, bs, metric, param=param)
    gc, wc = g.cuda(), (w.cuda() if param is not None else None)
    got, got_nf = ops.score_blocks(gc, bs, metric, param=wc)
    again, again_nf = ops.score_blocks(gc, bs, metric, param=wc)
    assert got.device.type == "cuda" and got_nf.device.type == "cuda"
    assert_bitwise(again, got.cpu(), f"score_blocks {metric}: the second run")
    if metric == "max":
        assert_bitwise(got, want, "score_blocks max")
    else:
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=0.0)
    assert int(got_nf) == int(again_nf) == int(want_nf) == 0


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), NAN], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_score_blocks_flag_nonfinite(n, bs, bad):
    """The flag is set wherever the bad element sits (first, middle, last); the other blocks' scores are
    untouched by it."""
    for at in sorted({0, n // 2, n - 1}):
        g = rand(n, 3)
        g[at] = bad
        for metric in ("l2", "max"):
            want, want_nf = ops.score_blocks(g, bs, metric)
            got, got_nf = ops.score_blocks(g.cuda(), bs, metric)
            assert int(got_nf) == int(want_nf) == 1, f"{metric}: element {at} = {bad} not flagged"
            keep = torch.ones(want.numel(), dtype=torch.bool)
            keep[at // bs] = False  # the bad block's score: NaN order of max() and inf sums differ by design
            if metric == "max":
                assert_bitwise(got[keep.cuda()], want[keep], "score_blocks max, the finite blocks")
            else:
                torch.testing.assert_close(got.cpu()[keep], want[keep], rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("kind", ["random", "none", "all"])
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_split_blocks_match_cpu(n, bs, kind):
    flat = rand(n, 4)
    mask = random_mask(ops.num_blocks(n, bs), 5, kind)
    nc, nd = ops.mask_numels(n, mask, bs)
    for sides in ("both", "critical", "deferred"):
        want_c = torch.full((nc,), NAN) if sides != "deferred" else None
        want_d = torch.full((nd,), NAN) if sides != "critical" else None
        got_c = None if want_c is None else want_c.cuda()
        got_d = None if want_d is None else want_d.cuda()
        ops.split_blocks(flat, mask, bs, want_c, want_d)
        ops.split_blocks(flat.cuda(), mask.cuda(), bs, got_c, got_d)
        if got_c is not None:
            assert_bitwise(got_c, want_c, f"split_blocks ({sides}): critical")
        if got_d is not None:
            assert_bitwise(got_d, want_d, f"split_blocks ({sides}): deferred")


@pytest.mark.parametrize("kind", ["random", "none", "all"])
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_merge_blocks_match_cpu(n, bs, kind):
    mask = random_mask(ops.num_blocks(n, bs), 6, kind)
    nc, nd = ops.mask_numels(n, mask, bs)
    crit, deff = rand(nc, 7), rand(nd, 8)
    for sides in ("both", "critical", "deferred"):
        c = crit if sides != "deferred" else None
        d = deff if sides != "critical" else None
        want = rand(n, 9)  # a side left out must be left as it was
        got = want.cuda()
        ops.merge_blocks(c, d, mask, bs, want)
        ops.merge_blocks(None if c is None else c.cuda(), None if d is None else d.cuda(), mask.cuda(), bs, got)
        assert_bitwise(got, want, f"merge_blocks ({sides})")


@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_pack_blocks_match_cpu(n, bs):
    flat = rand(n, 10)
    ids = random_ids(ops.num_blocks(n, bs), 11)
    k = ops.packed_numel(n, ids, bs)
    want = ops.pack_blocks(flat, ids, bs, out=torch.full((k,), NAN))
    got = ops.pack_blocks(flat.cuda(), ids.cuda(), bs, out=torch.full((k,), NAN, device="cuda"))
    assert_bitwise(got, want, "pack_blocks")


@pytest.mark.parametrize("accumulate", [False, True], ids=["copy", "accumulate"])
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_unpack_blocks_match_cpu(n, bs, accumulate):
    ids = random_ids(ops.num_blocks(n, bs), 12)
    buf = rand(ops.packed_numel(n, ids, bs), 13)
    want = rand(n, 14)
    got = want.cuda()
    ops.unpack_blocks(buf, ids, bs, want, accumulate=accumulate)
    ops.unpack_blocks(buf.cuda(), ids.cuda(), bs, got, accumulate=accumulate)
    assert_bitwise(got, want, f"unpack_blocks (accumulate={accumulate})")


SGD = {
    "plain": dict(lr=0.1),
    "weight-decay": dict(lr=0.1, weight_decay=1e-2),
    "momentum": dict(lr=0.1, momentum=0.9),
    "momentum-dampening-wd": dict(lr=0.05, momentum=0.9, dampening=0.2, weight_decay=1e-2),
    "nesterov-wd-maximize": dict(lr=0.05, momentum=0.8, nesterov=True, weight_decay=5e-3, maximize=True),
}
ADAM = {
    "adam": dict(lr=1e-3),
    "adam-wd-betas": dict(lr=1e-2, beta1=0.3, beta2=0.9, weight_decay=1e-2),  # lerp weight >= 0.5
    "adamw": dict(lr=1e-3, weight_decay=1e-2, decoupled=True),
    "amsgrad": dict(lr=1e-3, weight_decay=1e-3, amsgrad=True),
    "adamw-amsgrad-maximize": dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True, decoupled=True),
}


@pytest.mark.parametrize("variant", SGD)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_step_matches_cpu(n, variant):
    kw = SGD[variant]
    has_m = "momentum" in kw
    p, m = rand(n, 20), torch.zeros(n)
    pc, mc = p.cuda(), m.cuda()
    for step in range(3):
        g = rand(n, 21 + step)
        ops.sgd_step_(p, g, m if has_m else None, first=step == 0, **kw)
        ops.sgd_step_(pc, g.cuda(), mc if has_m else None, first=step == 0, **kw)
        assert_bitwise(pc, p, f"sgd_step_ {variant} step {step}: param")
        assert_bitwise(mc, m, f"sgd_step_ {variant} step {step}: momentum")


@pytest.mark.parametrize("variant", ADAM)
@pytest.mark.parametrize("n", SIZES)
def test_adam_step_matches_cpu(n, variant):
    kw = ADAM[variant]
    cpu = [rand(n, 30), torch.zeros(n), torch.zeros(n), torch.zeros(n)]
    gpu = [t.cuda() for t in cpu]
    for step in range(1, 4):
        g = rand(n, 31 + step)
        for (p, ea, es, mx), grad in ((cpu, g), (gpu, g.cuda())):
            ops.adam_step_(p, grad, ea, es, mx if kw.get("amsgrad") else None, step=step, **kw)
        for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), gpu, cpu):
            same = assert_adam_param if name == "param" else assert_bitwise
            same(a, b, f"adam_step_ {variant} step {step}: {name}")
            b.copy_(a.cpu())  # the next step from the same point on both


@pytest.mark.parametrize("variant", SGD)
@pytest.mark.parametrize("bs", BLOCKS)
@pytest.mark.parametrize("n", SIZES)
def test_sgd_step_into_matches_cpu(n, bs, variant):
    kw = SGD[variant]
    has_m = "momentum" in kw
    mask = random_mask(ops.num_blocks(n, bs), 40)
    nd = ops.mask_numels(n, mask, bs)[1]
    p, m = rand(n, 41), rand(n, 42)
    pc, mc, maskc = p.cuda(), m.cuda(), mask.cuda()
    for step in range(2):
        first = step == 0
        snap_p, snap_m, g = rand(nd, 43 + step), rand(nd, 45 + step), rand(nd, 47 + step)
        ops.sgd_step_into_(p, m if has_m else None, snap_p, None if first else snap_m, g, mask, bs,
                           first=first, **kw)
        ops.sgd_step_into_(pc, mc if has_m else None, snap_p.cuda(), None if first else snap_m.cuda(), g.cuda(),
                           maskc, bs, first=first, **kw)
        assert_bitwise(pc, p, f"sgd_step_into_ {variant} step {step}: param")
        assert_bitwise(mc, m, f"sgd_step_into_ {variant} step {step}: momentum")


# -- one block of the whole tensor, in memory full of NaN ------------------------------------------


@pytest.fixture
def nan_memory():
    """Leave the caching allocator's free blocks full of NaN (without emptying its cache), so that
    whatever the kernels allocate next (at::empty, a workspace) starts as NaN instead of zeros."""
    torch.cuda.synchronize()
    junk = [torch.empty(512 << 20, dtype=torch.uint8, device="cuda")]  # one big block of the large pool
    junk += [torch.empty(8 << 20, dtype=torch.uint8, device="cuda") for _ in range(8)]  # 20 MiB segments
    junk += [torch.empty(1 << 20, dtype=torch.uint8, device="cuda") for _ in range(32)]  # the small pool
    junk += [torch.empty(s, dtype=torch.uint8, device="cuda") for s in (512, 4096, 65536) for _ in range(16)]
    for t in junk:
        t.view(torch.float32).fill_(NAN)
    torch.cuda.synchronize()
    del junk, t
    yield


HUGE_SIZES = [17, 3000017]  # one CTA's worth, and many CTAs' worth


def _fp64_score(g, metric, w):
    g = g.double()
    if metric == "l2":
        return (g * g).sum()
    if metric == "l1":
        return g.abs().sum()
    if metric == "max":
        return g.abs().max()
    return (g.abs() / (w.double().abs() + 1e-8)).sum()


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("n", HUGE_SIZES)
def test_score_blocks_one_huge_block(nan_memory, n, metric):
    g, w = rand(n, 50), rand(n, 51).abs() + 0.1  # |w| away from 0: relative terms of one magnitude
    param = w if metric == "relative" else None
    gc, wc = g.cuda(), (w.cuda() if param is not None else None)
    got, nf = ops.score_blocks(gc, HUGE, metric, param=wc)
    again, _ = ops.score_blocks(gc, HUGE, metric, param=wc)
    assert got.shape == (1,) and int(nf) == 0
    assert_bitwise(again, got.cpu(), f"score_blocks {metric}, one block: the second run")
    if metric == "max":
        assert_bitwise(got, ops.score_blocks(g, HUGE, metric)[0], "score_blocks max, one block")
    # against the exact sum: 3M fp32 terms in any order are within about 1e-5 of it (the CPU kernel's 16
    # lanes 4e-5); a CTA's partial sum missing or NaN would be 1e-3 or more off
    torch.testing.assert_close(got.cpu().double()[0], _fp64_score(g, metric, w), rtol=1e-4, atol=0.0)
    gc[n // 2] = float("inf")
    assert int(ops.score_blocks(gc, HUGE, metric, param=wc)[1]) == 1


@pytest.mark.parametrize("n", HUGE_SIZES)
def test_split_and_merge_one_huge_block(nan_memory, n):
    flat = rand(n, 52)
    fc = flat.cuda()
    for selected in (True, False):
        mask = torch.tensor([selected], device="cuda")
        crit, deff = (torch.full((n if s else 0,), NAN, device="cuda") for s in (selected, not selected))
        ops.split_blocks(fc, mask, HUGE, crit, deff)
        assert_bitwise(crit if selected else deff, flat, f"split_blocks, one block (selected={selected})")
        back = torch.full((n,), NAN, device="cuda")
        ops.merge_blocks(crit, deff, mask, HUGE, back)
        assert_bitwise(back, flat, f"merge_blocks, one block (selected={selected})")


@pytest.mark.parametrize("n", HUGE_SIZES)
def test_pack_and_unpack_one_huge_block(nan_memory, n):
    flat = rand(n, 53)
    ids = torch.tensor([0], device="cuda")
    buf = ops.pack_blocks(flat.cuda(), ids, HUGE, out=torch.full((n,), NAN, device="cuda"))
    assert_bitwise(buf, flat, "pack_blocks, one block")
    back = torch.full((n,), NAN, device="cuda")
    ops.unpack_blocks(buf, ids, HUGE, back)
    assert_bitwise(back, flat, "unpack_blocks, one block")


@pytest.mark.parametrize("variant", ["plain", "momentum-dampening-wd"])
@pytest.mark.parametrize("n", HUGE_SIZES)
def test_sgd_step_into_one_huge_block(nan_memory, n, variant):
    """The one block deferred: the whole parameter is the step from the packed inputs, as on the CPU and
    as sgd_step_ on a copy of the packed inputs."""
    kw = SGD[variant]
    has_m = "momentum" in kw
    snap_p, snap_m, g = rand(n, 54), rand(n, 55), rand(n, 56)
    mask = torch.tensor([False])
    for first in (True, False):
        want_p, want_m = torch.full((n,), NAN), torch.full((n,), NAN)
        ops.sgd_step_into_(want_p, want_m if has_m else None, snap_p, None if first else snap_m, g, mask, HUGE,
                           first=first, **kw)
        got_p, got_m = nan_like(want_p).cuda(), nan_like(want_m).cuda()
        ops.sgd_step_into_(got_p, got_m if has_m else None, snap_p.cuda(), None if first else snap_m.cuda(),
                           g.cuda(), mask.cuda(), HUGE, first=first, **kw)
        assert_bitwise(got_p, want_p, f"sgd_step_into_ one block (first={first}): param against the CPU")
        ref_p, ref_m = snap_p.cuda(), snap_m.cuda()
        ops.sgd_step_(ref_p, g.cuda(), ref_m if has_m else None, first=first, **kw)
        assert_bitwise(got_p, ref_p.cpu(), f"sgd_step_into_ one block (first={first}): param against sgd_step_")
        if has_m:
            assert_bitwise(got_m, want_m, f"sgd_step_into_ one block (first={first}): momentum against the CPU")
            assert_bitwise(got_m, ref_m.cpu(), f"sgd_step_into_ one block (first={first}): momentum against "
                                               f"sgd_step_")


# -- the steady-state ops make no host sync -------------------------------------------------------

SYNC_BS = 4096
SYNC_NB = 48


def _sync_case(op):
    """(the call on the GPU, the check of its result against the CPU kernel) for one steady-state op,
    called with what a step has ready: preallocated outputs, the deferred block count and, with
    ":positions", the mask's prefix sum (ops.mask_positions)."""
    n = SYNC_NB * SYNC_BS
    mask = random_mask(SYNC_NB, 60)
    nd_blocks = int((~mask).sum())
    nc, nd = ops.mask_numels(n, mask, SYNC_BS)
    flat, g, w = rand(n, 61), rand(n, 62), rand(n, 63)
    cm, cflat, cg, cw = mask.cuda(), flat.cuda(), g.cuda(), w.cuda()
    op, _, variant = op.partition(":")
    pos = {}
    if variant == "positions":
        if not hasattr(ops, "mask_positions"):
            pytest.skip("this osp.ops has no mask_positions")
        pos = dict(positions=ops.mask_positions(cm))
    if op == "score_blocks":
        metric = variant
        param, cparam = (w, cw) if metric == "relative" else (None, None)
        out = {}

        def call():
            out["s"], out["nf"] = ops.score_blocks(cg, SYNC_BS, metric, param=cparam)

        def check():
            want = ops.score_blocks(g, SYNC_BS, metric, param=param)[0]
            torch.testing.assert_close(out["s"].cpu(), want, rtol=1e-5, atol=0.0)
            assert int(out["nf"]) == 0
        return call, check
    if op == "split_blocks":
        crit, deff = torch.full((nc,), NAN, device="cuda"), torch.full((nd,), NAN, device="cuda")

        def call():
            ops.split_blocks(cflat, cm, SYNC_BS, crit, deff, deferred_blocks=nd_blocks, **pos)

        def check():
            want_c, want_d = ops.split_blocks(flat, mask, SYNC_BS)
            assert_bitwise(crit, want_c, "split_blocks: critical")
            assert_bitwise(deff, want_d, "split_blocks: deferred")
        return call, check
    if op == "merge_blocks":
        crit, deff = rand(nc, 64), rand(nd, 65)
        ccrit, cdeff = crit.cuda(), deff.cuda()
        out = torch.full((n,), NAN, device="cuda")

        def call():
            ops.merge_blocks(ccrit, cdeff, cm, SYNC_BS, out, deferred_blocks=nd_blocks, **pos)

        def check():
            want = torch.full((n,), NAN)
            ops.merge_blocks(crit, deff, mask, SYNC_BS, want)
            assert_bitwise(out, want, "merge_blocks")
        return call, check
    if op == "sgd_step_":
        m = rand(n, 66)
        cm_buf, cflat2 = m.cuda(), cflat.clone()
        kw = SGD["momentum-dampening-wd"]

        def call():
            ops.sgd_step_(cflat2, cg, cm_buf, **kw)

        def check():
            ops.sgd_step_(flat, g, m, **kw)
            assert_bitwise(cflat2, flat, "sgd_step_: param")
            assert_bitwise(cm_buf, m, "sgd_step_: momentum")
        return call, check
    if op == "sgd_step_into_":
        snap_p, snap_m, gd, m = rand(nd, 67), rand(nd, 68), rand(nd, 69), rand(n, 70)
        c_snap_p, c_snap_m, c_gd, c_m, cflat2 = snap_p.cuda(), snap_m.cuda(), gd.cuda(), m.cuda(), cflat.clone()
        kw = SGD["nesterov-wd-maximize"]

        def call():
            ops.sgd_step_into_(cflat2, c_m, c_snap_p, c_snap_m, c_gd, cm, SYNC_BS, deferred_blocks=nd_blocks,
                               **pos, **kw)

        def check():
            ops.sgd_step_into_(flat, m, snap_p, snap_m, gd, mask, SYNC_BS, **kw)
            assert_bitwise(cflat2, flat, "sgd_step_into_: param")
            assert_bitwise(c_m, m, "sgd_step_into_: momentum")
        return call, check
    if op == "adam_step_":
        state = [rand(n, 71).abs(), rand(n, 72).abs(), rand(n, 73).abs()]
        cstate, cflat2 = [t.cuda() for t in state], cflat.clone()
        kw = ADAM["adamw-amsgrad-maximize"]

        def call():
            ops.adam_step_(cflat2, cg, *cstate, step=5, **kw)

        def check():
            ops.adam_step_(flat, g, *state, step=5, **kw)
            for name, a, b in zip(("param", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"), [cflat2] + cstate,
                                  [flat] + state):
                (assert_adam_param if name == "param" else assert_bitwise)(a, b, f"adam_step_: {name}")
        return call, check
    raise AssertionError(op)


SYNC_OPS = [f"score_blocks:{m}" for m in METRICS] + [
    f"{op}{v}" for op in ("split_blocks", "merge_blocks", "sgd_step_into_") for v in ("", ":positions")] + [
    "sgd_step_", "adam_step_"]


@pytest.mark.parametrize("op", SYNC_OPS)
def test_steady_state_op_does_not_sync(op):
    """What a step calls every time, with its outputs preallocated and its deferred block count known,
    queues work without a host sync. (pack_blocks and unpack_blocks check their ids on the device and
    may sync once: they are checked above, outside the debug mode.)"""
    call, check = _sync_case(op)
    call()  # the first call may load the module's kernels
    call, check = _sync_case(op)
    with sync_errors():
        call()
    torch.cuda.synchronize()
    check()


# -- whole steps on one CUDA rank --------------------------------------------------------------------

MODES = {
    "bsp": lambda: osp.BSP(),
    "osp-0.3": lambda: osp.OSP(critical=0.3, block_size=64),
    "osp-auto": lambda: osp.OSP(critical="auto", warmup=1, block_size=64),
    "dsync-2": lambda: osp.DSync(delay=2),
    "hsp": lambda: osp.HSP(),
}
OPTIMIZERS = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
}
STEPS = 8


@contextlib.contextmanager
def engine(kind):
    """The backend osp gets: OneRankComm (no engine at all), or a real one-rank torch.distributed group in
    this process, with Gloo (which allreduces CUDA tensors through host memory) or NCCL."""
    if kind == "one-rank":
        yield OneRankComm()
        return
    if kind == "nccl" and not dist.is_nccl_available():
        pytest.skip(f"torch {torch.__version__} has no NCCL")
    torch.cuda.set_device(0)
    dist.init_process_group(kind, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield "torch"
    finally:
        dist.destroy_process_group()


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, 12, generator=g).cuda(), torch.randn(8, 5, generator=g).cuda()) for _ in range(n)]


def one_step(model, opt, x, y):
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def state_of(opt, model):
    out = []
    for name, p in model.named_parameters():
        for k, v in sorted(opt.state[p].items()):
            out.append((f"{name}.{k}", (v if torch.is_tensor(v) else torch.tensor(float(v))).detach().float().cpu()))
    return out


@pytest.mark.parametrize("kind", ["one-rank", "gloo", "nccl"])
@pytest.mark.parametrize("oname", OPTIMIZERS)
@pytest.mark.parametrize("mname", MODES)
def test_one_rank_steps_equal_the_plain_optimizer(mname, oname, kind):
    """With one rank every average is the rank's own gradient: osp must equal plain torch.optim after every
    step and, after flush(), in parameters and state. To float tolerance, not bitwise: torch's CUDA
    optimizers run foreach and fused kernels, osp's corrections the single-tensor order (a bug is of the
    size of an update, lr * grad, orders of magnitude above the bound)."""
    data = batches(STEPS)
    plain_model = tiny_model().cuda()
    plain = OPTIMIZERS[oname](plain_model.parameters())
    want = []
    for x, y in data:
        one_step(plain_model, plain, x, y)
        want.append([p.detach().clone() for p in plain_model.parameters()])
    model = tiny_model().cuda()
    with engine(kind) as backend:
        opt = osp.DistributedOptimizer(OPTIMIZERS[oname](model.parameters()), model.named_parameters(),
                                       sync=MODES[mname](), backend=backend)
        for t, (x, y) in enumerate(data):
            one_step(model, opt, x, y)
            for i, (p, q) in enumerate(zip(model.parameters(), want[t])):
                torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, t=t, i=i: f"after step {t}, parameter {i}: {m}")
        opt.flush()
        torch.cuda.synchronize()
    got_state, want_state = state_of(opt, model), state_of(plain, plain_model)
    assert [k for k, _ in got_state] == [k for k, _ in want_state]
    for (k, a), (_, b) in zip(got_state, want_state):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"after flush, {k}: {m}")
    for i, (p, q) in enumerate(zip(model.parameters(), plain_model.parameters())):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m, i=i: f"after flush, parameter {i}: {m}")


class CountedRead:
    """osp.agreement.read with the sync debug mode off around it (the step's one documented host read), and
    its calls counted."""

    def __init__(self, real):
        self.real, self.calls = real, 0

    def __call__(self, t):
        self.calls += 1
        prev = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("default")
        try:
            return self.real(t)
        finally:
            torch.cuda.set_sync_debug_mode(prev)


def allow_agreement_reads(monkeypatch):
    """Patch osp.agreement.read wherever a module of osp holds it, under any name (``from ..agreement import
    read`` binds the function in the importing module too)."""
    real = osp.agreement.read
    counted = CountedRead(real)
    for name, mod in list(sys.modules.items()):
        if mod is not None and (name == "osp" or name.startswith("osp.")):
            for attr, value in list(vars(mod).items()):
                if value is real:
                    monkeypatch.setattr(mod, attr, counted)
    return counted


WARMUP, STEADY = 3, 4


def steady_steps_without_syncs(model, opt, data, what):
    """The steps of ``data`` under sync_errors(); a sync fails the test, naming the step and the call."""
    for t, (x, y) in enumerate(data):
        try:
            with sync_errors():
                one_step(model, opt, x, y)
        except RuntimeError as e:
            if "synchroniz" not in str(e):
                raise
            raise AssertionError(f"{what}: steady step {t} (after {WARMUP} warm-up steps) made a host sync "
                                 f"outside osp.agreement.read (the traceback below shows where): {e}") from e
    torch.cuda.synchronize()


@pytest.mark.parametrize("oname", OPTIMIZERS)
def test_plain_optimizer_steps_do_not_sync(oname):
    """The control for the next test: forward, backward and plain torch.optim's step make no host sync, so
    a sync there is osp's."""
    model = tiny_model().cuda()
    opt = OPTIMIZERS[oname](model.parameters())
    data = batches(WARMUP + STEADY)
    for x, y in data[:WARMUP]:
        one_step(model, opt, x, y)
    steady_steps_without_syncs(model, opt, data[WARMUP:], f"plain {oname}")


@pytest.mark.parametrize("kind", ["one-rank", "nccl"])
@pytest.mark.parametrize("oname", OPTIMIZERS)
@pytest.mark.parametrize("mname", MODES)
def test_steady_steps_sync_only_in_the_agreement_read(mname, oname, kind, monkeypatch, record_property):
    """After 3 warm-up steps, zero_grad, forward, backward and step() of every mode make no host sync except
    osp's documented read of the step's agreement (osp.agreement.read), whose calls are counted (recorded as
    the test's property agreement_reads). Not on Gloo: Gloo moves CUDA tensors through host memory, and its
    work syncs by design."""
    model = tiny_model().cuda()
    data = batches(WARMUP + STEADY)
    with engine(kind) as backend:
        opt = osp.DistributedOptimizer(OPTIMIZERS[oname](model.parameters()), model.named_parameters(),
                                       sync=MODES[mname](), backend=backend)
        reads = allow_agreement_reads(monkeypatch)
        for x, y in data[:WARMUP]:
            one_step(model, opt, x, y)
        reads.calls = 0
        steady_steps_without_syncs(model, opt, data[WARMUP:], f"{mname} {oname} on {kind}")
        record_property("agreement_reads", reads.calls)
        record_property("steady_steps", STEADY)
        opt.flush()
        torch.cuda.synchronize()
