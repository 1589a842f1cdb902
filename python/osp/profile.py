"""Profile a model for ``osp.plan``: forward, backward, when each bucket's gradient is ready, each mode's own
``step()`` time and the gradient bytes per bucket, measured on this device with one rank.

    python -m osp.profile --model mlp --batch 512 --out profile.json     # a bench model (bench/models.py)
    python -m osp.profile --model mypkg.models:build --batch 32 --out profile.json

``--model pkg.module:factory`` names a callable ``factory(batch) -> (model, loss_fn, batch)``. From Python,
``osp.profile(model, loss_fn, batch)`` (``loss_fn(model, batch)`` returns the loss; the module is callable, and
``osp.profile.profile`` is the same function) returns the profile as a dict and writes it as JSON with ``out=``.
The user's model and optimizer are not touched: every measurement runs on a copy of the model, wrapped afresh
per mode in ``osp.DistributedOptimizer`` on a one-rank process group (made here, and destroyed, when none exists).

Measured (medians over ``steps`` after ``warmup``): per mode (``plain``: the wrapped optimizer alone, ``bsp``,
``osp`` at ``critical=0.25``, ``dsync`` at ``delay=2``, ``hsp``) ``forward_s``, ``backward_s`` (the mode's
hooks included) and ``step_s``; per bucket of osp's layout (``bucket_mb``) its ``bytes`` and ``ready_s``, the
moment its last gradient lands, from the start of backward (under BSP's hooks); ``first_ready_s``, when the first
gradient lands (``auto``'s backward window runs from it to the last).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import os
import statistics
import sys
import time
import types
from typing import Callable, Optional

import torch

MODE_OPTIONS = {"bsp": "BSP()", "osp": "OSP(critical=0.25)", "dsync": "DSync(delay=2)", "hsp": "HSP()"}


def _sync(name: str, bucket_mb: float):
    import osp

    return {"bsp": osp.BSP(bucket_mb=bucket_mb), "osp": osp.OSP(critical=0.25, bucket_mb=bucket_mb),
            "dsync": osp.DSync(delay=2, bucket_mb=bucket_mb), "hsp": osp.HSP(sync=osp.BSP(bucket_mb=bucket_mb))}[name]


def _batch_size(batch) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else None
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    return None


def _one_rank_group():
    """A one-rank Gloo group when none exists (returned True: destroy it after); refuse a job of several."""
    dist = torch.distributed
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError(f"osp.profile measures one rank; run it in one process, not in a job of "
                               f"{dist.get_world_size()} ranks")
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    return True


def _new_optimizer(optimizer, params):
    if optimizer is None:
        return torch.optim.SGD(params, lr=0.01, momentum=0.9)
    return type(optimizer)(params, **optimizer.defaults)


def _time_mode(mode: str, model, loss_fn, batch, optimizer, steps: int, warmup: int, bucket_mb: float) -> dict:
    import osp

    net = copy.deepcopy(model)
    inner = _new_optimizer(optimizer, net.parameters())
    opt = inner if mode == "plain" else osp.DistributedOptimizer(
        inner, net.named_parameters(), sync=_sync(mode, bucket_mb), backend="torch")
    buckets, landed = [], {}
    if mode == "bsp":  # osp's buckets (the BSP mode's), and when each parameter's gradient lands
        buckets = [{"bytes": (hi - lo) * fg.grad.element_size(), "params": ps}
                   for fg, lo, hi, ps in opt.mode.buckets.buckets]
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(lambda p: landed.__setitem__(p, time.perf_counter()))
    fwd, bwd, stp, ready, first = [], [], [], [], []
    for i in range(warmup + steps):
        opt.zero_grad()
        landed.clear()
        t0 = time.perf_counter()
        loss = loss_fn(net, batch)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if mode == "hsp":  # one rank: "ready" completes at once, the closure (an extra) never runs
            opt.step(lambda: loss_fn(net, batch).backward())
        else:
            opt.step()
        t3 = time.perf_counter()
        if i >= warmup:
            fwd.append(t1 - t0)
            bwd.append(t2 - t1)
            stp.append(t3 - t2)
            if buckets:
                ready.append([max(landed.get(p, t1) for p in b["params"]) - t1 for b in buckets])
                first.append(min(landed.values(), default=t1) - t1)
    if mode != "plain":
        opt.flush()
    out = {"forward_s": statistics.median(fwd), "backward_s": statistics.median(bwd), "step_s": statistics.median(stp)}
    if buckets:
        out["buckets"] = [{"bytes": b["bytes"], "ready_s": statistics.median(r[k] for r in ready)}
                          for k, b in enumerate(buckets)]
        out["first_ready_s"] = statistics.median(first)
    del opt
    return out


def profile(model: torch.nn.Module, loss_fn: Callable, batch, optimizer: Optional[torch.optim.Optimizer] = None,
            out: Optional[str] = None, steps: int = 5, warmup: int = 2, bucket_mb: float = 25.0,
            name: Optional[str] = None) -> dict:
    """Measure ``model`` for ``osp.plan`` (module docstring); ``loss_fn(model, batch)`` returns the loss,
    ``optimizer`` (default SGD with momentum) is rebuilt on the copies with its defaults."""
    if not callable(loss_fn):
        raise TypeError(f"osp.profile: loss_fn must be callable as loss_fn(model, batch), got {loss_fn!r}")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1 or warmup < 0:
        raise ValueError(f"osp.profile: expected steps >= 1 and warmup >= 0, got steps={steps!r}, warmup={warmup!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("osp.profile: the model has no trainable parameters")
    made = _one_rank_group()
    try:
        modes = {m: _time_mode(m, model, loss_fn, batch, optimizer, steps, warmup, bucket_mb)
                 for m in ("plain", "bsp", "osp", "dsync", "hsp")}
    finally:
        if made:
            torch.distributed.destroy_process_group()
    buckets = modes["bsp"].pop("buckets")
    first_ready = modes["bsp"].pop("first_ready_s")
    params = [p for p in model.parameters() if p.requires_grad]
    result = {"version": 1, "model": name or type(model).__name__, "batch": _batch_size(batch),
              "params": sum(p.numel() for p in params), "bytes": sum(b["bytes"] for b in buckets),
              "device": str(params[0].device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "steps": steps, "bucket_mb": bucket_mb, "buckets": buckets, "first_ready_s": first_ready,
              "modes": modes,
              "mode_options": {"plain": type(optimizer).__name__ if optimizer else "SGD(lr=0.01, momentum=0.9)",
                               **MODE_OPTIONS}}
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
    return result


def _load_model(spec: str, batch: int):
    """``(model, loss_fn, batch)`` for ``--model``: a bench model's name, or ``pkg.module:factory``."""
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        return getattr(importlib.import_module(mod), attr)(batch)
    sys.path.insert(0, os.getcwd())
    try:
        from bench.models import MODELS, build
    except ImportError as e:
        raise ValueError(f"osp.profile: --model {spec!r} is not pkg.module:factory and bench/models.py is not "
                         f"importable from here ({e})") from None
    if spec not in MODELS:
        raise ValueError(f"osp.profile: unknown model {spec!r}; a bench model ({', '.join(MODELS)}) or "
                         "pkg.module:factory")
    model, make_batch, lf = build(spec)
    return model, (lambda m, b: lf(m(b[0]), b[1])), make_batch(batch, torch.Generator().manual_seed(0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m osp.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a bench model (mlp, resnet18, gpt) or pkg.module:factory")
    ap.add_argument("--batch", type=int, required=True, help="samples per rank and step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        model, loss_fn, batch = _load_model(a.model, a.batch)
        p = profile(model, loss_fn, batch, out=a.out, steps=a.steps, warmup=a.warmup, name=a.model)
    except (ValueError, TypeError, RuntimeError) as e:
        print(f"osp.profile: {e}", file=sys.stderr)
        return 2
    m = p["modes"]
    print(f"{a.model}: {p['params']} parameters, {p['bytes'] / 2**20:.1f} MiB of gradient in {len(p['buckets'])} "
          f"buckets; forward {1e3 * m['plain']['forward_s']:.1f} ms, backward {1e3 * m['plain']['backward_s']:.1f} ms; "
          "step " + ", ".join(f"{k} {1e3 * v['step_s']:.1f} ms" for k, v in m.items()) + f" -> {a.out}")
    return 0


class _CallableModule(types.ModuleType):
    """``osp.profile(model, ...)`` calls :func:`profile`: the module and the function share the name the issue
    and the docs give the tool, and ``python -m osp.profile`` needs the module."""

    def __call__(self, *args, **kwargs):
        return profile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
