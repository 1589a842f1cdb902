"""Throughput and accuracy under an emulated network bottleneck: osp against Horovod's optimizer,
PyTorch DDP and FSDP2, in one run, with ranks in network namespaces whose links are shaped with tc.

    python bench/train_throughput.py --quick          # a few minutes on 2 cores (needs root)
    python bench/train_throughput.py --ranks 2,4 --bandwidths 100mbit,1gbit,10gbit,none
    python bench/train_throughput.py --models mlp,resnet18,gpt --bandwidths 1gbit --ranks 2
    python bench/train_throughput.py --variation --steps 40   # DSync: fluctuating link and compute

For every model (bench/models.py: a synthetic-input MLP of ~8M parameters, a CIFAR ResNet-18, a small
GPT), batch and bandwidth it trains with each contender and reports samples/s, the step-time
breakdown (compute, stage-1 communication, stage-2 wait) and the ratio to Horovod and to DDP, and OSP
auto's samples/s over the best fixed osp mode's (BSP, critical 0.1, 0.25, 0.5) that ran beside it. Two
contenders measure the halves of the perfect-overlap bound in the same run: `compute` (the step
without any collective) and `allreduce` (an allreduce of the gradient's size, no compute); every row's
share of bound is max(compute, allreduce) / its step time. Then it trains the digits CNN with BSP and
OSP auto at the bottleneck bandwidth for test accuracy against wall time. Writes
bench/out/throughput.{json,csv} and PNG plots (throughput, accuracy, OSP auto's critical share per step).
"""
from __future__ import annotations

import argparse
import csv
import gc
import json
import os
import statistics
import sys
import tempfile
import time
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.models import DEFAULT_BATCH, MODELS, build  # noqa: E402

# compute, allreduce: the two halves of the perfect-overlap bound (the step alone, the collective alone);
# overlap: both at once with no dependency between them, what that bound costs on this machine's CPUs
CONTENDERS = ["compute", "allreduce", "overlap", "hvd", "ddp", "fsdp", "osp-bsp", "osp-auto", "osp-0.1",
              "osp-0.25", "osp-0.5"]
# the fixed osp modes OSP auto is compared with (auto_vs_best_fixed: auto over the best of those that ran)
FIXED_OSP = ["osp-bsp", "osp-0.1", "osp-0.25", "osp-0.5"]
# compressed, a contender with a suffix: "+fp16" / "+bf16" (osp's compression=, Horovod's Compression.fp16,
# DDP's fp16_compress_hook / bf16_compress_hook, FSDP2's MixedPrecisionPolicy(reduce_dtype=)), "+powersgd" (DDP
# with PowerSGD: rank 4, error feedback, start_powerSGD_iter=10), "+s2fp16" (OSP: only the deferred blocks in
# fp16); "allreduce+fp16" is the collective alone in float16, the compressed half of the bound. "fsdp": FSDP2
# (torch.distributed.fsdp.fully_shard per layer or block, then the root; osp.train.fully_shard_model)
COMPRESSION_CONTENDERS = ["compute", "allreduce", "allreduce+fp16", "ddp", "ddp+fp16", "ddp+powersgd", "fsdp",
                          "fsdp+fp16", "hvd", "hvd+fp16", "osp-bsp", "osp-bsp+fp16", "osp-auto", "osp-auto+fp16",
                          "osp-0.25+s2fp16", "dsync-2", "dsync-2+fp16"]
# --variation: a link whose rate changes while training runs, and compute that varies per step
VARIATION_CONTENDERS = ["dsync-auto", "dsync-2", "dsync-4", "osp-auto", "osp-bsp", "ddp", "hvd"]
# --contenders stragglers (with --stragglers 1,2,4: the last rank that many times slower): HSP alone ("hsp-bsp"),
# composed with OSP(auto) and DSync(2), against OSP(auto) alone, osp BSP and DDP; "hsp-<mode>" is osp.HSP(sync=<mode>)
STRAGGLER_CONTENDERS = ["compute", "allreduce", "ddp", "osp-bsp", "osp-auto", "hsp-bsp", "hsp-osp-auto",
                        "hsp-dsync-2"]


# ------------------------------------------------------------------------------------------------
# rank side

def engine(contender: str, osp_backend: str) -> str:
    contender = contender.split("+")[0]
    if contender == "hvd" or (contender.startswith("osp") and osp_backend == "horovod"):
        return "horovod"
    return "torch"


def worker(a):
    """Train ``a.contender`` on this rank; a failure (FSDP2 refusing a model on Gloo, say) is written to
    ``a.out`` by rank 0 as the row's ``error`` (its exception, one line) before it is raised again."""
    try:
        return train_steps(a)
    except Exception as e:
        if os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0")) == "0":
            what = "FSDP2 (fully_shard) on CPU/Gloo" if a.contender.startswith("fsdp") else a.contender
            with open(a.out, "w") as fh:
                json.dump({"error": f"{what}, {a.model}: {type(e).__name__}: {e}"[:1000]}, fh)
        raise


