"""What the runtime replica check costs (``DistributedOptimizer(check_replicas=N)``, python/osp/replicas.py), as a
share of a training step, on 2 ranks of this machine (torch.distributed, Gloo over loopback, one thread each).

For each model (the throughput bench's MLP, 8.3M parameters, and ResNet-18) and mode (BSP, OSP(0.25)), with SGD
with momentum (so the state doubles what is digested) and with AdamW: the mean step (forward, backward, step) with
the check off (``check_replicas=0``) and with a check at every step (``check_replicas=1``), interleaved in rounds
so drift hits both alike; one check's cost is their difference, and the share at the default interval (1000 steps)
is that divided by 1000 steps. Also the check alone (digest and collective, no training) timed directly.

    python bench/replica_check.py [--steps 10] [--rounds 2] [--json bench/results/replica_check.json]

Run nothing else on the machine meanwhile (2 cores).
"""
import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "python"))
import osp  # noqa: E402
from bench.models import build  # noqa: E402

DEFAULT_EVERY = 1000
CONFIGS = [("mlp", 256, "sgd"), ("mlp", 256, "adamw"), ("resnet18", 16, "sgd")]
MODES = {"BSP": lambda: osp.BSP(), "OSP(0.25)": lambda: osp.OSP(critical=0.25)}


def make_opt(name, params):
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-3)


def run_steps(model, opt, x, y, loss_fn, steps):
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    opt.flush()
    return (time.perf_counter() - t0) / steps


def worker(rank, size, store_path, args, out):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=size)
    torch.set_num_threads(1)
    rows = []
    for model_name, batch, oname in CONFIGS:
        for mode, make in MODES.items():
            times = {0: [], 1: []}
            alone = []
            for _ in range(args.rounds):
                for every in (0, 1):
                    model, make_batch, loss_fn = build(model_name)
                    opt = osp.DistributedOptimizer(make_opt(oname, model.parameters()), model.named_parameters(),
                                                   sync=make(), backend="torch", check_replicas=every)
                    x, y = make_batch(batch, torch.Generator().manual_seed(rank))
                    run_steps(model, opt, x, y, loss_fn, 3)  # warm-up (and the state made)
                    times[every].append(run_steps(model, opt, x, y, loss_fn, args.steps))
                    if every:
                        t0 = time.perf_counter()
                        for _ in range(5):
                            opt._replicas.check("bench")
                        alone.append((time.perf_counter() - t0) / 5)
            off, on = statistics.median(times[0]), statistics.median(times[1])
            nparams = sum(p.numel() for p in model.parameters())
            rows.append({"model": model_name, "params": nparams, "optimizer": oname, "mode": mode, "batch": batch,
                         "step_s": off, "step_checked_s": on, "check_s": on - off,
                         "check_alone_s": statistics.median(alone),
                         "share_every_step": (on - off) / off,
                         f"share_every_{DEFAULT_EVERY}": max(on - off, 0.0) / off / DEFAULT_EVERY,
                         "rounds": args.rounds, "steps": args.steps})
    if rank == 0:
        out.put(rows)
    dist.barrier()
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "results", "replica_check.json"))
    args = ap.parse_args(argv)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    store = f"/tmp/osp-replica-bench-{os.getpid()}"
    procs = [ctx.Process(target=worker, args=(r, 2, store, args, out)) for r in range(2)]
    for p in procs:
        p.start()
    rows = out.get()
    for p in procs:
        p.join()
    if os.path.exists(store):
        os.remove(store)
    print(f"| model | optimizer | mode | step (ms) | one check (ms) | check alone (ms) | share, every step | "
          f"share, every {DEFAULT_EVERY} |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} ({r['params'] / 1e6:.1f}M) | {r['optimizer']} | {r['mode']} | {r['step_s'] * 1e3:.1f} | "
              f"{r['check_s'] * 1e3:.2f} | {r['check_alone_s'] * 1e3:.2f} | {100 * r['share_every_step']:.1f}% | "
              f"{100 * r[f'share_every_{DEFAULT_EVERY}']:.4f}% |")
    with open(args.json, "w") as f:
        json.dump({"command": "python bench/replica_check.py " + " ".join(argv or sys.argv[1:]), "rows": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
