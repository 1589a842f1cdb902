"""The example job: a small CNN on scikit-learn's handwritten digits, data-parallel on N ranks.

    horovodrun -np 2 -H localhost:2 python -m osp.train --sync osp --critical 0.25
    torchrun --nproc-per-node 2 -m osp.train --sync osp --critical auto --backend torch
    torchrun --nproc-per-node 2 -m osp.train --sync hsp --straggler 1:2   # rank 1 computes 2x slower
    python -m osp.train --sync bsp                # one process, for a quick look

``--sync`` picks the optimizer wrapper: ``bsp`` / ``osp`` / ``dsync`` / ``hsp``
(osp.DistributedOptimizer), ``hvd`` (horovod.torch.DistributedOptimizer) or ``ddp`` (torch
DistributedDataParallel), so the same job measures all of them. The digits split is fixed (30% test,
stratified, random_state=0); every rank reads micro-batches from its own shard of each epoch's
shuffle, then of the next epoch's. An epoch is one pass's worth of samples over all ranks: a fixed
number of steps, except under HSP, where ranks that are ahead compute extra micro-batches (drawn from
their own shard) and the epoch ends when the data is used up. ``--straggler RANK:FACTOR`` makes one
rank's compute FACTOR times slower. Rank 0 shows progress and writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

import osp
from osp.launcher import init_from_env


def load_digits_split(seed_split: int = 0):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    y = torch.tensor(d.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(list(range(len(y))), test_size=0.3, random_state=seed_split,
                                           stratify=d.target)
    return x[idx_train], y[idx_train], x[idx_test], y[idx_test]


class DigitsCNN(torch.nn.Module):
    """conv(1->C) conv(C->2C) pool fc(2C*16->64*width) fc(->10), C = ``channels``: ~38K parameters at
    width 1 and 16 channels. More channels: more compute per parameter."""

    def __init__(self, width: int = 1, channels: int = 16):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, channels, 3, padding=1)
        self.conv2 = torch.nn.Conv2d(channels, 2 * channels, 3, padding=1)
        self.fc1 = torch.nn.Linear(2 * channels * 4 * 4, 64 * width)
        self.fc2 = torch.nn.Linear(64 * width, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def detect_backend() -> str:
    env = os.environ
    if "HOROVOD_RANK" in env or "HOROVOD_HOSTNAME" in env:
        return "horovod"
    if "RANK" in env or "OMPI_COMM_WORLD_RANK" in env:
        return "torch"
    return "single"


def init(backend: str, device: str = "cpu"):
    if backend == "single":
        # one process: an in-memory store, so no port is picked in advance (another process could
        # take it in between)
        import torch.distributed as dist

        dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
        return osp.comm.TorchComm(), "torch"
    return init_from_env(backend, device=device), backend


class Progress:
    """A one-line progress bar on a terminal; one line per epoch otherwise."""

    def __init__(self, enabled: bool):
        self.enabled, self.tty = enabled, sys.stderr.isatty()

    def update(self, epoch, epochs, i, n, loss):
        if self.enabled and self.tty:
            w = 30
            done = int(w * (i + 1) / n)
            sys.stderr.write(f"\repoch {epoch + 1}/{epochs} [{'#' * done}{'.' * (w - done)}] "
                             f"{i + 1}/{n} loss {loss:.4f}")
            sys.stderr.flush()

    def epoch(self, text):
        if self.enabled:
            if self.tty:
                sys.stderr.write("\r" + " " * 79 + "\r")
            print(text, flush=True)


OSP_MODES = ("bsp", "osp", "dsync", "hsp")  # the --sync choices that osp.DistributedOptimizer runs


def make_optimizer(args, model, comm, backend):
    if args.optimizer == "sgd":
        inner = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=args.weight_decay)
    else:
        inner = torch.optim.Adam(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    if args.sync in OSP_MODES:
        if args.sync == "bsp":
            sync = osp.BSP()
        elif args.sync == "hsp":
            sync = osp.HSP(max_extra=args.max_extra)
        elif args.sync == "dsync":
            delay = args.delay if args.delay == "auto" else int(args.delay)
            sync = osp.DSync(delay=delay, max_delay=max(args.max_delay, 1 if delay == "auto" else delay))
        else:
            crit = args.critical if args.critical == "auto" else float(args.critical)
            sync = osp.OSP(critical=crit, min_critical=args.min_critical, block_size=args.block_size,
                           metric=args.metric)
        return model, osp.DistributedOptimizer(inner, model.named_parameters(), sync=sync, backend=backend)
    if args.sync == "hvd":
        import horovod.torch as hvd

        return model, hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters())
    if args.sync == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        inner = type(inner)(ddp.parameters(), **inner.defaults)
        return ddp, inner
    raise ValueError(f"unknown --sync {args.sync!r}")


def parse_straggler(text: str, size: int):
    """``RANK:FACTOR`` -> (rank, factor): that rank's compute is FACTOR (>= 1) times slower."""
    try:
        r, f = text.split(":")
        r, f = int(r), float(f)
    except ValueError:
        raise ValueError(f"--straggler must be RANK:FACTOR (e.g. 1:2), got {text!r}") from None
    if not 0 <= r < size or not f >= 1.0:
        raise ValueError(f"--straggler {text}: RANK must be in [0, {size - 1}] and FACTOR >= 1")
    return r, f