def train_steps(a):
    import torch

    import osp
    from osp.launcher import init_from_env

    torch.set_num_threads(1)
    backend = engine(a.contender, a.osp_backend)
    name, _, comp = a.contender.partition("+")
    comm = init_from_env(backend, timeout_s=300)
    model, make_batch, loss_fn = build(a.model, a.width)
    nparams = sum(p.numel() for p in model.parameters())
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(comm.rank)
    x, y = make_batch(a.batch, g)

    # compute alone (no synchronization), for the breakdown and the estimated bound
    local = torch.optim.SGD(model.parameters(), lr=0.0)
    t0 = time.perf_counter()
    for _ in range(3):
        local.zero_grad()
        loss_fn(model(x), y).backward()
        local.step()
    compute_alone = (time.perf_counter() - t0) / 3

    family = None
    if name == "compute":
        # the step without any collective: forward, backward and a local SGD step
        opt, net = inner, model
    elif name == "allreduce":
        # the collective without any compute: a float32 buffer of the gradient's size, allreduced (float16
        # with "+fp16")
        opt, net = None, None
        buf = torch.zeros(nparams, dtype=torch.float16 if comp == "fp16" else torch.float32)
    elif name == "overlap":
        # the step and an allreduce of the gradient's size at once, the collective launched before the
        # forward and waited for after the update: the perfect overlap no data dependency limits, paying
        # only what the collective's CPU work (Gloo's threads, the kernel's TCP) takes from the compute
        opt, net = inner, model
        buf = torch.zeros(nparams, dtype=torch.float32)
    elif name == "hvd":
        import horovod.torch as hvd

        compression = hvd.Compression.fp16 if comp == "fp16" else hvd.Compression.none
        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(), compression=compression)
        net = model
    elif name == "ddp":
        from osp.train import register_ddp_compression

        net = torch.nn.parallel.DistributedDataParallel(model)
        register_ddp_compression(net, comp or "none")
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    elif name == "fsdp":
        from osp.train import fully_shard_model

        net = fully_shard_model(model, comp or "none")  # the parameters are now shards: a new SGD over them
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    else:
        family = name.split("-", 1)[0]
        opt = osp.DistributedOptimizer(inner, model.named_parameters(), sync=osp_sync(name, a, comp), backend=comm,
                                       compression=comp if comp in ("fp16", "bf16") else None)
        net = model
    # compute that varies from step to step (e.g. batches of different cost): extra work of a random
    # share of compute_alone before each step, drawn per rank and step from a seeded generator
    rng = torch.Generator().manual_seed(1234 + comm.rank)
    busy_a = torch.randn(64, 64)
    extra_s = []

    def busy(seconds):
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            torch.mm(busy_a, busy_a)

    # --straggler K: the last rank's micro-batches take K times the compute (a sleep between forward and
    # backward, as osp.train's --straggler)
    slow_s = (a.straggler - 1.0) * compute_alone if comm.rank == comm.size - 1 else 0.0

    def micro_batch():
        loss = loss_fn(net(x), y)
        if slow_s:
            time.sleep(slow_s)
        loss.backward()
        return loss

    times, micro_batches = [], []
    caught = warnings.catch_warnings(record=True)
    warned = caught.__enter__()
    warnings.simplefilter("always")
    for _ in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        if name == "allreduce":
            torch.distributed.all_reduce(buf)
            times.append(time.perf_counter() - t0)
            micro_batches.append(comm.size)
            continue
        if a.jitter:
            extra_s.append(float(torch.rand((), generator=rng)) * a.jitter * compute_alone)
            busy(extra_s[-1])
        work = torch.distributed.all_reduce(buf, async_op=True) if name == "overlap" else None
        opt.zero_grad()
        micro_batch()
        if family == "hsp":  # the ranks that are ahead compute more micro-batches meanwhile
            opt.step(micro_batch)
            micro_batches.append(sum(opt.last_step()["micro_batches"]))
        else:
            opt.step()
            micro_batches.append(comm.size)
        if work is not None:
            work.wait()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if isinstance(opt, osp.DistributedOptimizer):
        opt.flush()
    flush_s = time.perf_counter() - t0
    caught.__exit__(None, None, None)
    # total: what the run took, the averages still in flight at the end included (a delay must not
    # hide its last steps' communication); median: the median step, robust to outliers
    if a.timing == "total":
        step_s = (sum(times[a.warmup:]) + flush_s) / a.steps
    else:
        step_s = statistics.median(times[a.warmup:])
    # samples: every micro-batch of every rank (HSP's extras included), over the measured steps
    per_step = statistics.mean(micro_batches[a.warmup:])
    out = {"model": a.model, "contender": a.contender, "ranks": comm.size, "params": nparams, "batch": a.batch,
           "step_s": step_s, "samples_per_s": a.batch * per_step / step_s, "micro_batches_per_step": per_step,
           "straggler": a.straggler, "max_extra": a.max_extra, "compute_alone_s": compute_alone,
           "extra_compute_s": statistics.mean(extra_s[a.warmup:]) if extra_s else 0.0, "bytes": nparams * 4,
           "slow_rank_warnings": [str(w.message) for w in warned if "slower than the median" in str(w.message)]}
    if isinstance(opt, osp.DistributedOptimizer):
        stats = opt.stats()
        full = stats["history"]
        hist = full[a.warmup:]
        for k in ("critical_fraction", "stage1_s", "stage2_wait_s", "compute_s"):
            vals = [h[k] for h in hist if h.get(k) is not None]
            if vals:
                out[k] = statistics.median(vals)
        # every step's critical share, warm-up included: how fast auto settles, and whether it holds
        out["criticals"] = [h.get("critical_fraction") for h in full]
        if "budget" in stats:  # what OSP auto measured and tried
            out["budget"] = stats["budget"]
        out["arrivals"] = stats["arrivals"]
        if "hsp" in stats:
            out["hsp"] = stats["hsp"]
        if family == "dsync":
            delays = [h["delay"] for h in hist]
            out.update(delay_median=statistics.median(delays), delay_max=max(delays),
                       delays=delays, replay_s=statistics.mean(h["replay_s"] for h in hist),
                       kept_bytes=opt.stats()["kept_bytes"])
    if comm.rank == 0:
        with open(a.out, "w") as fh:
            json.dump(out, fh)
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.shutdown()
    else:
        # DDP and FSDP hold the process group: drop them first (FSDP's state is in reference cycles with the
        # model: collect them), so destroying the group joins Gloo's threads now
        del net, opt, model
        gc.collect()
        torch.distributed.destroy_process_group()


