"""Lightning runs on digits for tests/test_lightning.py and bench/lightning_throughput.py.

Usage: python lightning_worker.py OUTDIR RUN [RUN ...]    (RUN: a name of RUNS below)

Started as a plain script: Lightning's own launcher (``Trainer(devices=2)``, as with ``strategy="ddp"``) starts
the second rank by running this script again. Every run trains a fresh LightningModule from the same seed and
writes OUTDIR/<run>.rank<R>.pt: the parameters and buffers at the end, the test accuracy on the whole test split,
the number of steps and of ``training_step`` calls, and osp's figures.
"""
from __future__ import annotations

import json
import os
import statistics
import sys
import time
import warnings

import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", ".*does not have many workers.*")
warnings.filterwarnings("ignore", ".*Detected call of `lr_scheduler.step\\(\\)`.*")
warnings.filterwarnings("ignore", ".*GPU available but not used.*")
warnings.filterwarnings("ignore", ".*sync_dist=True.*")
warnings.filterwarnings("ignore", ".*You are using `torch.load` with `weights_only=False`.*")
warnings.filterwarnings("ignore", ".*is not supported on CPU. Using `precision='bf16-mixed'` instead.*")

import pytorch_lightning as pl  # noqa: E402
from pytorch_lightning.callbacks import EarlyStopping, ModelCheckpoint  # noqa: E402
from pytorch_lightning.plugins.precision import MixedPrecision  # noqa: E402

import osp  # noqa: E402
from osp.lightning import OSPStrategy  # noqa: E402
from osp.train import load_digits_split  # noqa: E402

X_TRAIN, Y_TRAIN, X_TEST, Y_TEST = load_digits_split(0)


class Digits(pl.LightningModule):
    """An MLP with a BatchNorm layer (buffers to keep in sync), SGD with momentum or Adam, optionally a StepLR."""

    def __init__(self, width: int = 2, lr: float = 0.05, optimizer: str = "sgd", scheduler: bool = False):
        super().__init__()
        h = 64 * width
        self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, h), torch.nn.BatchNorm1d(h),
                                       torch.nn.ReLU(), torch.nn.Linear(h, h), torch.nn.ReLU(), torch.nn.Linear(h, 10))
        self.lr, self.opt_name, self.scheduler = lr, optimizer, scheduler
        self.calls, self.slow = 0, False
        self._straggler = None  # rank 1's: when its last sleep ended, and its own iterations' lengths

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.calls += 1
        if self.slow and self.global_rank == 1:
            self._straggle()  # a straggler: under HSP rank 0 runs extras meanwhile
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def _straggle(self):
        """Sleep twice this rank's own iteration (the median of its last 9: from the end of one sleep to the next
        call, Lightning's loop included), at least 4 ms: a 2x straggler on any host (a fixed 4 ms was less than half
        a micro-batch on a slow one, where HSP rightly starts no extra)."""
        woke, iters = self._straggler or (None, [])
        if woke is not None:
            iters = (iters + [time.perf_counter() - woke])[-9:]
        time.sleep(max(0.004, 2 * statistics.median(iters)) if iters else 0.004)
        self._straggler = (time.perf_counter(), iters)

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_acc", (self(x).argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        if self.opt_name == "adam":
            opt = torch.optim.Adam(self.parameters(), lr=self.lr * 0.02)
        else:
            opt = torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9)
        if not self.scheduler:
            return opt
        return {"optimizer": opt, "lr_scheduler": {"scheduler": torch.optim.lr_scheduler.StepLR(opt, 10, gamma=0.5),
                                                   "interval": "step"}}


class GAN(pl.LightningModule):
    """Manual optimization with two optimizers: D's step, then G's (whose backward also fills D's gradients;
    D's zero_grad starts its next accumulation anew)."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.G = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64),
                                     torch.nn.Sigmoid())
        self.D = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
        self.calls = 0

    def training_step(self, batch, batch_idx):
        self.calls += 1
        opt_g, opt_d = self.optimizers()
        real = batch[0].flatten(1)
        g = torch.Generator().manual_seed(1000 * batch_idx + self.global_rank)
        z = torch.randn(real.shape[0], 16, generator=g)
        fake = self.G(z)
        ones, zeros = torch.ones(real.shape[0], 1), torch.zeros(real.shape[0], 1)
        loss_d = F.binary_cross_entropy_with_logits(self.D(real), ones) + \
            F.binary_cross_entropy_with_logits(self.D(fake.detach()), zeros)
        opt_d.zero_grad()
        self.manual_backward(loss_d)
        self.clip_gradients(opt_d, gradient_clip_val=1.0, gradient_clip_algorithm="norm")
        opt_d.step()
        loss_g = F.binary_cross_entropy_with_logits(self.D(fake), ones)
        opt_g.zero_grad()
        self.manual_backward(loss_g)
        opt_g.step()

    def configure_optimizers(self):
        return (torch.optim.Adam(self.G.parameters(), lr=1e-3), torch.optim.Adam(self.D.parameters(), lr=1e-3))


def loaders(batch: int, val: bool):
    ds = torch.utils.data.TensorDataset(X_TRAIN, Y_TRAIN)
    train = torch.utils.data.DataLoader(ds, batch_size=batch, shuffle=True, drop_last=True)
    if not val:
        return train, None
    test = torch.utils.data.TensorDataset(X_TEST, Y_TEST)
    return train, torch.utils.data.DataLoader(test, batch_size=256)


SYNCS = {
    "bsp": lambda: osp.BSP(),
    "osp-auto": lambda: osp.OSP(critical="auto", block_size=256),
    "osp-0.25": lambda: osp.OSP(critical=0.25, block_size=256),
    "dsync-2": lambda: osp.DSync(delay=2),
    "hsp": lambda: osp.HSP(max_extra=2),
    "hsp-osp": lambda: osp.HSP(max_extra=2, sync=osp.OSP(critical=0.25, block_size=256)),
}


def run_spec(name: str) -> dict:
    """A run's settings from its name: <strategy>[-s<seed>][+feature...], e.g. ``osp-auto-s1`` or ``bsp+accum+clip``."""
    base, *features = name.split("+")
    seed = 0
    if "-s" in base and base.rsplit("-s", 1)[1].isdigit():
        base, s = base.rsplit("-s", 1)
        seed = int(s)
    return {"strategy": base, "seed": seed, "features": set(features)}


