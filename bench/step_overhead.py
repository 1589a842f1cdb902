"""osp's own time per step against the compute, one rank, no network: what a mode costs besides the
allreduce. A 7.3M-parameter MLP, batch 64, one thread, SGD with momentum; the mean over steps 6-25
of ``stats()``'s ``step_s`` (inside ``step()``) and ``compute_s`` (forward and backward, with BSP's
averaging, which finishes in backward).

    python bench/step_overhead.py [--steps 25]
"""
import argparse

import torch
import torch.distributed as dist

import osp


def measure(sync, steps):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 1024))
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                   model.named_parameters(), sync=sync, backend="torch")
    x = torch.randn(64, 1024)
    for _ in range(steps):
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()
    opt.flush()
    hist = opt.stats()["history"][5:]
    mean = lambda k: sum(h[k] for h in hist) / len(hist)  # noqa: E731
    return mean("step_s"), mean("compute_s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=25)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    print("| mode | step (ms) | compute (ms) | step / compute |")
    print("|---|---|---|---|")
    for name, sync in (("BSP", osp.BSP()), ("OSP(0.25)", osp.OSP(critical=0.25)), ("DSync(2)", osp.DSync(delay=2))):
        step, compute = measure(sync, args.steps)
        print(f"| {name} | {step * 1e3:.1f} | {compute * 1e3:.1f} | {step / compute:.2f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