def osp_sync(name: str, a, comp: str = ""):
    """The osp mode of a contender's name: ``osp-bsp``, ``osp-<share>``, ``osp-auto``, ``dsync-<delay>``,
    ``dsync-auto``, ``hsp-<one of those, or bsp>`` (``osp.HSP(max_extra=--max-extra, sync=...)``)."""
    import osp

    if name == "bsp":
        return osp.BSP()
    family, mode = name.split("-", 1)
    if family == "hsp":
        return osp.HSP(max_extra=a.max_extra, sync=osp_sync(mode, a, comp))
    if family == "dsync":
        return osp.DSync(delay=mode if mode == "auto" else int(mode), max_delay=max(4, 1 if mode == "auto"
                                                                                 else int(mode)))
    if mode == "bsp":
        return osp.BSP()
    return osp.OSP(critical=mode if mode == "auto" else float(mode), block_size=a.block_size,
                   stage2_compression="fp16" if comp == "s2fp16" else None)


# ------------------------------------------------------------------------------------------------
# driver side

def ring_seconds(nbytes, ranks, bits_per_s):
    """Time a ring allreduce of nbytes needs on links of bits_per_s (each rank sends 2(n-1)/n)."""
    return 2 * (ranks - 1) / ranks * nbytes * 8 / bits_per_s


def run_contender(NetEm, rate, ranks, contender, a, tmp, model="mlp", batch=64, straggler=1.0):
    tag = f"{model}-b{batch}-{contender}-{ranks}-{rate}-x{straggler:g}"
    out = os.path.join(tmp, f"{tag}.json")
    log_prefix = os.path.join(tmp, f"log-{tag}")
    backend = engine(contender, a.osp_backend)
    if os.path.exists(out):  # an earlier repeat's
        os.remove(out)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--contender", contender, "--out", out,
            "--model", model, "--width", str(a.width), "--batch", str(batch), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--block-size", str(a.block_size), "--osp-backend", a.osp_backend,
            "--jitter", str(a.jitter), "--timing", a.timing, "--straggler", str(straggler),
            "--max-extra", str(a.max_extra)]
    switch = None
    if a.switch:
        argv += ["--switch", a.switch]
        rates, period = a.switch.split(":")
        switch = (rates.split(","), float(period))
    with NetEm(ranks, rate=None if rate == "none" else rate, switch=switch) as net:
        codes = net.run(backend, argv, timeout=a.run_timeout, env={"PYTHONPATH": ROOT + "/python:" + ROOT},
                        log_prefix=log_prefix)
    r = None
    if os.path.exists(out):
        with open(out) as fh:
            r = json.load(fh)
    if any(codes) or r is None or "error" in r:
        if r is not None and "error" in r:  # the worker's own: its exception
            logs = r["error"]
        else:
            try:
                with open(log_prefix + ".rank0.log") as fh:
                    logs = fh.read()[-2000:]
            except OSError as e:
                logs = f"(no log: {e})"
        return {"model": model, "batch": batch, "contender": contender, "ranks": ranks, "rate": rate,
                "straggler": straggler, "error": f"exit codes {codes}: {logs}"}
    r["rate"] = rate
    return r


