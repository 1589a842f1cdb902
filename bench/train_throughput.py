"""Throughput and accuracy under an emulated network bottleneck: osp against Horovod's optimizer
and PyTorch DDP, in one run, with ranks in network namespaces whose links are shaped with tc.

    python bench/train_throughput.py --quick          # a few minutes on 2 cores (needs root)
    python bench/train_throughput.py --ranks 2,4 --bandwidths 100mbit,1gbit,10gbit,none
    python bench/train_throughput.py --variation --steps 40   # DSync: fluctuating link and compute

For every bandwidth it trains a synthetic-input MLP (~8M parameters) with each contender and reports
samples/s, the step-time breakdown (compute, stage-1 communication, stage-2 wait), the ratio to
Horovod and to DDP, and the ideal bound max(compute, communication). Then it trains the digits CNN
with BSP and OSP auto at the bottleneck bandwidth for test accuracy against wall time. Writes
bench/out/throughput.{json,csv} and PNG plots.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTENDERS = ["hvd", "ddp", "osp-bsp", "osp-auto", "osp-0.1", "osp-0.25", "osp-0.5"]
# --variation: a link whose rate changes while training runs, and compute that varies per step
VARIATION_CONTENDERS = ["dsync-auto", "dsync-2", "dsync-4", "osp-auto", "osp-bsp", "ddp", "hvd"]


# ------------------------------------------------------------------------------------------------
# rank side

def engine(contender: str, osp_backend: str) -> str:
    if contender == "hvd" or (contender.startswith("osp") and osp_backend == "horovod"):
        return "horovod"
    return "torch"


def make_mlp(width: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(1024, width), torch.nn.ReLU(), torch.nn.Linear(width, width),
                               torch.nn.ReLU(), torch.nn.Linear(width, 1000))


def worker(a):
    import torch
    import torch.nn.functional as F

    import osp
    from osp.launcher import init_from_env

    torch.set_num_threads(1)
    backend = engine(a.contender, a.osp_backend)
    comm = init_from_env(backend, timeout_s=300)
    model = make_mlp(a.width)
    nparams = sum(p.numel() for p in model.parameters())
    inner = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(a.batch, 1024, generator=g)
    y = torch.randint(0, 1000, (a.batch,), generator=g)

    # compute alone (no synchronization), for the breakdown and the ideal bound
    local = torch.optim.SGD(model.parameters(), lr=0.0)
    t0 = time.perf_counter()
    for _ in range(3):
        local.zero_grad()
        F.cross_entropy(model(x), y).backward()
        local.step()
    compute_alone = (time.perf_counter() - t0) / 3

    if a.contender == "hvd":
        import horovod.torch as hvd

        opt = hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
        net = model
    elif a.contender == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
        opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    else:
        family, mode = a.contender.split("-", 1)
        if family == "dsync":
            sync = osp.DSync(delay=mode if mode == "auto" else int(mode), max_delay=max(4, 1 if mode == "auto"
                                                                                      else int(mode)))
        elif mode == "bsp":
            sync = osp.BSP()
        else:
            sync = osp.OSP(critical=mode if mode == "auto" else float(mode), block_size=a.block_size)
        opt = osp.DistributedOptimizer(inner, model.named_parameters(), sync=sync, backend=comm)
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

    times = []
    for _ in range(a.warmup + a.steps):
        t0 = time.perf_counter()
        if a.jitter:
            extra_s.append(float(torch.rand((), generator=rng)) * a.jitter * compute_alone)
            busy(extra_s[-1])
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    if isinstance(opt, osp.DistributedOptimizer):
        opt.flush()
    flush_s = time.perf_counter() - t0
    # total: what the run took, the averages still in flight at the end included (a delay must not
    # hide its last steps' communication); median: the median step, robust to outliers
    if a.timing == "total":
        step_s = (sum(times[a.warmup:]) + flush_s) / a.steps
    else:
        step_s = statistics.median(times[a.warmup:])
    out = {"contender": a.contender, "ranks": comm.size, "params": nparams, "batch": a.batch,
           "step_s": step_s, "samples_per_s": a.batch * comm.size / step_s, "compute_alone_s": compute_alone,
           "extra_compute_s": statistics.mean(extra_s[a.warmup:]) if extra_s else 0.0, "bytes": nparams * 4}
    if isinstance(opt, osp.DistributedOptimizer):
        hist = opt.stats()["history"][a.warmup:]
        for k in ("critical_fraction", "stage1_s", "stage2_wait_s", "compute_s"):
            out[k] = statistics.median(h[k] for h in hist)
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
        # DDP holds the process group: drop it first, so destroying the group joins Gloo's threads now
        del net, opt
        torch.distributed.destroy_process_group()


# ------------------------------------------------------------------------------------------------
# driver side

def ring_seconds(nbytes, ranks, bits_per_s):
    """Time a ring allreduce of nbytes needs on links of bits_per_s (each rank sends 2(n-1)/n)."""
    return 2 * (ranks - 1) / ranks * nbytes * 8 / bits_per_s


def run_contender(NetEm, rate, ranks, contender, a, tmp):
    out = os.path.join(tmp, f"{contender}-{ranks}-{rate}.json")
    backend = engine(contender, a.osp_backend)
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--contender", contender, "--out", out,
            "--width", str(a.width), "--batch", str(a.batch), "--steps", str(a.steps), "--warmup", str(a.warmup),
            "--block-size", str(a.block_size), "--osp-backend", a.osp_backend, "--jitter", str(a.jitter),
            "--timing", a.timing]
    switch = None
    if a.switch:
        argv += ["--switch", a.switch]
        rates, period = a.switch.split(":")
        switch = (rates.split(","), float(period))
    with NetEm(ranks, rate=None if rate == "none" else rate, switch=switch) as net:
        codes = net.run(backend, argv, timeout=a.run_timeout, env={"PYTHONPATH": ROOT + "/python:" + ROOT},
                        log_prefix=os.path.join(tmp, f"log-{contender}-{ranks}-{rate}"))
    if any(codes) or not os.path.exists(out):
        logs = open(os.path.join(tmp, f"log-{contender}-{ranks}-{rate}.rank0.log")).read()[-2000:]
        return {"contender": contender, "ranks": ranks, "rate": rate, "error": f"exit codes {codes}: {logs}"}
    with open(out) as fh:
        r = json.load(fh)
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


def table(rows):
    lines = ["| bandwidth | ranks | contender | samples/s | x Horovod | x DDP | step ms | compute ms | "
             "stage-1 ms | stage-2 wait ms | critical | ideal bound ms |", "|" + "---|" * 12]
    ms = lambda r, k: f"{1e3 * r[k]:.1f}" if k in r else "-"  # noqa: E731
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['rate']} | {r['ranks']} | {r['contender']} | failed |" + " |" * 8)
            continue
        cells = [r["rate"], str(r["ranks"]), r["contender"], f"{r['samples_per_s']:.1f}",
                 f"{r['x_hvd']:.2f}" if "x_hvd" in r else "-", f"{r['x_ddp']:.2f}" if "x_ddp" in r else "-",
                 ms(r, "step_s"), ms(r, "compute_s" if "compute_s" in r else "compute_alone_s"),
                 ms(r, "stage1_s"), ms(r, "stage2_wait_s"),
                 f"{r['critical_fraction']:.2f}" if "critical_fraction" in r else "-", ms(r, "ideal_s")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plots(rows, digits, path_prefix):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "error" not in r]
    rates = sorted({r["rate"] for r in ok}, key=lambda s: float("inf") if s == "none" else _bits(s))
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for ranks in sorted({r["ranks"] for r in ok}):
        for c in CONTENDERS:
            pts = [(rates.index(r["rate"]), r["samples_per_s"]) for r in ok
                   if r["contender"] == c and r["ranks"] == ranks]
            if pts:
                xs, ys = zip(*sorted(pts))
                ax.plot(xs, ys, marker="o", label=f"{c} ({ranks} ranks)")
    ax.set_xticks(range(len(rates)), rates)
    ax.set_xlabel("link bandwidth per rank")
    ax.set_ylabel("samples/s")
    ax.set_yscale("log")
    ax.set_title("Throughput vs bandwidth (MLP, synthetic input)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path_prefix + "_throughput.png", dpi=110)
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
    scenarios = [("steady", steady, None, 0.0), ("fluctuating", rates[0], a.switch, a.jitter or 1.0)]
    rows, t_start = [], time.monotonic()
    for name, rate, switch, jitter in scenarios:
        sub = argparse.Namespace(**{**vars(a), "switch": switch, "jitter": jitter})
        for c in contenders:
            r = run_contender(NetEm, rate, 2, c, sub, tmp)
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
        r["share_of_bound"] = r["ideal_s"] / r["step_s"]
    lines = ["| link | contender | samples/s | share of bound | x OSP(auto) | x DDP | x Horovod | step ms | "
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
    sys.path.insert(0, ROOT)
    from bench.netem.netem import parse_rate

    return parse_rate(rate)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", default="osp-auto")
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="2 ranks, two bandwidths, few steps")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--bandwidths", default="100mbit,1gbit,10gbit,none")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--width", type=int, default=2048, help="MLP hidden width (2048: ~8.4M parameters)")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=65536)
    ap.add_argument("--osp-backend", choices=["torch", "horovod"], default="torch")
    ap.add_argument("--digits-rate", default=None, help="bandwidth for the accuracy runs (default: the "
                    "one where BSP communicates about as long as it computes)")
    ap.add_argument("--digits-epochs", type=int, default=15)
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--jitter", type=float, default=0.0, help="extra compute per step: a uniform random share "
                    "in [0, JITTER] of the compute time")
    ap.add_argument("--switch", default=None, help="RATES:PERIOD, e.g. 2gbit,250mbit:1.0: the link's rate "
                    "cycles through RATES, each held PERIOD seconds")
    ap.add_argument("--timing", choices=["median", "total"], default="median", help="a step's time: the "
                    "median step, or the whole run (flush included) over the steps (--variation uses total)")
    ap.add_argument("--variation", action="store_true", help="DSync against OSP, BSP, DDP and Horovod on a "
                    "steady link and on a fluctuating one with varying compute (2 ranks)")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "throughput.json"))
    a = ap.parse_args(argv)
    if a.worker:
        return worker(a)
    if a.quick:
        a.ranks, a.bandwidths, a.steps, a.warmup, a.digits_epochs = "2", "1gbit,none", 6, 3, 10
    sys.path.insert(0, ROOT)
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
    rows, digits = [], []
    runs = [(r, int(n), c) for r in a.bandwidths.split(",") for n in a.ranks.split(",")
            for c in a.contenders.split(",")]
    t_start = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for i, (rate, ranks, c) in enumerate(runs):
            r = run_contender(NetEm, rate, ranks, c, a, tmp)
            rows.append(r)
            msg = r.get("error", "")[:300] or f"{r['samples_per_s']:8.1f} samples/s  step {1e3 * r['step_s']:.0f} ms"
            print(f"[{i + 1}/{len(runs)} {time.monotonic() - t_start:5.0f}s] {rate:>7s} {ranks} ranks "
                  f"{c:9s} {msg}", flush=True)
        for r in rows:
            if "error" in r:
                continue
            peers = {x["contender"]: x for x in rows if x.get("rate") == r["rate"] and x["ranks"] == r["ranks"]
                     and "error" not in x}
            for key, name in (("x_hvd", "hvd"), ("x_ddp", "ddp")):
                if name in peers:
                    r[key] = r["samples_per_s"] / peers[name]["samples_per_s"]
            comm = 0.0 if r["rate"] == "none" else ring_seconds(r["bytes"], r["ranks"], _bits(r["rate"]))
            r["comm_s"], r["ideal_s"] = comm, max(r["compute_alone_s"], comm)
        # accuracy at the bottleneck: the bandwidth where BSP's communication is closest to compute
        rate = a.digits_rate
        if rate is None:
            shaped = [r for r in rows if r.get("contender") == "osp-bsp" and r.get("rate") != "none"
                      and "error" not in r]
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
    plots(rows, digits, a.json[:-5])
    print()
    print(table(rows))
    if digits and all("error" not in d for d in digits):
        b, o = digits[0]["final_test_acc"], digits[1]["final_test_acc"]
        print(f"\ndigits at {rate}, 2 ranks: BSP {100 * b:.2f}%, OSP auto {100 * o:.2f}% "
              f"({100 * (o - b):+.2f} points); wall {digits[0]['train_s']:.1f} s vs {digits[1]['train_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
