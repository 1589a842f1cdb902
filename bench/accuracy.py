"""Accuracy on scikit-learn's digits: BSP against OSP (fixed 0.25 and auto) and DSync (delay 1 to 4),
mean of several seeds, same epochs, 2 ranks under horovodrun. Prints a markdown table; writes
bench/out/accuracy.json.

    python bench/accuracy.py [--seeds 0,1,2] [--epochs 15] [--ranks 2] [--modes bsp,dsync]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

MODES = [("bsp", []), ("osp 0.25", ["--critical", "0.25"]), ("osp auto", ["--critical", "auto"])] + [
    (f"dsync {d}", ["--delay", str(d)]) for d in (1, 2, 3, 4)]


def run(mode_args, sync, seed, epochs, ranks, out):
    hr = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or "horovodrun"
    cmd = [hr, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", sys.executable, "-m", "osp.train",
           "--sync", sync, *mode_args, "--epochs", str(epochs), "--seed", str(seed), "--json", out,
           "--no-progress"]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    with open(out) as fh:
        return json.load(fh)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--json", default="bench/out/accuracy.json")
    ap.add_argument("--modes", default="bsp,osp,dsync", help="which families to run (bsp always runs)")
    a = ap.parse_args(argv)
    families = set(a.modes.split(",")) | {"bsp"}
    seeds = [int(s) for s in a.seeds.split(",")]
    res = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, extra in MODES:
            sync = name.split()[0]
            if sync not in families:
                continue
            for seed in seeds:
                r = run(extra, sync, seed, a.epochs, a.ranks, os.path.join(tmp, f"{sync}-{seed}.json"))
                res.setdefault(name, []).append(r)
                print(f"{name:9s} seed {seed}: test acc {100 * r['final_test_acc']:.2f}%  "
                      f"{r['samples_per_s']:.0f} samples/s", flush=True)
    bsp = statistics.mean(r["final_test_acc"] for r in res["bsp"])
    print(f"\n{a.ranks} ranks, {a.epochs} epochs, seeds {a.seeds}\n")
    print("| mode | test acc per seed | mean | vs BSP (points) | within 0.5 points |")
    print("|---|---|---|---|---|")
    summary = {}
    for name, rs in res.items():
        accs = [r["final_test_acc"] for r in rs]
        mean = statistics.mean(accs)
        d = 100 * (mean - bsp)
        summary[name] = {"accs": accs, "mean": mean, "vs_bsp_points": d}
        print(f"| {name} | {', '.join(f'{100 * x:.2f}' for x in accs)} | {100 * mean:.2f}% | {d:+.2f} | "
              f"{'yes' if abs(d) <= 0.5 or d > 0 else 'NO'} |")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"config": vars(a), "summary": summary}, fh, indent=1)
    return 0 if all(abs(s["vs_bsp_points"]) <= 0.5 or s["vs_bsp_points"] > 0 for s in summary.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