def run_digits(NetEm, rate, ranks, sync, critical, a, tmp):
    out = os.path.join(tmp, f"digits-{sync}-{critical}.json")
    argv = [sys.executable, "-m", "osp.train", "--sync", sync, "--critical", critical, "--epochs",
            str(a.digits_epochs), "--backend", "torch", "--json", out, "--no-progress"]
    with NetEm(ranks, rate=None if rate == "none" else rate) as net:
        codes = net.run("torch", argv, timeout=a.run_timeout * 4, env={"PYTHONPATH": ROOT + "/python"},
                        log_prefix=os.path.join(tmp, f"log-digits-{sync}-{critical}"))
    if any(codes):
        return {"sync": sync, "critical": critical, "error": f"exit codes {codes}"}
    with open(out) as fh:
        return json.load(fh)


def group_key(r):
    return (r.get("model", "mlp"), r.get("batch"), r.get("rate"), r.get("ranks"), r.get("straggler", 1.0))


def add_bounds(rows):
    """Ratios to Horovod and DDP, and the perfect-overlap bound of each (model, batch, rate, ranks)
    group: max(compute step, allreduce step) measured by those two contenders in this run, or, where
    one of them is missing, the estimate max(compute alone, ring-allreduce time at the link rate)."""
    ok = [r for r in rows if "error" not in r]
    for r in ok:
        peers = {x["contender"]: x for x in ok if group_key(x) == group_key(r)}
        for key, name in (("x_hvd", "hvd"), ("x_ddp", "ddp"), ("x_ddp_fp16", "ddp+fp16")):
            if name in peers:
                r[key] = r["samples_per_s"] / peers[name]["samples_per_s"]
        comm = 0.0 if r["rate"] == "none" else ring_seconds(r["bytes"], r["ranks"], _bits(r["rate"]))
        r["comm_s"], r["ideal_s"] = comm, max(r["compute_alone_s"], comm)
        if "compute" in peers and "allreduce" in peers:
            r["bound_s"] = max(peers["compute"]["step_s"], peers["allreduce"]["step_s"])
            r["bound_from"] = "measured"
        else:
            r["bound_s"], r["bound_from"] = r["ideal_s"], "estimate"
        r["share_of_bound"] = r["bound_s"] / r["step_s"]
        if "compute" in peers and "allreduce+fp16" in peers:  # the bound with the gradient in float16 on the wire
            r["bound_fp16_s"] = max(peers["compute"]["step_s"], peers["allreduce+fp16"]["step_s"])
            r["share_of_bound_fp16"] = r["bound_fp16_s"] / r["step_s"]
        if "overlap" in peers:  # the bound as this machine can reach it: compute and collective at once
            r["overlap_s"] = peers["overlap"]["step_s"]
            r["share_of_overlap"] = r["overlap_s"] / r["step_s"]
        if "compute" in peers and "allreduce" in peers:
            r["ceiling_sps"] = ceiling(r, peers["compute"]["step_s"], peers["allreduce"]["step_s"])
            r["share_of_ceiling"] = r["samples_per_s"] / r["ceiling_sps"]
        if r["contender"] == "osp-auto":
            auto_against_fixed(r, peers)


def auto_against_fixed(r, peers) -> None:
    """On OSP auto's row: ``auto_vs_best_fixed``, its samples/s over the best of the fixed osp modes
    (FIXED_OSP) that ran without error in its group, ``best_fixed`` naming that one (absent if none ran),
    and ``chosen_critical``, the share auto ran at the end (its budget's, None while still in its warm-up)."""
    fixed = [peers[c] for c in FIXED_OSP if c in peers]
    if fixed:
        best = max(fixed, key=lambda x: x["samples_per_s"])
        r["best_fixed"] = best["contender"]
        r["auto_vs_best_fixed"] = r["samples_per_s"] / best["samples_per_s"]
    b = r.get("budget")
    if isinstance(b, dict) and "fraction" in b:
        r["chosen_critical"] = b["fraction"] if b.get("phase") == "auto" else None


