"""The example job: a small CNN (or, with ``--model mlp``, a wide MLP) on scikit-learn's handwritten
digits, data-parallel on N ranks.

    horovodrun -np 2 -H localhost:2 python -m osp.train --sync osp --critical 0.25
    torchrun --nproc-per-node 2 -m osp.train --sync osp --critical auto --backend torch
    torchrun --nproc-per-node 2 -m osp.train --sync hsp --straggler 1:2   # rank 1 computes 2x slower
    python -m osp.train --sync bsp                # one process, for a quick look
    torchrun --nproc-per-node 2 -m osp.train --model mlp --width 32 --batch-size 256 --link 1gbit  # a slow link,
                                                  # emulated in user space (osp.linkemu; not a real network)

``--sync`` picks the optimizer wrapper: ``bsp`` / ``osp`` / ``dsync`` / ``hsp``
(osp.DistributedOptimizer), ``hvd`` (horovod.torch.DistributedOptimizer) or ``ddp`` (torch
DistributedDataParallel), so the same job measures all of them. The digits split is fixed (30% test,
stratified, random_state=0); every rank reads micro-batches from its own shard of each epoch's
shuffle, then of the next epoch's. An epoch is one pass's worth of samples over all ranks: a fixed
number of steps, except under HSP, where ranks that are ahead compute extra micro-batches (drawn from
their own shard) and the epoch ends when the data is used up. ``--straggler RANK:FACTOR`` makes one
rank's compute FACTOR times slower. ``--link RATE[,LATENCY]`` makes every collective of the job (osp's,
Horovod's optimizer's, DDP's) take at least as long as a ring allreduce of its bytes behind such a link
(``osp.linkemu``: user space, not a real network). Rank 0 shows progress, says at the end what each mode
decided (OSP ``auto``'s share and why, DSync's delay, a slow rank) and writes ``--json``.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import torch
import torch.nn.functional as F

import osp
from osp import linkemu
from osp.launcher import detect_backend, init_from_env


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


class DigitsMLP(torch.nn.Module):
    """fc(64->64*width) fc(->64*width) fc(->10): 4.35M parameters at width 32, nearly all of them in
    the middle layer, whose gradient is ready only when the backward is almost done (so averaging
    inside the backward, as DDP does, has almost nothing left to hide it behind)."""

    def __init__(self, width: int = 1):
        super().__init__()
        self.fc1 = torch.nn.Linear(64, 64 * width)
        self.fc2 = torch.nn.Linear(64 * width, 64 * width)
        self.fc3 = torch.nn.Linear(64 * width, 10)

    def forward(self, x):
        return self.fc3(F.relu(self.fc2(F.relu(self.fc1(x.flatten(1))))))


def build_model(name: str, width: int = 1, channels: int = 16) -> torch.nn.Module:
    """The job's model: ``cnn`` (DigitsCNN(width, channels)) or ``mlp`` (DigitsMLP(width))."""
    if name == "cnn":
        return DigitsCNN(width, channels)
    if name == "mlp":
        return DigitsMLP(width)
    raise ValueError(f"model: expected 'cnn' or 'mlp', got {name!r}")


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
    """A one-line progress bar on a terminal, redrawn at most every ``INTERVAL`` s (and at an epoch's last step:
    drawn every step, rank 0 alone wrote to the terminal every step of a few-ms model); one line per epoch
    otherwise."""

    INTERVAL = 0.1

    def __init__(self, enabled: bool):
        self.enabled, self.tty = enabled, sys.stderr.isatty()
        self._drawn = 0.0

    def update(self, epoch, epochs, i, n, loss):
        """``loss``: a number, or a tensor (read only when the bar is drawn)."""
        if self.enabled and self.tty:
            now = time.monotonic()
            if now - self._drawn < self.INTERVAL and i + 1 < n:
                return
            self._drawn = now
            loss = float(loss)
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
    if args.compression == "powersgd" and args.sync != "ddp":
        raise ValueError(f"--compression powersgd is DDP's PowerSGD hook (--sync ddp), got --sync {args.sync}: "
                         "osp and Horovod compress with fp16 (or bf16 on osp)")
    if args.sync in OSP_MODES:
        if args.sync == "hsp":  # composed with --hsp-sync, built from the same flags
            sync = osp.HSP(max_extra=args.max_extra, sync=sync_mode(args, getattr(args, "hsp_sync", "bsp")))
        else:
            sync = sync_mode(args, args.sync)
        return model, osp.DistributedOptimizer(inner, model.named_parameters(), sync=sync, backend=backend,
                                               compression=args.compression)
    if args.sync == "hvd":
        import horovod.torch as hvd

        if args.compression == "bf16":
            raise ValueError("--compression bf16: Horovod 0.28.1 has no bfloat16 collectives")
        compression = hvd.Compression.fp16 if args.compression == "fp16" else hvd.Compression.none
        link = getattr(args, "link", None)
        if link is not None:  # its allreduce_async_ and synchronize, as its optimizer calls them
            linkemu.emulate_horovod_optimizer(link)
        return model, hvd.DistributedOptimizer(inner, named_parameters=model.named_parameters(),
                                               compression=compression)
    if args.sync == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        link = getattr(args, "link", None)
        if link is not None:  # DDP's own hook (compressed or not), completing behind the emulated link
            ddp.register_comm_hook(None, linkemu.ddp_hook(link, args.compression))
        else:
            register_ddp_compression(ddp, args.compression)
        inner = type(inner)(ddp.parameters(), **inner.defaults)
        return ddp, inner
    if args.sync == "fsdp":
        model = fully_shard_model(model, args.compression)
        return model, type(inner)(model.parameters(), **inner.defaults)
    raise ValueError(f"unknown --sync {args.sync!r}")


