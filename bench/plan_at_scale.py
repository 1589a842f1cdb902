"""osp.plan at scale, on paper: each mode's predicted speedup over BSP for ResNet-50-, BERT-large- and GPT-2-sized
gradients at 8-1024 ranks on 25, 100 and 400 Gbit/s links, from compute profiles built out of published
per-GPU training throughput (docs/plan.md states every assumption and cites every figure).

    python bench/plan_at_scale.py            # prints the markdown table, writes bench/results/plan_at_scale.json

Nothing here runs a model: a profile is synthesized per model (``synthetic_profile``) and handed to osp.plan.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "python"))
from osp.plan import Cluster, plan  # noqa: E402

# name: (parameters, micro-batch per GPU, micro-batches per synchronization, samples/s of one GPU, the source)
MODELS = {
    "ResNet-50": (25.6e6, 256, 1, 2470.0, "NVIDIA DeepLearningExamples, PyTorch/Classification/ConvNets/resnet50v1.5 "
                  "README: 1x A100 80GB, mixed precision, 2470 img/s (batch 256 a GPU, main.py's default)"),
    "BERT-large": (336e6, 256, 1, 633.0, "NVIDIA DeepLearningExamples, PaddlePaddle/LanguageModeling/BERT README: "
                   "pre-training phase 1 (sequence 128), 1x A100 80GB, mixed precision, 633 sequences/s at micro-batch "
                   "256; one micro-batch per synchronization as in its 32-node run (accumulation 1)"),
    "GPT-2 (124M)": (124e6, 12, 5, 104.2, "karpathy/nanoGPT README and config/train_gpt2.py: one 8x A100 40GB node, "
                     "about 4 days for 600,000 iterations of 491,520 tokens = 107k tokens/s a GPU = 104 sequences of "
                     "1024 tokens/s; micro-batch 12, 5 micro-batches a GPU per synchronization"),
}
HBM = 1.5e12          # bytes/s a GPU's memory moves (A100 40GB: 1.55 TB/s): the optimizer's and osp's step work
BUCKET = 25 * 2**20   # osp's (and DDP's) default bucket
LATENCY = 5e-6        # seconds a hop of the ring
SHARES = (0.05, 0.1, 0.25, 0.5)  # the fixed critical shares tried (the best is reported)
RANKS, LINKS = (8, 64, 256, 1024), (("25gbit", 25e9), ("100gbit", 100e9), ("400gbit", 400e9))


def synthetic_profile(params: float, micro: int, accumulation: int, per_gpu_sps: float) -> dict:
    """A micro-batch computes ``micro / per_gpu_sps``, a third forward and two thirds backward; with accumulation,
    only the last micro-batch's backward overlaps the synchronization (the others count as forward, as under DDP's
    ``no_sync``); float32 gradients in 25 MiB buckets whose gradients land evenly through that backward (the last
    layers' first); the wrapped optimizer's step moves 4 gradient-sized tensors through memory, osp's modes 2 more
    (packing and the correction)."""
    mb = micro / per_gpu_sps
    F, B, total = (accumulation - 1) * mb + mb / 3, 2 * mb / 3, 4 * params
    sizes, left = [], total
    while left > 0:
        sizes.append(min(BUCKET, left))
        left -= sizes[-1]
    done, buckets = 0.0, []
    for s in sizes:
        done += s
        buckets.append({"bytes": s, "ready_s": B * done / total})
    plain = {"forward_s": F, "backward_s": B, "step_s": 4 * total / HBM}
    mode = {"forward_s": F, "backward_s": B, "step_s": 6 * total / HBM}
    return {"batch": micro * accumulation, "bytes": total, "buckets": buckets,
            "modes": {"plain": plain, "bsp": plain, "osp": mode, "dsync": mode, "hsp": plain}}


def rows():
    out = []
    for name, (params, micro, accumulation, sps, _) in MODELS.items():
        profile = synthetic_profile(params, micro, accumulation, sps)
        for link_name, link in LINKS:
            for n in RANKS:
                got = {r["mode"]: r for r in plan(profile, Cluster(n, link, LATENCY), shares=SHARES, delays=(2,))}
                slow = {r["mode"]: r for r in plan(profile, Cluster(n, link, LATENCY, straggler=1.5), shares=(),
                                                   delays=())}
                bsp = got["bsp"]["samples_per_s"]
                fixed = max(SHARES, key=lambda f: got[f"osp-{f:g}"]["samples_per_s"])
                out.append({"model": name, "link": link_name, "ranks": n, "bsp_bound_share": got["bsp"]["bound_share"],
                            "osp_auto_x": got["osp-auto"]["samples_per_s"] / bsp,
                            "osp_auto_critical": got["osp-auto"]["critical"],
                            "osp_fixed_x": got[f"osp-{fixed:g}"]["samples_per_s"] / bsp, "osp_fixed": fixed,
                            "dsync2_x": got["dsync-2"]["samples_per_s"] / bsp,
                            "hsp_x": got["hsp"]["samples_per_s"] / bsp,
                            "hsp_straggler_x": slow["hsp"]["samples_per_s"] / slow["bsp"]["samples_per_s"],
                            "bound_x": 1 / got["bsp"]["bound_share"]})
    return out


def markdown(table) -> str:
    lines = ["| model | link | ranks | BSP, share of bound | OSP(auto) x BSP (critical) | "
             "best fixed OSP x BSP (share) | DSync(2) x BSP | HSP x BSP | HSP x BSP, a rank 1.5x slow | bound x BSP | "
             "verdict |", "|" + "---|" * 11]
    for r in table:
        osp, dsync = r["osp_auto_x"], r["dsync2_x"]
        if r["bsp_bound_share"] >= 0.95:
            verdict = "BSP already hides the allreduce: OSP does not help"
        elif max(osp, dsync) < 1.05:
            verdict = "under 5% to gain"
        elif osp >= 1.05 or r["osp_auto_critical"] < 1.0:
            verdict = f"OSP(auto) {osp:.2f}x, DSync(2) {dsync:.2f}x"
        else:
            verdict = (f"DSync(2) {dsync:.2f}x, OSP({r['osp_fixed']:g}) {r['osp_fixed_x']:.2f}x; OSP(auto) stays BSP "
                       "(the step model gives no share 3% with auto's 0.05 floor on the bucket ready last)")
        lines.append(f"| {r['model']} | {r['link']} | {r['ranks']} | {r['bsp_bound_share']:.2f} | "
                     f"{r['osp_auto_x']:.2f} ({r['osp_auto_critical']:.2f}) | "
                     f"{r['osp_fixed_x']:.2f} ({r['osp_fixed']:g}) | "
                     f"{r['dsync2_x']:.2f} | {r['hsp_x']:.2f} | "
                     f"{r['hsp_straggler_x']:.2f} | {r['bound_x']:.2f} | {verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "plan_at_scale.json"))
    a = ap.parse_args(argv)
    table = rows()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"models": {k: {"params": v[0], "micro_batch": v[1], "accumulation": v[2], "samples_per_s": v[3],
                                  "source": v[4]}
                              for k, v in MODELS.items()}, "hbm_bytes_per_s": HBM, "latency_s": LATENCY,
                   "bucket_bytes": BUCKET, "rows": table}, fh, indent=1)
    print(markdown(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