def ceiling(r, compute_s: float, allreduce_s: float) -> float:
    """The composed ceiling in samples/s with the last rank ``k = straggler`` times slower: stragglers
    hidden by extras (in the straggler's micro-batch each other rank computes k of its own, at most
    1 + max_extra) and the network by compute (a step takes at least the allreduce alone). ``compute_s``:
    the compute row's step (rank 0's: a fast rank), ``allreduce_s``: the allreduce row's."""
    k, n = r.get("straggler", 1.0), r["ranks"]
    per_step = (n - 1) * min(k, 1 + r.get("max_extra", 4)) + 1
    return per_step * r["batch"] / max(k * compute_s, allreduce_s)


def straggler_table(rows) -> str:
    """Samples/s with a straggler against the composed ceiling (``ceiling``) and against the better of HSP
    alone and OSP(auto) alone, per configuration."""
    lines = ["| model | bandwidth | ranks | straggler | contender | samples/s | micro-batches/step | x DDP | "
             "share of ceiling | x best of HSP, OSP(auto) | ceiling samples/s | slow rank named |",
             "|" + "---|" * 12]
    f2 = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    for r in rows:
        if r["contender"] in ("compute", "allreduce"):
            continue
        head = [r.get("model", "mlp"), r["rate"], str(r["ranks"]), f"{r.get('straggler', 1.0):g}x", r["contender"]]
        if "error" in r:
            lines.append("| " + " | ".join(head) + " | failed |" + " |" * 6)
            continue
        peers = {x["contender"]: x for x in rows if group_key(x) == group_key(r) and "error" not in x}
        best = max((peers[c]["samples_per_s"] for c in ("hsp-bsp", "osp-auto") if c in peers), default=None)
        a = r.get("arrivals") or {}
        named = "-" if not a else (f"rank {a['slow_rank']} ({a['slower']:.1f}x)" if a.get("slow_rank") is not None
                                   else "none")
        if r.get("slow_rank_warnings"):
            named += ", warned"
        lines.append("| " + " | ".join(head + [
            f"{r['samples_per_s']:.1f}", f"{r.get('micro_batches_per_step', r['ranks']):.2f}", f2(r, "x_ddp"),
            f2(r, "share_of_ceiling"), f"{r['samples_per_s'] / best:.2f}" if best else "-",
            f"{r['ceiling_sps']:.1f}" if "ceiling_sps" in r else "-", named]) + " |")
    lines.append("\nceiling: ((ranks - 1) * min(k, 1 + max_extra) + 1) micro-batches per step over max(k * compute "
                 "step, allreduce step), both measured in the same run (k: the straggler's slowdown); slow rank "
                 "named: stats()['arrivals'] on rank 0, 'warned' where its warning fired")
    return "\n".join(lines)


def table(rows):
    lines = ["| model | batch | bandwidth | ranks | contender | samples/s | x Horovod | x DDP | share of bound | "
             "share of overlap | step ms "
             "| compute ms | stage-1 ms | stage-2 wait ms | critical | bound ms | estimate ms | x DDP+fp16 "
             "| share of fp16 bound | auto vs best fixed | auto's share |",
             "|" + "---|" * 21]
    ms = lambda r, k: f"{1e3 * r[k]:.1f}" if k in r else "-"  # noqa: E731
    f2 = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    estimated = False
    for r in rows:
        head = [r.get("model", "mlp"), str(r.get("batch", "-")), r["rate"], str(r["ranks"]), r["contender"]]
        if "error" in r:
            lines.append("| " + " | ".join(head) + " | failed |" + " |" * 15)
            continue
        mark = "*" if r.get("bound_from") == "estimate" else ""
        estimated = estimated or bool(mark)
        cells = head + [f"{r['samples_per_s']:.1f}", f2(r, "x_hvd"), f2(r, "x_ddp"), f2(r, "share_of_bound") + mark,
                        f2(r, "share_of_overlap"), ms(r, "step_s"), "-" if r["contender"].startswith("allreduce")
                        else ms(r, "compute_s" if "compute_s" in r else "compute_alone_s"),
                        ms(r, "stage1_s"), ms(r, "stage2_wait_s"), f2(r, "critical_fraction"),
                        ms(r, "bound_s") + mark, ms(r, "ideal_s"), f2(r, "x_ddp_fp16"), f2(r, "share_of_bound_fp16"),
                        f"{r['auto_vs_best_fixed']:.2f} ({r['best_fixed']})" if "auto_vs_best_fixed" in r else "-",
                        "measuring" if "chosen_critical" in r and r["chosen_critical"] is None
                        else f2(r, "chosen_critical")]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("\nshare of bound: max(compute step, allreduce step) of the same model, batch, bandwidth and "
                 "ranks, over the row's step time; share of overlap: the overlap contender's step (compute and an "
                 "allreduce of the gradient at once, no dependency) over the row's; auto vs best fixed: OSP auto's "
                 "samples/s over the best of " + ", ".join(FIXED_OSP) + " that ran (named), auto's share: the "
                 "critical share it ran at the end; "
                 "estimate: max(compute alone, ring-allreduce time at the link "
                 "rate)" + ("; * bound from the estimate (compute or allreduce row missing)" if estimated else ""))
    return "\n".join(lines)