def arrivals_line(a: dict) -> str:
    """``stats()["arrivals"]`` in one line: which rank holds the job back, if one does."""
    if not a["steps"]:
        return "osp.train: arrivals: not measured (one rank, or too few steps)"
    means = " ".join(f"{m:.1f}" for m in a["arrival_ms"])
    n = a.get("named")
    if n is None:
        return f"osp.train: no slow rank (mean ms from step to synchronization per rank: {means})"
    return (f"osp.train: slow rank {n['rank']}: {n['slower']:.1f}x slower than the median of the others, named at "
            f"step {n['at_step']} ({n['median_ms']:.1f} ms against {n['others_median_ms']:.1f} ms, behind them in "
            f"{n['persistence']:.0%} of the steps; mean ms from step to synchronization per rank: {means})")


def sync_mode(args, name: str):
    """``osp.BSP``, ``osp.OSP`` or ``osp.DSync`` from the flags (``name``: ``bsp``, ``osp`` or ``dsync``)."""
    if name == "bsp":
        return osp.BSP()
    if name == "dsync":
        delay = args.delay if args.delay == "auto" else int(args.delay)
        return osp.DSync(delay=delay, max_delay=max(args.max_delay, 1 if delay == "auto" else delay))
    crit = args.critical if args.critical == "auto" else float(args.critical)
    return osp.OSP(critical=crit, min_critical=args.min_critical, block_size=args.block_size,
                   metric=args.metric, stage2_compression=args.stage2_compression)


def register_ddp_compression(ddp, name: str) -> None:
    """DDP's own compression for ``--compression``: its ``fp16_compress_hook`` / ``bf16_compress_hook``
    (bf16's refuses Gloo, with its reason), or PowerSGD as its docs set it up (rank 4, error feedback,
    the first 10 iterations uncompressed). On Gloo, PowerSGD with several buckets hangs or aborts (seen
    here with torch 2.13): its hook starts its P and Q allreduces from inside future callbacks, which
    Gloo runs on its worker threads, so two ranks may start them in different orders (Gloo: "Is there a
    distributed collective mismatch in your code?") or both threads block waiting for them; a group of
    its own with more threads hangs too."""
    if name in ("fp16", "bf16"):
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        ddp.register_comm_hook(None, getattr(default_hooks, f"{name}_compress_hook"))
    elif name == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=4,
                                            start_powerSGD_iter=10, use_error_feedback=True)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif name != "none":
        raise ValueError(f"--compression {name!r}: DDP has none, fp16, bf16 and powersgd")


def fully_shard_model(model, compression: str = "none"):
    """``model`` sharded in place over every rank with FSDP2 (``torch.distributed.fsdp.fully_shard``): a unit
    per item of its outermost ``nn.Sequential`` / ``nn.ModuleList`` (an MLP's layers, ResNet's blocks, a
    GPT's blocks), or, in a model without one, per child module holding parameters; then the root. The
    parameters stay gathered from forward to backward (``reshard_after_forward=False``), the gradients are
    reduce-scattered in float32, or in ``compression`` (fp16, bf16: ``MixedPrecisionPolicy(reduce_dtype=)``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dtypes = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}
    if compression not in dtypes:
        raise ValueError(f"--compression {compression!r}: FSDP reduces in float32 (none), fp16 or bf16")
    units = []

    def visit(m):
        for child in m.children():
            if isinstance(m, (torch.nn.Sequential, torch.nn.ModuleList)) and any(True for _ in child.parameters()):
                units.append(child)
            else:
                visit(child)

    visit(model)
    if not units:
        units = [c for c in model.children() if any(True for _ in c.parameters())]
    mesh = init_device_mesh(next(model.parameters()).device.type, (torch.distributed.get_world_size(),))
    mp = MixedPrecisionPolicy(reduce_dtype=dtypes[compression])
    for m in units + [model]:
        fully_shard(m, mesh=mesh, reshard_after_forward=False, mp_policy=mp)
    return model


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


def epoch_shuffle(n: int, seed: int, epoch: int) -> torch.Tensor:
    """The order of the ``n`` training samples in ``epoch``: the same on every rank."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1000 + epoch))


def micro_batches(rank: int, size: int, n: int, batch: int, steps: int, seed: int):
    """This rank's micro-batches (sample indices), endlessly: its shard of epoch 0's shuffle, then of
    epoch 1's, ... (with one micro-batch per rank and step, epoch e uses exactly epoch e's shard)."""
    e = 0
    while True:
        shard = epoch_shuffle(n, seed, e)[: steps * batch * size][rank::size]
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


def parse_rank_step(flag: str, text: str, size: int):
    """``RANK:STEP`` -> (rank, step), for ``--fault``."""
    try:
        r, s = (int(v) for v in text.split(":"))
    except ValueError:
        raise ValueError(f"{flag} must be RANK:STEP (e.g. 1:10), got {text!r}") from None
    if not 0 <= r < size or s < 1:
        raise ValueError(f"{flag} {text}: RANK must be in [0, {size - 1}] and STEP >= 1")
    return r, s


