"""Kernel microbenchmark: fused score+split, pack, unpack and the exact Adam/SGD correction, against
a plain copy of the same bytes (torch.clone) and against the PyTorch composition that does the same
job, all measured in the same run. Checks correctness before timing anything.

    python bench/kernels.py [--sizes 1M,4M,16M,64M] [--dtypes float32,float16,bfloat16] [--device cpu]
                            [--peak auto] [--launch-elements 100M] [--report REPORT.json]

Bandwidth counts the bytes a pass must move (read + write). "x clone" is the pass's bandwidth over
the bandwidth of torch.clone of the same tensor (which allocates, as the composition does);
"x copy_" over a copy_ into a buffer allocated beforehand (the memory system's plain streaming
rate); "x torch" is the composition's time over the kernel's time; "x peak" over the device's peak
(on a GPU: 2 x memory clock x bus width from torch.cuda.get_device_properties where torch reports
them, else a copy_ of 1 GiB measured here, the achievable peak; the table says which). Higher is better.

The launch shape (on a GPU, 100M fp32 elements by default): score_blocks and split_blocks with one
block of the whole tensor against blocks of 4096, each against copy_ of the same tensor; a whole-tensor
block must not be one CTA's work. --report writes everything (rows, peak, launch shape, device) as one
JSON object; --json the rows alone, as before.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from osp import ops

BS = 4096
CRIT = 0.25
MIN_TIME = 0.2  # seconds each measurement repeats for at least (--min-time)


def parse_size(s: str) -> int:
    s = s.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1], 1)
    return int(float(s.rstrip("KMG")) * mult)


def timeit(fn, device, reps, min_time=None):
    min_time = MIN_TIME if min_time is None else min_time

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()
    fn()
    sync()
    times = []
    t_end = time.perf_counter() + min_time
    while len(times) < reps or (time.perf_counter() < t_end and len(times) < 50):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def select_mask(scores, k):
    mask = torch.zeros_like(scores, dtype=torch.bool)
    mask[scores.topk(k).indices] = True
    return mask


def fused_score_split(g, k, crit, deff):
    scores, nonfinite = ops.score_blocks(g, BS, "l2")
    mask = select_mask(scores, k)
    ops.split_blocks(g, mask, BS, crit, deff)
    return mask, nonfinite


def torch_score_split(g, k):
    v = g.view(-1, BS)
    scores = v.float().pow(2).sum(1)
    nonfinite = ~torch.isfinite(g).all()
    mask = select_mask(scores, k)
    return mask, nonfinite, v[mask].reshape(-1), v[~mask].reshape(-1)


def torch_adam(p, g, ea, es, step):
    from torch.optim.adam import _single_tensor_adam
    _single_tensor_adam([p], [g], [ea], [es], [], [torch.tensor(float(step - 1))], None, None,
                        amsgrad=False, has_complex=False, beta1=0.9, beta2=0.999, lr=1e-3,
                        weight_decay=0.0, eps=1e-8, maximize=False, capturable=False,
                        differentiable=False, decoupled_weight_decay=False)


def bench_one(n, dtype, device, reps):
    elt = torch.finfo(dtype).bits // 8
    g = torch.randn(n, device=device).to(dtype)
    nb = n // BS
    k = max(1, int(nb * CRIT))
    rows = []
    t_copy = timeit(lambda: g.clone(), device, reps)
    bw_copy = 2 * n * elt / t_copy
    dst = torch.empty_like(g)
    bw_copy_ = 2 * n * elt / timeit(lambda: dst.copy_(g), device, reps)  # no allocation

    crit = g.new_empty(k * BS)
    deff = g.new_empty((nb - k) * BS)
    # correctness first
    mask, nf = fused_score_split(g, k, crit, deff)
    rmask, rnf, rc, rd = torch_score_split(g, k)
    # fp32 sums in another order may swap near-tied blocks at the top-k boundary: compare the
    # scores to tolerance, and the split for the kernel's own selection exactly
    torch.testing.assert_close(ops.score_blocks(g, BS)[0], g.view(-1, BS).float().pow(2).sum(1))
    assert int(mask.sum()) == k and bool(nf) == bool(rnf) and (mask != rmask).sum() <= 0.01 * nb
    v = g.view(-1, BS)
    assert torch.equal(crit, v[mask].reshape(-1)) and torch.equal(deff, v[~mask].reshape(-1))
    t = timeit(lambda: fused_score_split(g, k, crit, deff), device, reps)
    tc = timeit(lambda: torch_score_split(g, k), device, reps)
    rows.append(("score+split", 3 * n * elt, t, tc))

    ids = torch.randperm(nb, device=device)[:k]
    buf = g.new_empty(k * BS)
    ops.pack_blocks(g, ids, BS, out=buf)
    assert torch.equal(buf, g.view(-1, BS).index_select(0, ids).reshape(-1))
    t = timeit(lambda: ops.pack_blocks(g, ids, BS, out=buf), device, reps)
    tc = timeit(lambda: g.view(-1, BS).index_select(0, ids).reshape(-1), device, reps)
    rows.append(("pack 25%", 2 * k * BS * elt, t, tc))

    flat = g.clone()
    ops.unpack_blocks(buf * 2, ids, BS, flat)
    ref = g.clone()
    ref.view(-1, BS).index_copy_(0, ids, (buf * 2).view(-1, BS))
    assert torch.equal(flat, ref)
    t = timeit(lambda: ops.unpack_blocks(buf, ids, BS, flat), device, reps)
    tc = timeit(lambda: flat.view(-1, BS).index_copy_(0, ids, buf.view(-1, BS)), device, reps)
    rows.append(("unpack 25%", 2 * k * BS * elt, t, tc))

    p = torch.randn(n, device=device).to(dtype)
    st = [torch.zeros_like(p), torch.zeros_like(p)]
    st2 = [torch.zeros_like(p), torch.zeros_like(p)]
    p2 = p.clone()
    ops.adam_step_(p, g, *st, None, step=1, lr=1e-3)
    torch_adam(p2, g, *st2, step=1)
    torch.testing.assert_close(p, p2, equal_nan=True)  # fp16 overflows where torch.optim does too
    t = timeit(lambda: ops.adam_step_(p, g, *st, None, step=2, lr=1e-3), device, reps)
    tc = timeit(lambda: torch_adam(p2, g, *st2, step=2), device, reps)
    rows.append(("adam correction", 7 * n * elt, t, tc))

    m = torch.zeros_like(p)
    t = timeit(lambda: ops.sgd_step_(p, g, m, lr=0.1, momentum=0.9), device, reps)
    from torch.optim.sgd import _single_tensor_sgd
    m2 = [torch.zeros_like(p)]
    tc = timeit(lambda: _single_tensor_sgd([p2], [g], m2, None, None, weight_decay=0.0, momentum=0.9,
                                           lr=0.1, dampening=0.0, nesterov=False, maximize=False,
                                           has_sparse_grad=False), device, reps)
    rows.append(("sgd-momentum correction", 5 * n * elt, t, tc))
    return [dict(op=op, n=n, dtype=str(dtype).replace("torch.", ""), device=device,
                 ms=t * 1e3, gbps=b / t / 1e9, x_copy=(b / t) / bw_copy, x_copy_=(b / t) / bw_copy_,
                 x_torch=tc / t, copy_gbps=bw_copy / 1e9, copy__gbps=bw_copy_ / 1e9)
            for op, b, t, tc in rows]


def device_peak(device, how="auto", nbytes=1 << 30, reps=5):
    """The device's peak memory bandwidth: ``{"gbps", "source", "theoretical_gbps", "copy_gbps"}``.
    ``theoretical_gbps``: 2 x memory clock x bus width (double data rate) from
    torch.cuda.get_device_properties, where this torch reports them (None elsewhere); ``copy_gbps``: a
    copy_ of ``nbytes`` measured here (read + write). ``how``: "props" (the theoretical one, falling back to
    the measured one), "measure", or "auto" (props on a GPU; none on a CPU); "none": no peak."""
    out = {"gbps": None, "source": None, "theoretical_gbps": None, "copy_gbps": None, "copy_bytes": None}
    if how == "none" or (how == "auto" and device != "cuda"):
        return out
    if device == "cuda":
        p = torch.cuda.get_device_properties(torch.cuda.current_device())
        clock_khz = getattr(p, "memory_clock_rate", 0) or 0
        bus_bits = getattr(p, "memory_bus_width", 0) or 0
        if clock_khz and bus_bits:
            out["theoretical_gbps"] = 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9
            out["memory_clock_khz"], out["memory_bus_bits"] = clock_khz, bus_bits
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    out["copy_gbps"] = 2 * src.numel() * 4 / timeit(lambda: dst.copy_(src), device, reps) / 1e9
    out["copy_bytes"] = src.numel() * 4
    if how != "measure" and out["theoretical_gbps"]:
        out["gbps"], out["source"] = out["theoretical_gbps"], (
            "theoretical: 2 x memory_clock_rate x memory_bus_width of torch.cuda.get_device_properties")
    else:
        out["gbps"], out["source"] = out["copy_gbps"], f"measured: copy_ of {out['copy_bytes'] / 2**30:g} GiB " \
                                                       "(the achievable peak)"
    return out


def bench_launch_shape(n, device, reps, peak_gbps=None):
    """score_blocks (l2) and split_blocks (every block critical) on ``n`` fp32 elements with one block of
    the whole tensor and with blocks of BS, checked first; each against copy_ of the same tensor."""
    g = torch.randn(n, device=device)
    dst = torch.empty_like(g)
    copy_gbps = 2 * n * 4 / timeit(lambda: dst.copy_(g), device, reps) / 1e9
    rows = []
    for bs_name, bs in (("whole tensor", n), (str(BS), BS)):
        nb = ops.num_blocks(n, bs)
        scores = ops.score_blocks(g, bs, "l2")[0]
        if bs == n:
            torch.testing.assert_close(scores.double(), (g.double() ** 2).sum().reshape(1), rtol=1e-4, atol=0.0)
        else:
            pad = nb * bs - n
            ref = torch.nn.functional.pad(g * g, (0, pad)).view(nb, bs).sum(1)
            torch.testing.assert_close(scores, ref, rtol=1e-4, atol=1e-6)
        t = timeit(lambda bs=bs: ops.score_blocks(g, bs, "l2"), device, reps)
        rows.append(("score_blocks l2", bs_name, bs, n * 4, t))
        mask = torch.ones(nb, dtype=torch.bool, device=device)
        crit, deff = torch.empty_like(g), g.new_empty(0)
        ops.split_blocks(g, mask, bs, crit, deff)
        assert torch.equal(crit, g), f"split_blocks with block size {bs} moved the wrong elements"
        t = timeit(lambda bs=bs, m=mask, c=crit, d=deff: ops.split_blocks(g, m, bs, c, d), device, reps)
        rows.append(("split_blocks", bs_name, bs, 2 * n * 4, t))
    out = []
    for op, bs_name, bs, nbytes, t in rows:
        gbps = nbytes / t / 1e9
        out.append(dict(op=op, block_size=bs_name, block_elements=bs, n=n, dtype="float32", device=device, ms=t * 1e3,
                        gbps=gbps, x_copy_=gbps / copy_gbps, copy__gbps=copy_gbps,
                        x_peak=gbps / peak_gbps if peak_gbps else None))
    for r in out:  # the whole-tensor block's time over the BS blocks' time, per op
        base = next(o for o in out if o["op"] == r["op"] and o["block_elements"] == BS)
        r["x_time_vs_bs4096"] = r["ms"] / base["ms"]
    return out


def _fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main(argv=None):
    global MIN_TIME
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1M,4M,16M,64M")
    ap.add_argument("--half-sizes", default="16M", help="sizes for float16/bfloat16")
    ap.add_argument("--dtypes", default="float32,float16,bfloat16")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=MIN_TIME,
                    help="seconds each measurement repeats for at least (default %(default)s)")
    ap.add_argument("--peak", choices=["auto", "props", "measure", "none"], default="auto",
                    help="the device's peak bandwidth: auto (from the device's properties on a GPU, else a "
                         "measured copy_; none on a CPU), props, measure, none")
    ap.add_argument("--peak-bytes", default="1G", help="bytes of the measured copy_ (default %(default)s)")
    ap.add_argument("--launch-elements", default="auto",
                    help="fp32 elements of the launch-shape runs: auto (100M on a GPU, none on a CPU), a size "
                         "such as 100M, or 0 for none")
    ap.add_argument("--json", default="bench/out/kernels.json", help="the rows (a JSON list)")
    ap.add_argument("--report", default=None,
                    help="everything as one JSON object: device, peak, rows, launch shape")
    a = ap.parse_args(argv)
    MIN_TIME = a.min_time
    assert ops.HAS_EXTENSION, "osp._C is not built"
    if a.device == "cuda":
        assert ops._CUDA_BUILT, "osp._C was built without its CUDA kernels (rebuild with FORCE_CUDA=1)"
    peak = device_peak(a.device, a.peak, parse_size(a.peak_bytes), a.reps)
    results, errors = [], []
    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"device={a.device} ({name}) threads={torch.get_num_threads()} torch={torch.__version__} "
          f"block_size={BS}")
    if peak["gbps"]:
        print(f"peak {peak['gbps']:.0f} GB/s ({peak['source']}); copy_ of {peak['copy_bytes'] / 2**30:g} GiB "
              f"measured {peak['copy_gbps']:.0f} GB/s")
    print("| op | elements | dtype | ms | GB/s | x clone | x copy_ | x torch | x peak |")
    print("|---|---|---|---|---|---|---|---|---|")
    for dname in a.dtypes.split(","):
        dtype = getattr(torch, dname)
        sizes = a.sizes if dtype == torch.float32 else a.half_sizes
        for s in sizes.split(","):
            try:
                rows = bench_one(parse_size(s), dtype, a.device, a.reps)
            except Exception as e:  # noqa: BLE001 - a failed check is reported, the other sizes still run
                errors.append(f"{s} {dname}: {type(e).__name__}: {e}")
                print(f"| check failed | {s} | {dname} | {type(e).__name__}: {str(e).splitlines()[0][:200]} |",
                      flush=True)
                continue
            for r in rows:
                r["peak_gbps"] = peak["gbps"]
                r["x_peak"] = r["gbps"] / peak["gbps"] if peak["gbps"] else None
                r["size"] = s
                results.append(r)
                print(f"| {r['op']} | {s} | {r['dtype']} | {r['ms']:.2f} | {r['gbps']:.1f} | "
                      f"{r['x_copy']:.2f} | {r['x_copy_']:.2f} | {r['x_torch']:.1f} | {_fmt(r['x_peak'], '.2f')} |",
                      flush=True)
    launch = []
    le = a.launch_elements
    n_launch = (parse_size("100M") if a.device == "cuda" else 0) if le == "auto" else parse_size(le)
    if n_launch:
        try:
            launch = bench_launch_shape(n_launch, a.device, a.reps, peak["gbps"])
        except Exception as e:  # noqa: BLE001
            errors.append(f"launch shape {n_launch}: {type(e).__name__}: {e}")
        print(f"\nlaunch shape, {n_launch} fp32 elements:")
        print("| op | block size | ms | GB/s | x copy_ | x peak | time / time at 4096 |")
        print("|---|---|---|---|---|---|---|")
        for r in launch:
            print(f"| {r['op']} | {r['block_size']} | {r['ms']:.2f} | {r['gbps']:.1f} | {r['x_copy_']:.2f} | "
                  f"{_fmt(r['x_peak'], '.2f')} | {r['x_time_vs_bs4096']:.2f} |", flush=True)
    os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(results, fh, indent=1)
    if a.report:
        report = dict(device=a.device, device_name=name, torch=torch.__version__, cuda=torch.version.cuda,
                      threads=torch.get_num_threads(), block_size=BS, peak=peak, rows=results, launch_shape=launch,
                      errors=errors)
        os.makedirs(os.path.dirname(a.report) or ".", exist_ok=True)
        with open(a.report, "w") as fh:
            json.dump(report, fh, indent=1)
    if errors:
        raise SystemExit("kernels: a check failed (its rows are missing above):\n  " + "\n  ".join(errors))
    return results


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
