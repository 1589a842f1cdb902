"""Time inside ``step()`` per mode and optimizer, one rank, no network: the median of ``stats()``'s
``step_s`` over steps 6-25, on a 6.3M-parameter MLP (batch 64, one thread). To compare two versions of
osp side by side, run it under each one's ``PYTHONPATH`` (e.g. an older commit's python/ unpacked with
``git archive``, with the built extension copied in), alternating, on an otherwise idle machine.

    python bench/step_time.py [--modes dsync2,dsync1,osp0.25] [--optimizers sgd,adam] [--label new]
"""
import argparse
import statistics

import torch
import torch.distributed as dist

import osp

MODES = {"dsync1": lambda: osp.DSync(delay=1), "dsync2": lambda: osp.DSync(delay=2),
         "dsync3": lambda: osp.DSync(delay=3), "osp0.25": lambda: osp.OSP(0.25), "bsp": lambda: osp.BSP()}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=1e-3)}


def step_ms(sync, make_opt, steps: int) -> float:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                            torch.nn.ReLU(), torch.nn.Linear(2048, 10))
    opt = osp.DistributedOptimizer(make_opt(m.parameters()), m.named_parameters(), sync=sync, backend="torch")
    x, y = torch.randn(64, 1024), torch.randint(0, 10, (64,))
    for _ in range(steps):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(m(x), y).backward()
        opt.step()
    opt.flush()
    return statistics.median(r["step_s"] for r in opt.stats()["history"][5:]) * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="dsync2,dsync1,osp0.25")
    ap.add_argument("--optimizers", default="sgd,adam")
    ap.add_argument("--steps", type=int, default=25)
    ap.add_argument("--label", default="", help="a name for this version of osp, printed on each line")
    a = ap.parse_args()
    for name in a.modes.split(","):
        if name not in MODES:
            ap.error(f"--modes: expected some of {sorted(MODES)}, got {name!r}")
    for name in a.optimizers.split(","):
        if name not in OPTIMIZERS:
            ap.error(f"--optimizers: expected some of {sorted(OPTIMIZERS)}, got {name!r}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    for mode in a.modes.split(","):
        for o in a.optimizers.split(","):
            print(f"{a.label}\t{mode}\t{o}\t{step_ms(MODES[mode](), OPTIMIZERS[o], a.steps):.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