def digest(model) -> str:
    """SHA-256 of the parameters and buffers, bit for bit: equal digests are bitwise equal replicas."""
    import hashlib

    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        if hasattr(t, "full_tensor"):  # FSDP's shard (a DTensor): the whole tensor (a collective)
            t = t.full_tensor()
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def new_position(size: int) -> dict:
    """Where a run stands: plain values only (committed by osp.elastic.State, saved in checkpoints)."""
    return {"epoch": 0, "done": 0, "step": 0, "nsteps": 0, "tot": 0.0, "epoch_s": 0.0, "history": [],
            "train_time": 0.0, "samples_total": 0, "drawn": [0] * size, "stopped": False, "resets": []}


class Job:
    """The example job's model, optimizer and data, and its training loop, shared by every way of running
    it: plainly, resumed from checkpoints (torchrun restarts) or under Horovod Elastic.

    Which samples a step computes: the next ``ranks * batch`` of the epoch's shuffle (``epoch_shuffle``),
    rank r every ranks-th (so a world that changes size mid-epoch goes on where it stood). Under HSP
    each rank instead reads an endless stream of its own shards (``micro_batches``), extras included;
    ``done`` counts micro-batches of all ranks."""

    def __init__(self, args, comm, model, opt, data, slow_s: float, progress):
        self.args, self.comm, self.model, self.opt, self.progress = args, comm, model, opt, progress
        self.x_train, self.y_train, self.x_test, self.y_test = data
        self.n = len(self.y_train)
        self.slow_s = slow_s
        self.hsp = args.sync == "hsp"
        self._perm = (None, None)
        self._stream = None
        self.started_at_zero = True  # this process trained from step 0 (a --fault fires only in such)
        self.verified = 0  # --verify-replicas: checks passed in this process
        if args.verify_replicas and isinstance(opt, osp.DistributedOptimizer):
            opt.on_synced = self.verify

    def _epoch_perm(self, epoch: int) -> torch.Tensor:
        if self._perm[0] != epoch:
            self._perm = (epoch, epoch_shuffle(self.n, self.args.seed, epoch))
        return self._perm[1]

    def steps_per_epoch(self, size: int) -> int:
        return self.n // (self.args.batch_size * size)

    def epoch_done(self, pos: dict, size: int) -> bool:
        if self.hsp:
            return pos["done"] >= self.steps_per_epoch(size) * size
        return (pos["done"] + size) * self.args.batch_size > self.n

    def start_streams(self, pos: dict) -> None:
        """HSP: this rank's stream, at the place ``pos`` says it stood."""
        rank, size = self.comm.rank, self.comm.size
        self._stream = micro_batches(rank, size, self.n, self.args.batch_size, self.steps_per_epoch(size),
                                     self.args.seed)
        for _ in range(pos["drawn"][rank]):
            next(self._stream)
        self._drawn = pos["drawn"][rank]

    def micro_batch(self, pos: dict):
        """Forward and backward of this rank's next micro-batch (slowed on the straggler)."""
        b = self.args.batch_size
        if self.hsp:
            idx = next(self._stream)
            self._drawn += 1
        else:
            rank, size = self.comm.rank, self.comm.size
            idx = self._epoch_perm(pos["epoch"])[pos["done"] * b:(pos["done"] + size) * b][rank::size]
        loss = F.cross_entropy(self.model(self.x_train[idx]), self.y_train[idx])
        if self.slow_s:
            time.sleep(self.slow_s)
        loss.backward()
        return loss

    def exact(self) -> None:
        """Exact, equal replicas: finish osp's work in flight, and equal buffers (BatchNorm statistics)."""
        if isinstance(self.opt, osp.DistributedOptimizer):
            self.opt.flush()
            osp.sync_buffers(self.model, backend=self.comm)

    def verify(self, *_) -> None:
        """``--verify-replicas``: every rank's parameters and buffers must be bitwise equal here (a
        collective; called where the replicas are exact: osp's ``on_synced``, commits, checkpoints)."""
        if not self.args.verify_replicas:
            return
        digests = self.comm.allgather_object(digest(self.model))
        if len(set(digests)) > 1:
            raise RuntimeError(f"osp.train: --verify-replicas: the replicas differ (digests per rank: "
                               f"{[d[:12] for d in digests]})")
        self.verified += 1

    def gather_drawn(self, pos: dict) -> None:
        if self.hsp:
            pos["drawn"] = self.comm.allgather_object(self._drawn)

    def run(self, pos: dict, after_step=None, after_epoch=None) -> dict:
        """Train from ``pos`` to the last epoch (or ``--stop-at-acc``), updating ``pos`` as it goes;
        ``after_step(pos)`` / ``after_epoch(pos)`` are called after each (commits, checkpoints)."""
        args, opt = self.args, self.opt
        self.progress.enabled = self.comm.rank == 0 and not args.no_progress  # (under --elastic rank 0 may change)
        if self.hsp:
            self.start_streams(pos)
        while pos["epoch"] < args.epochs and not pos["stopped"]:
            size = self.comm.size
            t0 = time.perf_counter() - pos["epoch_s"]
            total = self.steps_per_epoch(size) * size
            while not self.epoch_done(pos, size):
                opt.zero_grad()
                loss = self.micro_batch(pos)
                if self.hsp:  # ranks that are ahead compute more micro-batches meanwhile
                    opt.step(lambda: self.micro_batch(pos))
                    pos["done"] += sum(opt.last_step()["micro_batches"])
                else:
                    opt.step()
                    pos["done"] += size
                pos["step"] += 1
                pos["nsteps"] += 1
                pos["tot"] += loss.item()
                pos["epoch_s"] = time.perf_counter() - t0
                self.progress.update(pos["epoch"], args.epochs, min(pos["done"], total) - 1, total, loss.detach())
                if after_step is not None:
                    after_step(pos)
            last = pos["epoch"] + 1 == args.epochs
            if (pos["epoch"] + 1) % args.eval_every and not last:
                # not evaluated: osp's work stays in flight into the next epoch, as between steps
                dt = time.perf_counter() - t0
                pos.update(epoch=pos["epoch"] + 1, done=0, epoch_s=0.0, train_time=pos["train_time"] + dt,
                           samples_total=pos["samples_total"] + pos["done"] * args.batch_size)
                if after_epoch is not None:
                    after_epoch(pos)
                continue
            self.exact()
            dt = time.perf_counter() - t0
            test_loss, test_acc = evaluate(self.model, self.x_test, self.y_test)
            prev = pos["history"][-1] if pos["history"] else {"wall_s": 0.0, "samples": 0}
            samples = pos["samples_total"] + pos["done"] * args.batch_size
            # since the previous record (the epochs --eval-every skipped included); a record from a
            # checkpoint written before "samples" existed was the epoch before this one
            rec = {"epoch": pos["epoch"] + 1, "train_loss": pos["tot"] / max(pos["nsteps"], 1),
                   "test_loss": test_loss, "test_acc": test_acc,
                   "samples_per_s": (samples - prev.get("samples", pos["samples_total"]))
                   / max(pos["train_time"] + dt - prev["wall_s"], 1e-9),
                   "steps": pos["nsteps"], "epoch_s": dt, "wall_s": pos["train_time"] + dt, "samples": samples,
                   "ranks": size}
            pos.update(epoch=pos["epoch"] + 1, done=0, nsteps=0, tot=0.0, epoch_s=0.0,
                       train_time=pos["train_time"] + dt, samples_total=samples)
            pos["history"].append(rec)
            self.progress.epoch(f"epoch {rec['epoch']:3d}  loss {rec['train_loss']:.4f}  test acc "
                                f"{100 * test_acc:6.2f}%  {rec['samples_per_s']:8.0f} samples/s")
            # every rank evaluates the same parameters on the same data, so all stop at the same epoch
            pos["stopped"] = args.stop_at_acc is not None and test_acc >= args.stop_at_acc
            if after_epoch is not None:
                after_epoch(pos)
        return pos