def micro_batch_seconds(model, x, y, reps: int = 7) -> float:
    """This rank's compute for one micro-batch (forward and backward of a copy of the model, no
    collective): the median of ``reps`` after two warm-ups."""
    import copy

    m = copy.deepcopy(model)
    times = []
    for _ in range(reps + 2):
        t0 = time.perf_counter()
        F.cross_entropy(m(x), y).backward()
        times.append(time.perf_counter() - t0)
    return sorted(times[2:])[reps // 2]


def micro_batches(rank: int, size: int, n: int, batch: int, steps: int, seed: int):
    """This rank's micro-batches (sample indices), endlessly: its shard of epoch 0's shuffle, then of
    epoch 1's, ... (with one micro-batch per rank and step, epoch e uses exactly epoch e's shard)."""
    e = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1000 + e)
        shard = torch.randperm(n, generator=g)[: steps * batch * size][rank::size]
        for i in range(steps):
            yield shard[i * batch:(i + 1) * batch]
        e += 1


def evaluate(model, x, y):
    model.eval()
    with torch.no_grad():
        logits = model(x)
        loss = F.cross_entropy(logits, y).item()
        acc = (logits.argmax(1) == y).float().mean().item()
    model.train()
    return loss, acc


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sync", choices=["bsp", "osp", "dsync", "hsp", "hvd", "ddp"], default="osp")
    ap.add_argument("--critical", default="0.25", help="OSP critical share in [0,1] or 'auto'")
    ap.add_argument("--min-critical", type=float, default=0.05)
    ap.add_argument("--delay", default="2", help="DSync delay: an integer >= 1 or 'auto'")
    ap.add_argument("--max-delay", type=int, default=4, help="DSync: the largest delay 'auto' may choose")
    ap.add_argument("--max-extra", type=int, default=4, help="HSP: extra micro-batches a rank may compute a step")
    ap.add_argument("--straggler", default=None, metavar="RANK:FACTOR",
                    help="make RANK's compute FACTOR times slower (a sleep of FACTOR-1 times its measured "
                         "micro-batch compute, between forward and backward)")
    ap.add_argument("--block-size", type=int, default=512)
    ap.add_argument("--metric", default="l2")
    ap.add_argument("--epochs", type=int, default=15)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--width", type=int, default=1, help="multiplies the hidden layer (model size)")
    ap.add_argument("--channels", type=int, default=16, help="channels of the first conv layer (compute)")
    ap.add_argument("--backend", choices=["auto", "horovod", "torch"], default="auto")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model lives (cuda: the GPU of each rank's local rank; NCCL with torch)")
    ap.add_argument("--stop-at-acc", type=float, default=None, metavar="ACC",
                    help="stop after the first epoch whose test accuracy (a fraction) reaches ACC")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    ap.add_argument("--json", default=None, help="write metrics here (rank 0)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if args.critical != "auto":
        try:
            float(args.critical)
        except ValueError:
            ap.error(f"--critical must be a number in [0, 1] or 'auto', got {args.critical!r}")
    if args.delay != "auto" and not args.delay.isdigit():
        ap.error(f"--delay must be an integer >= 1 or 'auto', got {args.delay!r}")

    torch.set_num_threads(args.threads)
    backend = detect_backend() if args.backend == "auto" else args.backend
    if args.sync == "hvd" and backend != "horovod":
        ap.error("--sync hvd needs horovodrun/mpirun with the horovod backend")
    if args.sync == "ddp" and backend == "horovod":
        ap.error("--sync ddp needs torch.distributed (torchrun, or --backend torch)")
    comm, backend = init(backend, args.device)
    rank, size = comm.rank, comm.size
    straggler = None
    if args.straggler is not None:
        try:
            straggler = parse_straggler(args.straggler, size)
        except ValueError as e:
            ap.error(str(e))

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    x_train, y_train, x_test, y_test = (t.to(dev) for t in load_digits_split())
    torch.manual_seed(args.seed)
    model = DigitsCNN(args.width, args.channels).to(dev)
    osp.broadcast_parameters(model.state_dict(), root_rank=0, backend=comm)
    # the straggler's extra compute: a sleep between forward and backward (so DDP's and Horovod's
    # in-backward averaging start late too), FACTOR-1 times its measured micro-batch
    slow_s = 0.0
    if straggler is not None and straggler[0] == rank:
        slow_s = (straggler[1] - 1.0) * micro_batch_seconds(model, x_train[:args.batch_size],
                                                            y_train[:args.batch_size])
    model, opt = make_optimizer(args, model, comm, comm if args.sync in OSP_MODES else backend)
    nparams = sum(p.numel() for p in model.parameters())

    steps = len(y_train) // (args.batch_size * size)
    progress = Progress(rank == 0 and not args.no_progress)
    if rank == 0:
        progress.epoch(f"osp.train: sync={args.sync} critical={args.critical} ranks={size} backend={backend} "
                       f"params={nparams} steps/epoch={steps} seed={args.seed}")
    history, train_time, samples_total = [], 0.0, 0
    batches = micro_batches(rank, size, len(y_train), args.batch_size, steps, args.seed)

    def micro_batch():
        """Forward and backward of this rank's next micro-batch (slowed on the straggler)."""
        idx = next(batches)
        loss = F.cross_entropy(model(x_train[idx]), y_train[idx])
        if slow_s:
            time.sleep(slow_s)
        loss.backward()
        return loss

    for epoch in range(args.epochs):
        t0 = time.perf_counter()
        tot, done, nsteps = 0.0, 0, 0  # micro-batches of all ranks this epoch, steps
        while done < steps * size:
            opt.zero_grad()
            loss = micro_batch()
            if args.sync == "hsp":  # ranks that are ahead compute more micro-batches meanwhile
                opt.step(micro_batch)
                done += sum(opt.last_step()["micro_batches"])
            else:
                opt.step()
                done += size
            nsteps += 1
            tot += loss.item()
            progress.update(epoch, args.epochs, min(done, steps * size) - 1, steps * size, loss.item())
        if isinstance(opt, osp.DistributedOptimizer):
            opt.flush()  # exact parameters before evaluating
            osp.sync_buffers(model, backend=comm)  # equal buffers (BatchNorm statistics) on every rank
        dt = time.perf_counter() - t0
        train_time += dt
        samples_total += done * args.batch_size
        test_loss, test_acc = evaluate(model, x_test, y_test)
        rec = {"epoch": epoch + 1, "train_loss": tot / nsteps, "test_loss": test_loss, "test_acc": test_acc,
               "samples_per_s": done * args.batch_size / dt, "steps": nsteps, "epoch_s": dt, "wall_s": train_time}
        history.append(rec)
        progress.epoch(f"epoch {epoch + 1:3d}  loss {rec['train_loss']:.4f}  test acc {100 * test_acc:6.2f}%  "
                       f"{rec['samples_per_s']:8.0f} samples/s")
        # every rank evaluates the same parameters on the same data, so all stop at the same epoch
        if args.stop_at_acc is not None and test_acc >= args.stop_at_acc:
            break
    sleeps = comm.allgather_object(slow_s)  # per rank: its sleep per micro-batch (the straggler's)
    result = {"config": vars(args) | {"ranks": size, "backend": backend, "params": nparams,
                                      "straggler_sleep_s": sleeps},
              "epochs": history, "final_test_acc": history[-1]["test_acc"] if history else None,
              "samples_per_s": samples_total / max(train_time, 1e-9),
              "train_s": train_time}
    if isinstance(opt, osp.DistributedOptimizer):
        st = opt.stats()
        result["osp_stats"] = {"mean": st["mean"], "skipped_steps": st["skipped_steps"]}
        if "delay" in st:
            result["osp_stats"]["delay"] = st["delay"]
        if "hsp" in st:
            result["osp_stats"]["hsp"] = st["hsp"]
    if rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.shutdown()
    else:
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