def plots(rows, digits, path_prefix, warmup=0):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    rates = sorted({r["rate"] for r in ok}, key=lambda s: float("inf") if s == "none" else _bits(s))
    groups = sorted({(r.get("model", "mlp"), r["batch"]) for r in ok},
                    key=lambda mb: (MODELS.index(mb[0]) if mb[0] in MODELS else 99, mb[1]))
    if groups:
        fig, axes = plt.subplots(1, len(groups), figsize=(7 * len(groups), 4.5), squeeze=False)
        for ax, (model, batch) in zip(axes[0], groups):
            for ranks in sorted({r["ranks"] for r in ok}):
                for c in CONTENDERS:
                    pts = [(rates.index(r["rate"]), r["samples_per_s"]) for r in ok if r["contender"] == c
                           and r["ranks"] == ranks and r.get("model", "mlp") == model and r["batch"] == batch]
                    if pts:
                        xs, ys = zip(*sorted(pts))
                        style = "--" if c in ("compute", "allreduce", "overlap") else "-"
                        ax.plot(xs, ys, style, marker="o", label=f"{c} ({ranks} ranks)")
            ax.set_xticks(range(len(rates)), rates)
            ax.set_xlabel("link bandwidth per rank")
            ax.set_ylabel("samples/s")
            ax.set_yscale("log")
            ax.set_title(f"Throughput vs bandwidth ({model}, batch {batch}/rank, synthetic data)")
            ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path_prefix + "_throughput.png", dpi=110)
        plt.close(fig)
    auto = [r for r in ok if r["contender"] == "osp-auto" and r.get("criticals")]
    if auto:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in auto:
            pts = [(i + 1, c) for i, c in enumerate(r["criticals"]) if c is not None]
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker=".", label=f"{r.get('model', 'mlp')} b{r['batch']} {r['rate']} "
                        f"{r['ranks']} ranks")
        if warmup:
            ax.axvline(warmup + 0.5, color="gray", linestyle=":", label="end of warm-up")
        ax.axvline(10.5, color="gray", linestyle="--", label="step 10")
        ax.set_xlabel("step (warm-up included)")
        ax.set_ylabel("critical share (stage 1)")
        ax.set_ylim(0, 1.05)
        ax.set_title("OSP(auto): critical share per step")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(path_prefix + "_critical.png", dpi=110)
        plt.close(fig)
    if digits:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for d in digits:
            if "error" in d:
                continue
            c = d["config"]
            ax.plot([e["wall_s"] for e in d["epochs"]], [100 * e["test_acc"] for e in d["epochs"]], marker=".",
                    label=f"{c['sync']} {c['critical'] if c['sync'] == 'osp' else ''}".strip())
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("digits test accuracy (%)")
        ax.set_ylim(80, 100)
        ax.legend()
        ax.set_title("Digits CNN: accuracy vs wall time at the bottleneck bandwidth")
        fig.tight_layout()
        fig.savefig(path_prefix + "_accuracy.png", dpi=110)
        plt.close(fig)