class Faults:
    """``--fault RANK:STEP`` (repeatable): that rank kills itself (SIGKILL) right after step STEP's update,
    with OSP's stage 2 still in flight. Once per job: only in a process that trained from step 0 (not
    one restarted from a checkpoint or joined later), and only the first time it completes STEP (a
    survivor that redoes the step after the fault, now under that rank number, does not fail too)."""

    def __init__(self, specs, job: Job):
        self.specs, self.job = list(specs), job
        self.passed = 0  # the furthest step this process completed

    def __call__(self, pos: dict) -> None:
        first = pos["step"] > self.passed
        self.passed = max(self.passed, pos["step"])
        if not (first and self.job.started_at_zero):
            return
        for rank, step in self.specs:
            if pos["step"] == step and self.job.comm.rank == rank:
                sys.stdout.flush()
                sys.stderr.write(f"osp.train: --fault: rank {rank} kills itself after step {step}\n")
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)


CHECKPOINT_KEYS = ("sync", "hsp_sync", "critical", "delay", "optimizer", "batch_size", "width", "channels", "seed")


def run_with_checkpoints(job: Job, pos: dict, fault: Faults) -> dict:
    """``--checkpoint-dir``: resume from the newest good checkpoint there (rank 0 reads it and broadcasts
    it), then save one every ``--checkpoint-every`` steps and at every epoch's end (rank 0 writes)."""
    from .checkpoint import CheckpointDir, CorruptCheckpoint

    args, comm = job.args, job.comm
    ckdir, found = None, None
    if comm.rank == 0:
        ckdir = CheckpointDir(args.checkpoint_dir)
        try:
            found = ckdir.load_latest()
        except CorruptCheckpoint as e:
            found = str(e)
    found = comm.broadcast_object(found, 0)
    if isinstance(found, str):  # rank 0 could not read any: the same error everywhere
        raise SystemExit(found)
    if found is not None:
        step, path, ck = found
        mine = {k: getattr(args, k) for k in CHECKPOINT_KEYS}
        was = {"hsp_sync": "bsp"} | ck["config"]  # written before --hsp-sync: HSP was with BSP
        diff = {k: (was.get(k), v) for k, v in mine.items() if was.get(k) != v}
        if diff:
            raise SystemExit(f"osp.train: checkpoint {path} was written by another configuration "
                             f"(checkpoint vs this run: {diff}); use another --checkpoint-dir")
        if job.hsp and len(ck["pos"]["drawn"]) != comm.size:
            raise SystemExit(f"osp.train: checkpoint {path} is of an HSP run on {len(ck['pos']['drawn'])} ranks; "
                             f"HSP resumes on as many ranks (this run has {comm.size})")
        job.model.load_state_dict(ck["model"])
        job.opt.load_state_dict(ck["optimizer"])
        pos.clear()
        pos.update(ck["pos"])
        job.started_at_zero = False
        if comm.rank == 0:
            print(f"resumed from step {step} (epoch {pos['epoch'] + 1}, {path})", flush=True)

    def save(pos):
        job.exact()
        job.verify()
        job.gather_drawn(pos)
        if comm.rank == 0:
            ckdir.save(pos["step"], {"model": job.model.state_dict(), "optimizer": job.opt.state_dict(),
                                     "pos": pos, "config": {k: getattr(args, k) for k in CHECKPOINT_KEYS}})

    def after_step(pos):
        fault(pos)
        if pos["step"] % args.checkpoint_every == 0:
            save(pos)

    return job.run(pos, after_step, save)


