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


def time_to(result, target):
    """Training wall time at the end of the first epoch reaching ``target`` test accuracy (None: never)."""
    for e in result["epochs"]:
        if e["test_acc"] >= target - 1e-9:
            return e["wall_s"]
    return None


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
    a = ap.parse_args(argv)
    factors = [float(f) for f in a.factors.split(",")]
    seeds = [int(s) for s in a.seeds.split(",")]
    methods = ["bsp"] + [m for m in a.methods.split(",") if m != "bsp"]
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for k in factors:
            for m in methods:
                for seed in seeds:
                    target = None if m == "bsp" else target_of(res[(k, "bsp", seed)])
                    r = run(m, k, seed, a, os.path.join(tmp, f"{m}-{k:g}-{seed}.json"), target)
                    res[(k, m, seed)] = r
                    print(f"straggler {k:g}x {m:4s} seed {seed}: final test acc {100 * r['final_test_acc']:.2f}%  "
                          f"{r['samples_per_s']:.0f} samples/s  {r['train_s']:.2f} s", flush=True)
    summary = {}
    print(f"\n{a.ranks} ranks, {a.epochs} epochs (BSP), DigitsCNN channels {a.channels} width {a.width}, "
          f"batch {a.batch_size} per micro-batch, lr {a.lr}, "
          f"max_extra {a.max_extra}, seeds {a.seeds}")
    print("Time to BSP's final test accuracy (same seed), seconds of training; speedup = BSP's time / the "
          "method's (mean over seeds); samples/s relative to BSP, and for HSP as a share of the ceiling "
          "(k + 1) / 2.\n")
    print("| straggler | method | time to BSP's final acc per seed (s) | speedup vs BSP | acc at stop (mean) | "
          "samples/s vs BSP | share of HSP ceiling |")
    print("|---|---|---|---|---|---|---|")
    for k in factors:
        ceiling = (k + 1) / 2 if k > 1 else 1.0
        for m in methods:
            times, speed, accs, sps = [], [], [], []
            for seed in seeds:
                bsp = res[(k, "bsp", seed)]
                r = res[(k, m, seed)]
                t, tb = time_to(r, target_of(bsp)), time_to(bsp, target_of(bsp))
                times.append(t)
                speed.append(tb / t if t else None)
                accs.append(r["final_test_acc"])
                sps.append(r["samples_per_s"] / bsp["samples_per_s"])
            reached = [s for s in speed if s is not None]
            sp = statistics.mean(reached) if len(reached) == len(speed) else None
            rel = statistics.mean(sps)
            summary[f"{k:g}x/{m}"] = {"times": times, "speedups": speed, "speedup": sp, "final_accs": accs,
                                      "samples_per_s_vs_bsp": rel, "ceiling": ceiling}
            print(f"| {k:g}x | {m} | {', '.join('never' if t is None else f'{t:.2f}' for t in times)} | "
                  f"{'-' if sp is None else f'{sp:.2f}x'} | {100 * statistics.mean(accs):.2f}% | {rel:.2f}x | "
                  f"{f'{rel / ceiling:.0%}' if m == 'hsp' else ''} |")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"config": vars(a), "summary": summary,
                   "runs": {f"{k:g}x/{m}/{s}": {"epochs": r["epochs"], "final_test_acc": r["final_test_acc"],
                                                "samples_per_s": r["samples_per_s"], "osp_stats": r.get("osp_stats")}
                            for (k, m, s), r in res.items()}}, fh, indent=1)
    plot(res, factors, methods, seeds, a.plot)
    return 0


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