def variation(a, NetEm, tmp):
    """DSync's case: slack against variation. The same contenders on a steady link at the average rate,
    and on a link cycling between the rates of --switch with compute varying per step (--jitter)."""
    rates, period = a.switch.split(":")
    rates = rates.split(",")
    avg_bits = statistics.mean(_bits(r) for r in rates)
    steady = f"{avg_bits / 1e6:.0f}mbit"
    contenders = a.contenders.split(",") if a.contenders != ",".join(CONTENDERS) else VARIATION_CONTENDERS
    model = a.models.split(",")[0]
    batch = batches_for(model, a)[0]
    scenarios = [("steady", steady, None, 0.0), ("fluctuating", rates[0], a.switch, a.jitter or 1.0)]
    rows, t_start = [], time.monotonic()
    for name, rate, switch, jitter in scenarios:
        sub = argparse.Namespace(**{**vars(a), "switch": switch, "jitter": jitter})
        for c in contenders:
            r = run_contender(NetEm, rate, 2, c, sub, tmp, model, batch)
            r.update(scenario=name, link=f"{a.switch} (average {steady})" if switch else steady)
            rows.append(r)
            msg = r.get("error", "")[:300] or f"{r['samples_per_s']:8.1f} samples/s  step {1e3 * r['step_s']:.0f} ms"
            print(f"[{time.monotonic() - t_start:5.0f}s] {name:11s} {c:10s} {msg}", flush=True)
    for r in rows:
        if "error" in r:
            continue
        peers = {x["contender"]: x for x in rows if x["scenario"] == r["scenario"] and "error" not in x}
        for key, other in (("x_osp_auto", "osp-auto"), ("x_ddp", "ddp"), ("x_hvd", "hvd")):
            if other in peers:
                r[key] = r["samples_per_s"] / peers[other]["samples_per_s"]
        compute = r["compute_alone_s"] + r["extra_compute_s"]
        r["comm_s"] = ring_seconds(r["bytes"], r["ranks"], avg_bits)
        r["ideal_s"] = max(compute, r["comm_s"])
        if "compute" in peers and "allreduce" in peers:  # measured in this scenario, when asked for
            r["ideal_s"] = max(peers["compute"]["step_s"], peers["allreduce"]["step_s"])
        r["share_of_bound"] = r["ideal_s"] / r["step_s"]
    lines = [f"{model}, batch {batch} per rank, 2 ranks", "",
             "| link | contender | samples/s | share of bound | x OSP(auto) | x DDP | x Horovod | step ms | "
             "bound ms | delay (median / max) |", "|" + "---|" * 10]
    f2 = lambda r, k: f"{r[k]:.2f}" if k in r else "-"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['scenario']} | {r['contender']} | failed |" + " |" * 7)
            continue
        delay = f"{r['delay_median']:g} / {r['delay_max']}" if "delay_median" in r else "-"
        lines.append(f"| {r['scenario']} | {r['contender']} | {r['samples_per_s']:.1f} | {f2(r, 'share_of_bound')} | "
                     f"{f2(r, 'x_osp_auto')} | {f2(r, 'x_ddp')} | {f2(r, 'x_hvd')} | {1e3 * r['step_s']:.0f} | "
                     f"{1e3 * r['ideal_s']:.0f} | {delay} |")
    return rows, "\n".join(lines)


def _bits(rate):
    from bench.netem.netem import parse_rate

    return parse_rate(rate)


def batches_for(model, a):
    """The per-rank batches to run ``model`` with: --batches, else --batch, else the model's default."""
    if a.batches:
        return [int(b) for b in a.batches.split(",")]
    if a.batch:
        return [a.batch]
    return [DEFAULT_BATCH[model]]