def run_elastic(job: Job, pos: dict, fault: Faults) -> dict:
    """``--elastic``: under ``horovodrun --min-np/--max-np``. A commit every ``--commit-every`` steps
    and at every epoch's end; after a failure the survivors go on from the last commit, and ranks that
    join receive it by broadcast."""
    import copy

    from . import elastic

    args, comm = job.args, job.comm
    state = elastic.State(job.model, job.opt, pos=copy.deepcopy(pos))
    seen = {"step": None, "t": None, "size": None}  # this process: the last step it finished, when, in what world

    def commit(pos):
        state.pos = copy.deepcopy(pos)  # a copy: the committed position must not move with the loop's
        state.commit()  # flushes first
        job.verify()

    @elastic.run
    def train(state):
        pos = copy.deepcopy(state.pos)
        if pos["step"] > 0 and seen["step"] is None:
            job.started_at_zero = False  # joined a running job
        reset = None
        if seen["step"] is not None:  # back after a reset: a failure (restored) or a host change
            reset = {"from_step": seen["step"], "to_step": pos["step"], "steps_redone": seen["step"] - pos["step"],
                     "ranks_before": seen["size"], "ranks_after": comm.size}

        def after_step(pos):
            nonlocal reset
            fault(pos)
            now = time.perf_counter()
            if reset is not None:  # the gap in this rank's step timeline around the reset
                reset["recover_s"] = now - seen["t"]
                pos["resets"].append(reset)
                if comm.rank == 0:
                    print(f"osp.train: reset: {reset}", flush=True)
                reset = None
            seen.update(step=pos["step"], t=now, size=comm.size)
            if pos["step"] % args.commit_every == 0:
                commit(pos)

        return job.run(pos, after_step, commit)

    return train(state)


class _Help(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The module's docstring as written, and every flag's default (where it has one: not for None)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool) or action.default == []:
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """A bad option is one line on stderr (exit code 2), not the usage text and the message beneath it."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str, kind, lo=None, hi=None, auto: bool = False, what: str = ""):
    """``text`` as ``kind`` within [lo, hi] (or 'auto' where allowed); argparse's error otherwise."""
    if auto and text == "auto":
        return text
    try:
        v = kind(text)
    except (TypeError, ValueError):
        v = None
    if v is None or v != v or (lo is not None and v < lo) or (hi is not None and v > hi):
        raise argparse.ArgumentTypeError(f"must be {what}{' or ' + repr('auto') if auto else ''}, got {text!r}")
    return v


def share_or_auto(text: str) -> str:
    """``--critical``: a number in [0, 1] or 'auto' (kept as written: checkpoints compare it as text)."""
    _number(text, float, 0.0, 1.0, auto=True, what="a number in [0, 1]")
    return text


def delay_or_auto(text: str) -> str:
    """``--delay``: an integer >= 1 or 'auto' (kept as written)."""
    if text != "auto" and not text.strip().isdigit():
        raise argparse.ArgumentTypeError(f"must be an integer >= 1 or 'auto', got {text!r}")
    _number(text, int, 1, auto=True, what="an integer >= 1")
    return text


def int_from(lo: int):
    def parse(text):
        return _number(text, int, lo, what=f"an integer >= {lo}")
    parse.__name__ = f"int_from_{lo}"
    return parse


def float_in(lo: float, hi=None, what: str = ""):
    def parse(text):
        return _number(text, float, lo, hi, what=what or f"a number >= {lo:g}")
    parse.__name__ = "float_in"
    return parse


