"""Time to accuracy with a straggler: HSP against BSP, OSP and DDP on scikit-learn's digits, 2 ranks.

One rank computes FACTOR times slower (``osp.train --straggler 1:FACTOR``: a sleep of FACTOR-1 times
its measured micro-batch compute between forward and backward). For each factor (1 = no straggler),
each method and each seed, ``osp.train`` runs under torchrun; the time to accuracy of a run is the
training wall time (evaluation excluded) at the end of the first epoch whose test accuracy reaches
the final test accuracy of BSP with the same seed and factor (the mean of its last 3 epochs: one
epoch's figure is noisy). BSP runs ``--epochs``; the others stop there, or after twice as many
epochs. An epoch is a pass's worth of samples over all ranks, so HSP, which computes extra
micro-batches on the fast rank, ends its epochs sooner.

With 2 ranks and one rank k times slower, a BSP step computes 2 micro-batches in the slow rank's time
and HSP ideally k + 1: the ceiling of HSP's samples/s over BSP's is (k + 1) / 2.

    python bench/stragglers.py [--factors 1,2,4] [--seeds 0,1,2] [--methods hsp,bsp,osp,ddp]
    python bench/stragglers.py --report bench/results/stragglers.json   # the tables of a saved run

Prints markdown tables; writes bench/results/stragglers.json and bench/results/stragglers.png.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

from osp.report import time_to  # the first epoch's wall time at a target accuracy

METHODS = {"hsp": ["--sync", "hsp"], "bsp": ["--sync", "bsp"], "osp": ["--sync", "osp", "--critical", "auto"],
           "ddp": ["--sync", "ddp"]}


def run(method, factor, seed, a, out, target=None):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(a.ranks),
           "-m", "osp.train", *METHODS[method], "--backend", "torch",
           "--epochs", str(a.epochs if method == "bsp" else a.epochs * 2), "--channels", str(a.channels),
           "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--width", str(a.width),
           "--max-extra", str(a.max_extra), "--seed", str(seed), "--json", out, "--no-progress"]
    if factor > 1:
        cmd += ["--straggler", f"{a.ranks - 1}:{factor:g}"]
    if target is not None:
        cmd += ["--stop-at-acc", f"{target:.6f}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900, env=env)
    with open(out) as fh:
        return json.load(fh)


def target_of(bsp):
    """BSP's final test accuracy: the mean of its last 3 epochs (one epoch's figure is noisy)."""
    return statistics.mean(e["test_acc"] for e in bsp["epochs"][-3:])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--factors", default="1,2,4")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--methods", default="hsp,bsp,osp,ddp")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--width", type=int, default=1)
    ap.add_argument("--channels", type=int, default=64)
    ap.add_argument("--max-extra", type=int, default=4)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", default="bench/results/stragglers.json")
    ap.add_argument("--plot", default="bench/results/stragglers.png")
    ap.add_argument("--report", default=None, metavar="JSON", help="only print the tables of a saved run")
    a = ap.parse_args(argv)
    factors = [float(f) for f in a.factors.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    methods = ["bsp"] + [m for m in a.methods.split(",") if m != "bsp"]
    if a.report:
        sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        from bench.saved import load_saved

        saved = load_saved(a, a.report)
        factors = [float(f) for f in a.factors.split(",")]
        seeds = [int(s) for s in a.seeds.split(",")]
        methods = ["bsp"] + [m for m in a.methods.split(",") if m != "bsp"]
        res = {(k, m, s): saved["runs"][f"{k:g}x/{m}/{s}"] for k in factors for m in methods for s in seeds}
    else:
        res = {}
        with tempfile.TemporaryDirectory() as tmp:
            for k in factors:
                for m in methods:
                    for seed in seeds:
                        target = None if m == "bsp" else target_of(res[(k, "bsp", seed)])
                        r = run(m, k, seed, a, os.path.join(tmp, f"{m}-{k:g}-{seed}.json"), target)
                        res[(k, m, seed)] = r
                        print(f"straggler {k:g}x {m:4s} seed {seed}: final test acc {100 * r['final_test_acc']:.2f}%"
                              f"  {r['samples_per_s']:.0f} samples/s  {r['train_s']:.2f} s", flush=True)
    summary = summarize(res, factors, methods, seeds, a)
    if not a.report:
        os.makedirs(os.path.dirname(a.json), exist_ok=True)
        with open(a.json, "w") as fh:
            json.dump({"config": vars(a), "summary": summary,
                       "runs": {f"{k:g}x/{m}/{s}": {"epochs": r["epochs"], "final_test_acc": r["final_test_acc"],
                                                    "samples_per_s": r["samples_per_s"],
                                                    "osp_stats": r.get("osp_stats")}
                                for (k, m, s), r in res.items()}}, fh, indent=1)
        plot(res, factors, methods, seeds, a.plot)
    return 0


def speedups(res, k, m, seeds, drop):
    """Per seed: (the method's time to BSP's final accuracy less ``drop``, BSP's time / it or None)."""
    out = []
    for seed in seeds:
        bsp, r = res[(k, "bsp", seed)], res[(k, m, seed)]
        target = target_of(bsp) - drop
        t, tb = time_to(r, target), time_to(bsp, target)
        out.append((t, tb / t if t else None))
    return out


def summarize(res, factors, methods, seeds, a):
    summary = {}
    print(f"\n{a.ranks} ranks, {a.epochs} epochs (BSP), DigitsCNN channels {a.channels} width {a.width}, "
          f"batch {a.batch_size} per micro-batch, lr {a.lr}, max_extra {a.max_extra}, seeds {a.seeds}")
    print("Seconds of training until the test accuracy reaches BSP's final one (same seed and straggler; the mean "
          "of BSP's last 3 epochs), and until it is within 0.5 points of it; speedup = BSP's time / the method's, "
          "mean over seeds (n/3: only n seeds got there within twice BSP's epochs); samples/s relative to BSP, "
          "and for HSP as a share of the ceiling (k + 1) / 2.\n")
    print("| straggler | method | to BSP's final acc, per seed (s) | speedup | to within 0.5 points, per seed (s) | "
          "speedup | samples/s vs BSP | share of HSP ceiling |")
    print("|---|---|---|---|---|---|---|---|")

    def fmt(rows):
        times = ", ".join("never" if t is None else f"{t:.2f}" for t, _ in rows)
        reached = [sp for _, sp in rows if sp is not None]
        mean = statistics.mean(reached) if len(reached) == len(rows) else None
        return times, (f"{mean:.2f}x" if mean is not None else f"{len(reached)}/{len(rows)}"), mean

    for k in factors:
        ceiling = (k + 1) / 2 if k > 1 else 1.0
        for m in methods:
            exact, near = speedups(res, k, m, seeds, 0.0), speedups(res, k, m, seeds, 0.005)
            t1, s1, m1 = fmt(exact)
            t2, s2, m2 = fmt(near)
            rel = statistics.mean(res[(k, m, s)]["samples_per_s"] / res[(k, "bsp", s)]["samples_per_s"] for s in seeds)
            summary[f"{k:g}x/{m}"] = {"to_final": exact, "speedup_to_final": m1, "to_within_half_point": near,
                                      "speedup_to_within_half_point": m2, "samples_per_s_vs_bsp": rel,
                                      "ceiling": ceiling}
            print(f"| {k:g}x | {m} | {t1} | {s1} | {t2} | {s2} | {rel:.2f}x | "
                  f"{f'{rel / ceiling:.0%}' if m == 'hsp' else ''} |")
    return summary


def plot(res, factors, methods, seeds, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, axes = plt.subplots(1, len(factors), figsize=(5 * len(factors), 4), squeeze=False)
    colors = {"hsp": "tab:red", "bsp": "tab:blue", "osp": "tab:green", "ddp": "tab:gray"}
    for ax, k in zip(axes[0], factors):
        for m in methods:
            for i, seed in enumerate(seeds):
                ep = res[(k, m, seed)]["epochs"]
                ax.plot([e["wall_s"] for e in ep], [100 * e["test_acc"] for e in ep], color=colors.get(m),
                        alpha=0.8, lw=1.2, label=m if i == 0 else None)
        ax.set_title("no straggler" if k <= 1 else f"one rank {k:g}x slower")
        ax.set_xlabel("training wall time (s)")
        ax.set_ylabel("test accuracy (%)")
        ax.set_ylim(80, 100)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
