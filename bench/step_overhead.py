"""osp's own time per step against the compute, one rank, no network: what a mode costs besides the
allreduce. The throughput bench's MLP (8.3M parameters), one thread, SGD with momentum; the mean over
steps 6-25 of ``stats()``'s ``step_s`` (inside ``step()``) and ``compute_s`` (forward and backward, with
what a mode does in the backward hooks: BSP's averaging, OSP's packing). OSP's own work is its step
minus BSP's (both apply the same update; BSP also checks the averaged gradient for inf/nan).

Then the per-phase table: the time inside ``step()`` by operation (torch.profiler), per step.

    python bench/step_overhead.py [--steps 25] [--batches 256,512] [--json bench/results/step_overhead.json]
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

import osp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.models import build  # noqa: E402

# what each profiled operation is for, inside OSP's step()
PHASES = {
    "osp::split_blocks": "pack / snapshot (split_blocks)",
    "osp::merge_blocks": "merge averaged blocks back (merge_blocks)",
    "osp::sgd_step_": "exact correction (fused SGD kernel)",
    "osp::sgd_step_into_": "exact correction, written to the flat buffers (fused SGD kernel)",
    "osp::adam_step_": "exact correction (fused Adam kernel)",
    "osp::score_blocks": "block scores and inf/nan scan (score_blocks)",
    "aten::add_": "the update itself (torch.optim.SGD)",
    "aten::mul_": "the update itself (torch.optim.SGD)",
    "aten::div_": "average = sum / ranks",
    "aten::copy_": "copies (gradients, side channel, edit probe)",
}


def modes():
    return {"BSP": osp.BSP(), "OSP(1.0)": osp.OSP(critical=1.0, block_size=65536),
            "OSP(0.2)": osp.OSP(critical=0.2, block_size=65536), "OSP(0.25)": osp.OSP(critical=0.25, block_size=65536)}


def measure(sync, batch, steps, profile=False):
    model, make_batch, loss_fn = build("mlp", 2048)
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   model.named_parameters(), sync=sync, backend="torch")
    x, y = make_batch(batch, torch.Generator().manual_seed(0))
    phases = {}

    def one():
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if profile:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                opt.step()
            for e in prof.key_averages():
                if e.key in PHASES or e.key.startswith("osp::"):
                    ph = PHASES.get(e.key, e.key)
                    phases[ph] = phases.get(ph, 0.0) + e.self_cpu_time_total / 1e3  # ms
        else:
            opt.step()

    for i in range(steps):
        if i == 5:
            phases.clear()
        one()
    opt.flush()
    hist = opt.stats()["history"][5:]
    mean = lambda k: sum(h[k] for h in hist) / len(hist)  # noqa: E731
    return mean("step_s"), mean("compute_s"), {k: v / len(hist) for k, v in phases.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--batches", default="256,512")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rows = []
    out = {"rows": rows}
    for batch in map(int, args.batches.split(",")):
        base = None
        for name, sync in modes().items():
            step, compute, _ = measure(sync, batch, args.steps)
            base = step if name == "BSP" else base
            rows.append({"batch": batch, "mode": name, "step_ms": 1e3 * step, "compute_ms": 1e3 * compute,
                         "own_ms": 1e3 * (step - base), "own_share": (step - base) / compute})
    print("| batch | mode | step (ms) | compute (ms) | own work: step - BSP's (ms) | own / compute |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['mode']} | {r['step_ms']:.1f} | {r['compute_ms']:.1f} | "
              f"{r['own_ms']:.1f} | {100 * r['own_share']:.1f}% |")
    batch = int(args.batches.split(",")[0])
    print(f"\nInside step(), per step, batch {batch} (torch.profiler self CPU time, ms):\n")
    prof = {name: measure(sync, batch, 15, profile=True)[2] for name, sync in modes().items()
            if name in ("BSP", "OSP(0.2)")}
    out["phases"] = prof
    keys = sorted({k for p in prof.values() for k in p}, key=lambda k: -prof["OSP(0.2)"].get(k, 0.0))
    print("| phase | BSP | OSP(0.2) |")
    print("|---|---|---|")
    for k in keys:
        print(f"| {k} | {prof['BSP'].get(k, 0.0):.2f} | {prof['OSP(0.2)'].get(k, 0.0):.2f} |")
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