def link_arg(text: str) -> "linkemu.Link":
    try:
        return linkemu.parse_link(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _valid_latency(ap, text: str) -> bool:
    try:
        linkemu.parse_latency(text)
    except ValueError as e:
        ap.error(f"argument --latency: {e}")
    return True


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="osp.train", description=__doc__, formatter_class=_Help)
    ap.add_argument("--sync", choices=["bsp", "osp", "dsync", "hsp", "hvd", "ddp", "fsdp"], default="osp",
                    help="bsp / osp / dsync / hsp: osp.DistributedOptimizer with that mode; hvd: "
                    "horovod.torch.DistributedOptimizer; ddp: torch DistributedDataParallel; fsdp: torch FSDP2 "
                    "(fully_shard per layer or block, gradients reduce-scattered as --compression: none, fp16, bf16)")
    ap.add_argument("--critical", type=share_or_auto, default="auto",
                    help="OSP: the share of gradient blocks averaged before each update, a number in [0, 1], or "
                    "'auto' (osp.OSP()'s default: measure the step and the link, run the share the step model predicts "
                    "fastest, check it by measured steps, follow the link)")
    ap.add_argument("--min-critical", type=float_in(0.0, 1.0, "a number in [0, 1]"), default=0.05,
                    help="OSP: the least share of each bucket kept critical")
    ap.add_argument("--delay", type=delay_or_auto, default="2",
                    help="DSync: how many steps late the average arrives, an integer >= 1, or 'auto'")
    ap.add_argument("--max-delay", type=int_from(1), default=4, help="DSync: the largest delay 'auto' may choose")
    ap.add_argument("--max-extra", type=int_from(0), default=4,
                    help="HSP: extra micro-batches a rank may compute a step")
    ap.add_argument("--hsp-sync", choices=["bsp", "osp", "dsync"], default="bsp",
                    help="HSP: what synchronizes the gradient once every rank is ready (osp: with --critical, "
                    "dsync: with --delay): stragglers and a slow network hidden at once")
    ap.add_argument("--straggler", default=None, metavar="RANK:FACTOR",
                    help="make RANK's compute FACTOR times slower (a sleep of FACTOR-1 times its measured "
                         "micro-batch compute, between forward and backward)")
    ap.add_argument("--link", type=link_arg, default=None, metavar="RATE[,LATENCY]",
                    help="emulate a slow link in user space (osp.linkemu; not a real network): every collective "
                    "of the job takes at least LATENCY + 2(n-1)/n * 8 * bytes / RATE, one at a time; RATE in bits "
                    "as tc writes it (1gbit, 100mbit, 10gbit), LATENCY per collective (200us, 1ms; default 0)")
    ap.add_argument("--latency", default=None, metavar="LATENCY",
                    help="with --link RATE: its latency per collective (200us, 1ms; a bare number is microseconds, "
                    "as osp.plan's --latency), the same as --link RATE,LATENCY")
    ap.add_argument("--compression", choices=["none", "fp16", "bf16", "powersgd"], default="none",
                    help="what the gradients travel as (osp.Compression; hvd: Compression.fp16; ddp: its fp16/bf16 "
                    "compress hook, or powersgd: its PowerSGD hook, rank 4 with error feedback, --sync ddp only)")
    ap.add_argument("--stage2-compression", choices=["none", "fp16", "bf16"], default=None,
                    help="OSP: what the deferred blocks travel as (default: as --compression)")
    ap.add_argument("--block-size", type=int_from(1), default=512,
                    help="OSP: gradient elements per block (the unit of the critical/deferred split)")
    ap.add_argument("--metric", choices=["l2", "l1", "max", "relative"], default="l2",
                    help="OSP: block importance (sum of squares, sum of |g|, max |g|, or |g| / |w|)")
    ap.add_argument("--epochs", type=int_from(1), default=15, help="passes over the training data")
    ap.add_argument("--eval-every", type=int_from(1), default=1, metavar="K",
                    help="evaluate every K epochs and after the last (each evaluation first finishes osp's work "
                    "in flight, so that every rank's replica is exact)")
    ap.add_argument("--batch-size", type=int_from(1), default=32, help="micro-batch per rank")
    ap.add_argument("--optimizer", choices=["sgd", "adam"], default="sgd",
                    help="the wrapped optimizer (sgd: momentum 0.9)")
    ap.add_argument("--lr", type=float_in(0.0), default=0.05, help="learning rate")
    ap.add_argument("--weight-decay", type=float_in(0.0), default=0.0, help="weight decay")
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn", help="cnn: DigitsCNN; mlp: DigitsMLP, "
                    "two hidden layers of 64*width")
    ap.add_argument("--width", type=int_from(1), default=1, help="multiplies the hidden layer (model size)")
    ap.add_argument("--channels", type=int_from(1), default=16,
                    help="channels of the first conv layer (compute; cnn)")
    ap.add_argument("--backend", choices=["auto", "horovod", "torch"], default="auto",
                    help="the engine: auto follows the launcher (horovodrun, with or without --gloo: horovod; "
                    "torchrun: torch; mpirun: horovod, or torch where MASTER_ADDR is set)")
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="where the model lives (cuda: the GPU of each rank's local rank; NCCL with torch)")
    ap.add_argument("--stop-at-acc", type=float_in(0.0, 1.0, "a fraction in [0, 1]"), default=None, metavar="ACC",
                    help="stop after the first epoch whose test accuracy (a fraction) reaches ACC")
    ap.add_argument("--elastic", action="store_true",
                    help="run under Horovod Elastic (horovodrun --min-np/--max-np --host-discovery-script): "
                         "ranks may fail, leave and join; osp/bsp/dsync")
    ap.add_argument("--commit-every", type=int_from(1), default=10, metavar="N",
                    help="--elastic: commit the state every N steps (and at each epoch's end); a failure "
                         "redoes at most the steps since the last commit")
    ap.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                    help="save checkpoints here (atomically; the newest two are kept) and, started again with "
                         "the same DIR (e.g. by torchrun --max-restarts), resume from the newest good one")
    ap.add_argument("--checkpoint-every", type=int_from(1), default=20, metavar="N",
                    help="with --checkpoint-dir: a checkpoint every N steps (and at each epoch's end)")
    ap.add_argument("--fault", action="append", default=[], metavar="RANK:STEP",
                    help="to try recovery: RANK kills itself (SIGKILL) right after step STEP's update, once "
                         "(not again in a restarted or joined process); repeatable")
    ap.add_argument("--verify-replicas", action="store_true",
                    help="check that every rank's parameters are bitwise equal wherever they are exact (every "
                         "step under OSP, every commit or checkpoint): a collective each time, for tests")
    ap.add_argument("--seed", type=int, default=0, help="model initialization and data order")
    ap.add_argument("--threads", type=int_from(1), default=1, help="torch threads per rank")
    ap.add_argument("--json", default=None, metavar="PATH", help="write metrics here (rank 0)")
    ap.add_argument("--no-progress", action="store_true",
                    help="print nothing while training (no header, progress bar or per-evaluation lines); the "
                    "emulated link's line and the closing lines still print")
    return ap