def make_strategy(base: str):
    if base == "ddp":
        return "ddp"
    if base == "ddp-unused":
        return "ddp_find_unused_parameters_true"
    return OSPStrategy(sync=SYNCS[base]())


def run(outdir: str, name: str) -> None:
    spec = run_spec(name)
    f = spec["features"]
    pl.seed_everything(spec["seed"], verbose=False)
    epochs = 3 if "short" in f else 6 if "resume" in f else 12
    gan = "gan" in f
    model = GAN() if gan else Digits(optimizer="adam" if "adam" in f else "sgd", scheduler="sched" in f)
    plugins = []
    precision = "32-true"
    if "bf16" in f:
        precision = "bf16-mixed"
    if "fp16" in f:  # Lightning turns '16-mixed' on a CPU into bf16; a float16 autocast with a GradScaler, given
        plugins = [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0 ** 12))]
        precision = None
    callbacks = []
    ckdir = os.path.join(outdir, f"ckpt-{name}")
    if "resume" in f or "ckpt" in f:
        callbacks.append(ModelCheckpoint(dirpath=ckdir, save_top_k=-1, every_n_epochs=1))
    if "early" in f:
        callbacks.append(EarlyStopping(monitor="val_acc", mode="max", patience=1, min_delta=0.5))
    kw = dict(strategy=make_strategy(spec["strategy"]), accelerator="cpu", devices=2, max_epochs=epochs,
              enable_progress_bar=False, logger=False, enable_model_summary=False, num_sanity_val_steps=0,
              enable_checkpointing=bool(callbacks and "resume" in f or "ckpt" in f), callbacks=callbacks,
              plugins=plugins, accumulate_grad_batches=2 if "accum" in f else 1,
              gradient_clip_val=(0.05 if "clipvalue" in f else 0.5) if ("clip" in f or "clipvalue" in f) else None,
              gradient_clip_algorithm="value" if "clipvalue" in f else "norm")
    if precision is not None:
        kw["precision"] = precision
    val = "val" in f or "early" in f  # not "resume": its checkpoints come at the end of an epoch with work in flight
    train, test = loaders(32, val)
    trainer = pl.Trainer(**kw)
    ckpt_path = None
    if "from" in f:  # resume from the checkpoint the same run without "+from" wrote after its 3rd epoch
        src = os.path.join(outdir, "ckpt-" + name.replace("+from", ""))
        ckpt_path = os.path.join(src, sorted(p for p in os.listdir(src) if p.startswith("epoch=2-"))[0])
    model.slow = "slow" in f
    t0 = time.perf_counter()
    if "refuse" in f:  # a combination OSPStrategy refuses: the same error on every rank, at setup
        try:
            trainer.fit(model, train, test)
        except ValueError as e:
            torch.save({"error": str(e)}, os.path.join(outdir, f"{name}.rank{trainer.global_rank}.pt"))
            return
        raise AssertionError(f"{name}: fit did not raise")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, train, test, ckpt_path=ckpt_path)
    fit_s = time.perf_counter() - t0
    warned = sorted({str(w.message)[:200] for w in caught if str(w.message).startswith("osp")})
    out = {"name": name, "fit_s": fit_s, "osp_warnings": warned, "global_step": trainer.global_step,
           "calls": model.calls,
           "epochs": trainer.current_epoch, "rank": trainer.global_rank}
    if not gan:
        if "test" in f:
            res = trainer.test(model, torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X_TEST, Y_TEST),
                                                                  batch_size=256), verbose=False)
            out["trainer_test_acc"] = res[0]["test_acc"]
        model.eval()
        with torch.no_grad():
            out["test_acc"] = (model(X_TEST).argmax(1) == Y_TEST).float().mean().item()
    opts = [o._optimizer if hasattr(o, "_optimizer") else o for o in trainer.optimizers]
    stats = [o.stats() for o in opts if isinstance(o, osp.DistributedOptimizer)]
    out["osp"] = [{"steps": s["steps"], "skipped": s["skipped_steps"], "mode": s["mode"],
                   "critical": s["mean"].get("critical_fraction"),
                   "extras": s.get("hsp", {}).get("extras")} for s in stats]
    out["in_flight"] = [o.in_flight for o in opts if isinstance(o, osp.DistributedOptimizer)]
    out["lr"] = [g["lr"] for o in opts for g in o.param_groups]
    plugin = trainer.precision_plugin
    out["precision"] = type(plugin).__name__
    out["loss_scale"] = plugin.scaler.get_scale() if getattr(plugin, "scaler", None) is not None else None
    out["state"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(out, os.path.join(outdir, f"{name}.rank{trainer.global_rank}.pt"))
    if trainer.global_rank == 0:
        print(json.dumps({k: v for k, v in out.items() if k != "state"}), flush=True)


def main() -> None:
    outdir, names = sys.argv[1], sys.argv[2:]
    os.makedirs(outdir, exist_ok=True)
    torch.set_num_threads(1)
    for name in names:
        run(outdir, name)
    torch.distributed.barrier()  # every rank's files are written before rank 0 (the launcher's parent) exits


if __name__ == "__main__":
    main()
