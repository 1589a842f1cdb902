"""Samples/s under PyTorch Lightning behind a shaped link: ``Trainer(strategy=OSPStrategy(OSP(auto)))`` against
``Trainer(strategy="ddp")``, with the same model, batch and network, in one run (needs root: ranks in network
namespaces, bench/netem).

    python bench/lightning_throughput.py                     # 2 ranks, 1 Gbit/s, MLP 8.4M, batch 512
    python bench/lightning_throughput.py --rate 10gbit --repeats 3

Each rank is one Lightning "node" (``devices=1, num_nodes=N``) in its own namespace; the Trainer runs
``--warmup + --steps`` steps on a fixed synthetic batch (bench/models.py), and a callback times each step from one
``on_train_batch_end`` to the next. Beside the Lightning contenders the same run measures, with
bench/train_throughput.py's worker, the plain loops (``osp-auto``: osp's optimizer in a hand-written loop; ``ddp``)
and the halves of the perfect-overlap bound (``compute``: the step without a collective; ``allreduce``: the
gradient's allreduce alone). Contenders take turns, ``--repeats`` times; the table has each one's median.
samples/s counts every rank's samples (the per-rank batch times the ranks over the step time), as train_throughput
does.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

LIGHTNING = ("lightning-ddp", "lightning-osp-auto", "lightning-osp-0.25", "lightning-osp-bsp")
PLAIN = ("compute", "allreduce", "ddp", "osp-auto", "osp-0.25", "osp-bsp")


def worker(a) -> None:
    import warnings

    warnings.filterwarnings("ignore")
    import pytorch_lightning as pl
    import torch

    import osp
    from bench.models import build
    from osp.lightning import OSPStrategy

    torch.set_num_threads(1)
    os.environ["NODE_RANK"] = os.environ["RANK"]  # one rank per namespace: each a Lightning node
    ranks = int(os.environ["WORLD_SIZE"])
    net, make_batch, loss_fn = build(a.model, a.width)
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    x, y = make_batch(a.batch, g)

    class Fixed(torch.utils.data.Dataset):
        def __len__(self):
            return 10 ** 6

        def __getitem__(self, i):
            return 0

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            return loss_fn(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    class Clock(pl.Callback):
        def __init__(self):
            self.ends = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.ends.append(time.perf_counter())

    strategy = {"lightning-ddp": lambda: "ddp",
                "lightning-osp-auto": lambda: OSPStrategy(sync=osp.OSP(critical="auto", block_size=a.block_size)),
                "lightning-osp-0.25": lambda: OSPStrategy(sync=osp.OSP(critical=0.25, block_size=a.block_size)),
                "lightning-osp-bsp": lambda: OSPStrategy(sync=osp.BSP())}[a.contender]()
    clock = Clock()
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, num_nodes=ranks,
                         max_steps=a.warmup + a.steps + 1, enable_progress_bar=False, logger=False,
                         enable_checkpointing=False, enable_model_summary=False, callbacks=[clock],
                         use_distributed_sampler=False)
    trainer.fit(Module(), torch.utils.data.DataLoader(Fixed(), batch_size=1))
    gaps = [b - e for e, b in zip(clock.ends, clock.ends[1:])][a.warmup:]
    step_s = statistics.median(gaps)
    out = {"contender": a.contender, "ranks": ranks, "batch": a.batch, "model": a.model, "step_s": step_s,
           "samples_per_s": a.batch * ranks / step_s, "steps_timed": len(gaps)}
    opts = [o._optimizer if hasattr(o, "_optimizer") else o for o in trainer.optimizers]
    if isinstance(opts[0], osp.DistributedOptimizer):
        hist = opts[0].stats()["history"]
        out["criticals"] = [h.get("critical_fraction") for h in hist]
        out["critical_fraction"] = statistics.median(h["critical_fraction"] for h in hist[a.warmup:])
    if trainer.global_rank == 0:
        with open(a.out, "w") as fh:
            json.dump(out, fh)


def run_lightning(NetEm, a, contender: str, tmp: str) -> dict:
    out = os.path.join(tmp, f"{contender}.json")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--contender", contender, "--out", out,
            "--model", a.model, "--width", str(a.width), "--batch", str(a.batch), "--steps", str(a.steps),
            "--warmup", str(a.warmup), "--block-size", str(a.block_size)]
    log = os.path.join(tmp, f"log-{contender}")
    with NetEm(a.ranks, rate=None if a.rate == "none" else a.rate) as net:
        codes = net.run("torch", argv, timeout=a.run_timeout, env={"PYTHONPATH": ROOT + "/python:" + ROOT},
                        log_prefix=log)
    if any(codes) or not os.path.exists(out):
        with open(log + ".rank0.log") as fh:
            return {"contender": contender, "error": f"exit codes {codes}: {fh.read()[-2000:]}"}
    with open(out) as fh:
        return json.load(fh)


def run_plain(NetEm, a, contender: str, tmp: str) -> dict:
    from bench import train_throughput as tt

    sub = argparse.Namespace(width=a.width, steps=a.steps, warmup=a.warmup, block_size=a.block_size,
                             osp_backend="torch", jitter=0.0, timing="median", max_extra=4, switch=None,
                             run_timeout=a.run_timeout)
    return tt.run_contender(NetEm, a.rate, a.ranks, contender, sub, tmp, model=a.model, batch=a.batch)


def summarize(rows, a) -> dict:
    by = {}
    for r in rows:
        if "error" not in r:
            by.setdefault(r["contender"], []).append(r)
    med = {c: statistics.median(r["samples_per_s"] for r in rs) for c, rs in by.items()}
    step = {c: statistics.median(r["step_s"] for r in rs) for c, rs in by.items()}
    out = {"rate": a.rate, "ranks": a.ranks, "model": a.model, "batch": a.batch, "repeats": a.repeats,
           "samples_per_s": med, "step_s": step}
    if "compute" in step and "allreduce" in step:
        bound = max(step["compute"], step["allreduce"])
        out["bound_s"] = bound
        out["share_of_bound"] = {c: bound / s for c, s in step.items() if c not in ("compute", "allreduce")}
    if "lightning-ddp" in med:
        out["x_lightning_ddp"] = {c: v / med["lightning-ddp"] for c, v in med.items()
                                  if c not in ("compute", "allreduce")}
    return out


def table(s: dict) -> str:
    lines = ["| contender | samples/s | step (s) | share of bound | x Lightning DDP |", "|---|---|---|---|---|"]
    for c in (*LIGHTNING, *PLAIN[2:], *PLAIN[:2]):
        if c in s["samples_per_s"]:
            share = s.get("share_of_bound", {}).get(c)
            x = s.get("x_lightning_ddp", {}).get(c)
            lines.append(f"| {c} | {s['samples_per_s'][c]:.0f} | {s['step_s'][c]:.3f} | "
                         f"{'' if share is None else f'{share:.2f}'} | {'' if x is None else f'{x:.2f}'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--contender", default="lightning-osp-auto", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--model", default="mlp")
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=512, help="per rank")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--rate", default="1gbit", help="link rate as tc writes it, or none")
    ap.add_argument("--steps", type=int, default=10, help="steps timed, after the warm-up")
    ap.add_argument("--warmup", type=int, default=12, help="steps not timed (OSP auto settles by step 10)")
    ap.add_argument("--block-size", type=int, default=65536)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--contenders", default=",".join(LIGHTNING[:2] + PLAIN[:4]))
    ap.add_argument("--run-timeout", type=float, default=300)
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "lightning_throughput.json"))
    a = ap.parse_args(argv)
    if a.worker:
        worker(a)
        return 0
    from bench.netem.netem import NetEm

    contenders = a.contenders.split(",")
    rows = []
    with tempfile.TemporaryDirectory(prefix="osp-lightning-bench-") as tmp:
        for rep in range(a.repeats):
            for c in contenders:
                r = (run_lightning if c.startswith("lightning-") else run_plain)(NetEm, a, c, tmp)
                r["repeat"] = rep
                rows.append(r)
                print(json.dumps({k: v for k, v in r.items() if k not in ("criticals", "budget", "arrivals")})[:400],
                      flush=True)
    s = summarize(rows, a)
    s["rows"] = rows
    s["command"] = "python bench/lightning_throughput.py " + " ".join(argv if argv is not None else sys.argv[1:])
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump(s, fh, indent=1)
    print(table(s))
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