def mode_words(args) -> str:
    """The chosen mode and only its own options, for the header."""
    def osp_words(name):
        if name == "bsp":
            return "bsp"
        if name == "dsync":
            return f"dsync delay={args.delay}" + (f" max_delay={args.max_delay}" if args.delay == "auto" else "")
        words = f"osp critical={args.critical} min_critical={args.min_critical:g} block_size={args.block_size} " \
                f"metric={args.metric}"
        if args.stage2_compression is not None:
            words += f" stage2_compression={args.stage2_compression}"
        return words
    if args.sync == "hsp":
        words = f"sync=hsp max_extra={args.max_extra} hsp_sync={osp_words(args.hsp_sync)}"
    elif args.sync == "hvd":
        words = "sync=hvd (horovod.torch.DistributedOptimizer)"
    elif args.sync == "ddp":
        words = "sync=ddp (DistributedDataParallel)"
    elif args.sync == "fsdp":
        words = "sync=fsdp (FSDP2 fully_shard)"
    else:
        words = "sync=" + osp_words(args.sync)
    if args.compression != "none":
        words += f" compression={args.compression}"
    if args.straggler is not None:
        words += f" straggler={args.straggler}"
    return words


def auto_words(b: dict, nbytes: int, size: int = 2) -> str:
    """What OSP ``auto``'s budget (``stats()["budget"]``) runs now, and why, in one sentence: its last decision,
    from which figures (the predicted step of each share, the measured ones), and how many decisions there were."""
    rate = b.get("rate_Bps") or 0.0
    measured = []
    if size == 1:
        measured.append("one rank: nothing travels")
    elif 0 < rate < float("inf"):
        measured.append(f"link {rate / 1e6:.0f} MB/s, {1e3 * nbytes / rate:.0f} ms for the {nbytes / 1e6:.1f} MB "
                        "gradient")
    steps = {k: v for k, v in (b.get("measured_s") or {}).items() if v}
    if steps:
        measured.append("measured step " + ", ".join(f"{1e3 * v:.0f} ms at {k}" for k, v in sorted(
            steps.items(), key=lambda kv: -float(kv[0]))))
    why = f" ({'; '.join(measured)})" if measured else ""
    share = b["fraction"]
    what = "1.00 (BSP's own steps)" if share >= 1.0 else f"{share:.2f}, deferring {1 - share:.0%} of the blocks"
    if b["phase"] == "warmup":
        return f"OSP auto: still measuring when the run ended ({b['steps']} steps){why}"
    changes = [d for d in b.get("decisions", []) if d["kind"] == "change"]
    if not changes:
        return f"OSP auto: critical share {what} throughout: the step model never predicted a share clearly faster{why}"
    last = changes[-1]
    pred = last.get("predicted_s") or {}
    told = "; predicted " + ", ".join(f"{1e3 * v:.0f} ms at {k}" for k, v in sorted(
        pred.items(), key=lambda kv: -float(kv[0]))) if pred else ""
    kept = next((d for d in reversed(b.get("decisions", [])) if d["kind"] == "kept"), None)
    if kept is not None and kept["step"] >= last["step"]:  # the trial that followed the last change: confirmed
        told += f"; then {kept['why']}"
    return (f"OSP auto: critical share {what}, since step {last['step']} ({len(changes)} change(s) in all; the last: "
            f"{last['why']}{told}){why}")


def decision_lines(args, st: dict, size: int, nbytes: int) -> list:
    """What the mode decided over the run (osp.DistributedOptimizer's ``stats()``), one line each."""
    lines = []
    inner = args.hsp_sync if args.sync == "hsp" else args.sync
    if inner == "osp":
        if args.critical == "auto" and "budget" in st:
            lines.append(auto_words(st["budget"], nbytes, size))
        else:
            lines.append(f"OSP critical={args.critical} (fixed): mean critical share "
                         f"{st['mean']['critical_fraction']:.2f} over {st['steps']} steps")
    elif inner == "dsync" and "delay" in st:
        how = "fixed" if args.delay != "auto" else f"auto: the most steps an average took to arrive lately, " \
                                                   f"at most {args.max_delay}"
        lines.append(f"DSync: delay {st['delay']} ({how})")
    if "hsp" in st:
        h = st["hsp"]
        lines.append(f"HSP: {h['extras']} extra micro-batches in all; backward passes per rank {h['passes_per_rank']}")
    if size > 1:
        lines.append(arrivals_line(st["arrivals"])[len("osp.train: "):])
    return lines


def check_device(ap, device: str) -> None:
    """``--device cuda`` where torch cannot use it: one clear line, before any engine starts."""
    if device != "cuda" or torch.cuda.is_available():
        return
    if torch.version.cuda is None:
        ap.error(f"--device cuda: this torch has no CUDA (torch {torch.__version__}); use --device cpu")
    ap.error(f"--device cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU "
             f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); use --device cpu")