def median_run(rs):
    """The run of median step time among one contender's repeats (the lower middle of an even count);
    every run's step time is kept in ``step_s_runs``. An error in any run is the row's error."""
    bad = [r for r in rs if "error" in r]
    if bad:
        return bad[0]
    out = dict(sorted(rs, key=lambda r: r["step_s"])[(len(rs) - 1) // 2])
    out["step_s_runs"] = [r["step_s"] for r in rs]
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", default="osp-auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--model", default="mlp", choices=MODELS, help=argparse.SUPPRESS)
    ap.add_argument("--quick", action="store_true", help="2 ranks, two bandwidths, few steps")
    ap.add_argument("--models", default="mlp", help=f"comma list of {', '.join(MODELS)} (bench/models.py)")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--bandwidths", default="100mbit,1gbit,10gbit,none")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help="comma list; 'compression' for the compression set: " + ",".join(COMPRESSION_CONTENDERS))
    ap.add_argument("--width", type=int, default=2048, help="MLP hidden width (2048: ~8.4M parameters)")
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch for every model (default per "
                    "model: " + ", ".join(f"{m} {b}" for m, b in DEFAULT_BATCH.items()) + ")")
    ap.add_argument("--batches", default=None, help="comma list of per-rank batches: each model runs with each")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=1, help="runs of every contender, taking turns; each "
                    "reports its median run")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=65536)
    ap.add_argument("--osp-backend", choices=["torch", "horovod"], default="torch")
    ap.add_argument("--digits-rate", default=None, help="bandwidth for the accuracy runs (default: the "
                    "one where BSP communicates about as long as it computes)")
    ap.add_argument("--digits-epochs", type=int, default=15)
    ap.add_argument("--no-digits", action="store_true", help="skip the digits accuracy runs")
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--jitter", type=float, default=0.0, help="extra compute per step: a uniform random share "
                    "in [0, JITTER] of the compute time")
    ap.add_argument("--switch", default=None, help="RATES:PERIOD, e.g. 2gbit,250mbit:1.0: the link's rate "
                    "cycles through RATES, each held PERIOD seconds")
    ap.add_argument("--timing", choices=["median", "total"], default="median", help="a step's time: the "
                    "median step, or the whole run (flush included) over the steps (--variation uses total)")
    ap.add_argument("--variation", action="store_true", help="DSync against OSP, BSP, DDP and Horovod on a "
                    "steady link and on a fluctuating one with varying compute (2 ranks, the first of --models)")
    ap.add_argument("--stragglers", default="1", help="comma list of slowdowns of the last rank (1: none), each "
                    "run with every contender; 'stragglers' in --contenders for HSP composed with OSP and DSync")
    ap.add_argument("--straggler", type=float, default=1.0, help=argparse.SUPPRESS)
    ap.add_argument("--max-extra", type=int, default=4, help="HSP: extra micro-batches a rank may compute a step")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "throughput.json"))
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.contenders == "compression":
        a.contenders = ",".join(COMPRESSION_CONTENDERS)
    if a.contenders == "stragglers":  # samples per step vary under HSP: every contender timed by its whole run
        a.contenders, a.timing = ",".join(STRAGGLER_CONTENDERS), "total"
    models = a.models.split(",")
    for m in models:
        if m not in MODELS:
            ap.error(f"--models: unknown model {m!r}; choose from {', '.join(MODELS)}")
    if a.quick:
        a.ranks, a.bandwidths, a.steps, a.warmup, a.digits_epochs = "2", "1gbit,none", 6, 3, 10
    from bench.netem.netem import NetEm

    if a.variation:
        a.switch = a.switch or "2gbit,250mbit:1.0"
        a.timing = "total"
        a.jitter = a.jitter or 1.0
        with tempfile.TemporaryDirectory() as tmp:
            rows, text = variation(a, NetEm, tmp)
        path = a.json[:-5] + "_variation.json"
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            json.dump({"config": vars(a), "rows": rows}, fh, indent=1)
        print()
        print(text)
        return 0
    rows, digits, rate = [], [], None
    # with --repeats, the contenders of a configuration take turns (round-robin), so a slow spell of the
    # machine hits them alike; each keeps its median run
    stragglers = [float(x) for x in a.stragglers.split(",")]
    runs = [(m, b, r, int(n), x, c, k) for m in models for b in batches_for(m, a) for r in a.bandwidths.split(",")
            for n in a.ranks.split(",") for x in stragglers for k in range(a.repeats) for c in a.contenders.split(",")]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        tries = {}
        for i, (model, batch, rate, ranks, x, c, k) in enumerate(runs):
            r = run_contender(NetEm, rate, ranks, c, a, tmp, model, batch, x)
            tries.setdefault((model, batch, rate, ranks, x, c), []).append(r)
            msg = r.get("error", "")[:300] or f"{r['samples_per_s']:8.1f} samples/s  step {1e3 * r['step_s']:.0f} ms"
            if a.repeats > 1:
                msg += f"  (run {k + 1} of {a.repeats})"
            slow = f" {x:g}x slower" if x != 1.0 else ""
            print(f"[{i + 1}/{len(runs)} {time.monotonic() - t_start:5.0f}s] {model:8s} b{batch:<4d} {rate:>7s} "
                  f"{ranks} ranks{slow} {c:9s} {msg}", flush=True)
        rows = [median_run(rs) for rs in tries.values()]
        add_bounds(rows)
        # accuracy at the bottleneck: the bandwidth where BSP's communication is closest to compute (for
        # the first model of --models)
        rate = None if a.no_digits else a.digits_rate
        if rate is None and not a.no_digits:
            shaped = [r for r in rows if r.get("contender") == "osp-bsp" and r.get("rate") != "none"
                      and "error" not in r and r.get("model") == models[0]]
            if shaped:
                rate = min(shaped, key=lambda r: abs(r["comm_s"] - r["compute_alone_s"]))["rate"]
        if rate:
            for sync, crit in (("bsp", "1.0"), ("osp", "auto")):
                d = run_digits(NetEm, rate, 2, sync, crit, a, tmp)
                digits.append(d)
                print(f"digits at {rate}: {sync} {crit}: " + (d.get("error") or
                      f"test acc {100 * d['final_test_acc']:.2f}%  {d['train_s']:.1f} s"), flush=True)
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"config": vars(a), "rows": rows, "digits": digits, "digits_rate": rate}, fh, indent=1)
    keys = sorted({k for r in rows for k in r})
    with open(a.json[:-5] + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    plots(rows, digits, a.json[:-5], a.warmup)
    print()
    print(table(rows))
    if any(x != 1.0 for x in stragglers) or any(c.startswith("hsp") for c in a.contenders.split(",")):
        print()
        print(straggler_table(rows))
    if digits and all("error" not in d for d in digits):
        b, o = digits[0]["final_test_acc"], digits[1]["final_test_acc"]
        print(f"\ndigits at {rate}, 2 ranks: BSP {100 * b:.2f}%, OSP auto {100 * o:.2f}% "
              f"({100 * (o - b):+.2f} points); wall {digits[0]['train_s']:.1f} s vs {digits[1]['train_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