def link_words(link, size: int) -> str:
    words = f"{link.describe()}: every collective takes at least latency + 2(n-1)/n x 8 x bytes / rate, one at " \
            "a time; real shaped links (tc, network namespaces): docs/benchmarks.md, Demo and Throughput under " \
            "a network bottleneck"
    if size == 1:
        words += " (one rank: no collective crosses the link)"
    return words


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    if args.elastic:
        if args.sync not in ("bsp", "osp", "dsync"):
            ap.error(f"--elastic runs --sync bsp, osp or dsync (osp.elastic.State), got --sync {args.sync}")
        if args.checkpoint_dir is not None or args.straggler is not None:
            ap.error("--elastic commits in memory: leave out --checkpoint-dir and --straggler")
    if args.link is not None and args.sync == "ddp" and args.compression == "powersgd":
        ap.error("--link with --compression powersgd: the emulation cannot tell how many bytes PowerSGD sends "
                 "(it emulates DDP's allreduce, fp16 and bf16 hooks)")
    if args.latency is not None:
        if args.link is None or "," in args.link.spec:
            ap.error("--latency goes with --link RATE (or write --link RATE,LATENCY, not both)")
        args.link = link_arg(f"{args.link.spec},{args.latency}") if _valid_latency(ap, args.latency) else None
    if args.sync == "fsdp" and (args.link is not None or args.checkpoint_dir is not None):
        ap.error("--sync fsdp: no --link (its collectives are not emulated) and no --checkpoint-dir (rank 0 "
                 "would save only its own shards)")
    check_device(ap, args.device)

    torch.set_num_threads(args.threads)
    backend, why = detect_backend() if args.backend == "auto" else (args.backend, "--backend")
    if args.sync == "hvd" and backend != "horovod":
        ap.error("--sync hvd needs horovodrun/mpirun with the horovod backend")
    if args.sync in ("ddp", "fsdp") and backend == "horovod":
        ap.error(f"--sync {args.sync} needs torch.distributed (torchrun, or --backend torch)")
    if args.elastic and backend != "horovod":
        ap.error("--elastic needs horovodrun (Horovod Elastic); under torchrun use --checkpoint-dir")
    comm, backend = init(backend, args.device)
    rank, size = comm.rank, comm.size
    straggler = None
    try:
        if args.straggler is not None:
            straggler = parse_straggler(args.straggler, size)
        faults = [parse_rank_step("--fault", f, size) for f in args.fault]
    except ValueError as e:
        ap.error(str(e))

    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    data = tuple(t.to(dev) for t in load_digits_split())
    torch.manual_seed(args.seed)
    model = build_model(args.model, args.width, args.channels).to(dev)
    if not args.elastic:  # under Horovod Elastic, osp.elastic.State broadcasts them (inside its run function)
        osp.broadcast_parameters(model.state_dict(), root_rank=0, backend=comm)
    # the straggler's extra compute: a sleep between forward and backward (so DDP's and Horovod's
    # in-backward averaging start late too), FACTOR-1 times its measured micro-batch
    slow_s = 0.0
    if straggler is not None and straggler[0] == rank:
        slow_s = (straggler[1] - 1.0) * micro_batch_seconds(model, data[0][:args.batch_size],
                                                            data[1][:args.batch_size])
    linkemu.install(args.link)  # osp's collectives; Horovod's optimizer and DDP get theirs in make_optimizer
    model, opt = make_optimizer(args, model, comm, comm if args.sync in OSP_MODES else backend)
    nparams = sum(p.numel() for p in model.parameters())

    progress = Progress(rank == 0 and not args.no_progress)
    job = Job(args, comm, model, opt, data, slow_s, progress)
    if rank == 0:
        progress.epoch(f"osp.train: {mode_words(args)} ranks={size} backend={backend} ({why}) params={nparams} "
                       f"steps/epoch={job.steps_per_epoch(size)} seed={args.seed}")
    if rank == 0 and args.link is not None:  # always: what the numbers below are measured behind
        print("osp.train: " + link_words(args.link, size), flush=True)
    faults = Faults(faults, job)
    pos = new_position(size)
    if args.elastic:
        pos = run_elastic(job, pos, faults)
    elif args.checkpoint_dir is not None:
        pos = run_with_checkpoints(job, pos, faults)
    else:
        pos = job.run(pos, faults)
    rank, size = comm.rank, comm.size  # under --elastic the world may have changed
    history = pos["history"]
    sleeps = comm.allgather_object(slow_s)  # per rank: its sleep per micro-batch (the straggler's)
    digests = comm.allgather_object(digest(model))  # equal on every rank: bitwise equal replicas
    config = vars(args) | {"ranks": size, "backend": backend, "backend_why": why, "params": nparams,
                           "straggler_sleep_s": sleeps, "link": None if args.link is None else args.link.spec}
    result = {"config": config,
              "epochs": history, "final_test_acc": history[-1]["test_acc"] if history else None,
              "samples_per_s": pos["samples_total"] / max(pos["train_time"], 1e-9),
              "train_s": pos["train_time"], "steps": pos["step"], "replica_digests": digests,
              "resets": pos["resets"], "replica_checks": job.verified, "decisions": []}
    if args.link is not None:
        result["link"] = args.link.summary()  # rank 0's: its collectives, their link time, what waiting added
    if isinstance(opt, osp.DistributedOptimizer):
        st = opt.stats()
        result["osp_stats"] = {"mean": st["mean"], "skipped_steps": st["skipped_steps"]}
        for key in ("delay", "hsp", "budget"):
            if key in st:
                result["osp_stats"][key] = st[key]
        result["osp_stats"]["arrivals"] = st["arrivals"]
        nbytes = sum(p.numel() * (2 if args.compression in ("fp16", "bf16") else p.element_size())
                     for p in model.parameters())
        result["decisions"] = decision_lines(args, st, size, nbytes)
    if rank == 0:
        for line in result["decisions"]:
            print("osp.train: " + line, flush=True)
        if args.link is not None:
            s = args.link.summary()
            print(f"osp.train: emulated link (rank 0): {s['collectives']} collectives, {s['link_s']:.1f} s of "
                  f"link time; waiting for them took {s['held_s']:.1f} s longer than the real (loopback) "
                  "collectives", flush=True)
    if rank == 0 and args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1)
    linkemu.uninstall()
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.shutdown()
    else:
        torch.distributed.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
