"""Profile a model for ``osp.plan``: forward, backward, when each bucket's gradient is ready, each mode's own
``step()`` time and the gradient bytes per bucket, measured on this device with one rank, with the spread of
every time, so a plan can tell a real difference from the host's noise.

    python -m osp.profile --model mlp --batch 512 --out profile.json           # a model osp ships (below)
    python -m osp.profile --model mypkg.models:build --batch 32 --out profile.json

``--model`` is one of the models in the installed package (``MODELS``: ``mlp``, the throughput bench's MLP;
``digits-mlp`` and ``digits-cnn``, ``osp.train``'s), so the command runs from any directory; or
``pkg.module:factory``, a callable ``factory(batch) -> (model, loss_fn, batch)``; or, where the checkout's
``bench/`` is importable (its root on ``sys.path``: the working directory of ``python -m``), another bench
model (``resnet18``, ``gpt``: ``bench/models.py``). From Python, ``osp.profile(model, loss_fn, batch)``
(``loss_fn(model, batch)`` returns the loss; the module is callable, and ``osp.profile.profile`` is the same
function) returns the profile as a dict and writes it as JSON with ``out=``. The user's model and optimizer are
not touched: every measurement runs on a copy of the model, wrapped afresh per mode in
``osp.DistributedOptimizer`` on a one-rank process group (made here, and destroyed, when none exists).

Measured: ``repeats`` repetitions, each running every mode afresh (``plain``: the wrapped optimizer alone, ``bsp``,
``osp`` at ``critical=0.25``, ``dsync`` at ``delay=2``, ``hsp``; each repetition starts at the next mode, so a slow
spell of the host does not fall on one mode only) for ``warmup`` untimed (and ``MIN_WARMUP_S``, 0.2 s, at least) and
``steps`` timed iterations; where an iteration is shorter than ``MIN_SAMPLE_S`` (50 ms, from the last warm-up one)
each timed value is the mean of that many consecutive iterations (``averaged``: how many, per mode), so a small
model's spread is the host's, not its own iterations' scheduling jitter. Per mode, the median over every timed value
of ``forward_s``, ``backward_s`` (the mode's hooks included), ``step_s`` and their sum ``iteration_s``; per bucket
of osp's layout (``bucket_mb``) its ``bytes`` and ``ready_s``, the moment its last gradient lands from the start of
backward (under BSP's hooks); ``first_ready_s``, when the first gradient lands (``auto``'s backward window runs from
it to the last).

The spread of each (``spread`` per mode and per bucket): the larger of the timed iterations' interquartile range
and the range of the repetitions' medians, over the median; relative, so 0.1 reads "10%". The profile's
``noise`` is the largest ``iteration_s`` spread (``noisiest``: whose; both ``None`` with one timed iteration a
mode). Above ``osp.plan.NOISY`` (10%) the
profile warns (``NoisyProfileWarning``): the host is busy, ``osp.plan`` will call modes that close a tie, and a
profile taken again may recommend another mode; ``osp.plan`` refuses a profile noisier than ``osp.plan.EXTREME``
(50%).
"""
from __future__ import annotations

import argparse
import copy
import datetime
import importlib
import json
import math
import statistics
import sys
import time
import traceback
import types
import warnings
from typing import Callable, Dict, List, Optional

import torch

from osp.plan import EXTREME, NOISY

MODE_OPTIONS = {"bsp": "BSP()", "osp": "OSP(critical=0.25)", "dsync": "DSync(delay=2)", "hsp": "HSP()"}
MODES = ("plain", "bsp", "osp", "dsync", "hsp")
# a timed value spans at least this long: a short iteration's own jitter (the scheduler's, the allocator's: a few
# hundred microseconds) is not the host's noise; below it a value is the mean of consecutive iterations
MIN_SAMPLE_S = 0.05
MAX_PER = 50  # iterations a value averages at most
MIN_WARMUP_S = 0.2  # a mode's warm-up lasts this long at least (with warmup > 0), up to MAX_WARMUP iterations
MAX_WARMUP = 100
VERSION = 2  # 2: repetitions, the spread of every time and the profile's noise


class NoisyProfileWarning(UserWarning):
    """The profile's times varied more than ``osp.plan.NOISY``: the host was busy while it ran."""


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
    """One repetition of ``mode``: its timed iterations' forward, backward and step (and under BSP, each bucket's
    ready time and the first gradient's), one value per iteration."""
    import osp

    net = copy.deepcopy(model)
    inner = _new_optimizer(optimizer, net.parameters())
    with warnings.catch_warnings():
        # the profile's OSP at 0.25 on a model of few blocks runs BSP's steps: what it measures then, and the
        # plan's to say; the user built no such optimizer, so the constructor's warning is not theirs
        warnings.filterwarnings("ignore", message=".* defers nothing here", category=RuntimeWarning)
        opt = inner if mode == "plain" else osp.DistributedOptimizer(
            inner, net.named_parameters(), sync=_sync(mode, bucket_mb), backend="torch")
    buckets, landed = [], {}
    if mode == "bsp":  # osp's buckets (the BSP mode's), and when each parameter's gradient lands
        buckets = [{"bytes": (hi - lo) * fg.grad.element_size(), "params": ps}
                   for fg, lo, hi, ps in opt.mode.buckets.buckets]
        for p in net.parameters():
            p.register_post_accumulate_grad_hook(lambda p: landed.__setitem__(p, time.perf_counter()))
    out = {"forward_s": [], "backward_s": [], "step_s": [], "ready_s": [], "first_ready_s": []}

    def iteration():
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
        return t0, t1, t2, time.perf_counter()

    # warm-up: ``warmup`` iterations, and with any, MIN_WARMUP_S at least (a mode's first iterations pay for its
    # first use: allocations, the kernels' first calls; counted, they made a small model's first repetition the
    # profile's noise)
    began, warm, last = time.perf_counter(), 0, None
    while warm < warmup or (warmup and warm < MAX_WARMUP and time.perf_counter() - began < MIN_WARMUP_S):
        t0, _, _, t3 = iteration()
        warm, last = warm + 1, t3 - t0
    per = 1 if last is None else max(1, min(MAX_PER, math.ceil(MIN_SAMPLE_S / max(last, 1e-9))))
    for _ in range(steps * per):
        t0, t1, t2, t3 = iteration()
        out["forward_s"].append(t1 - t0)
        out["backward_s"].append(t2 - t1)
        out["step_s"].append(t3 - t2)
        if buckets:  # every gradient lands before backward returns: each ready time is within its backward
            out["ready_s"].append([max(landed.get(p, t1) for p in b["params"]) - t1 for b in buckets])
            out["first_ready_s"].append(min(landed.values(), default=t1) - t1)
    if mode != "plain":
        opt.flush()
    if per > 1:  # each timed value: the mean of ``per`` consecutive iterations
        for k, v in out.items():
            out[k] = [(sum(v[j:j + per]) / per if not isinstance(v[j], list) else
                       [sum(x) / per for x in zip(*v[j:j + per])]) for j in range(0, len(v), per)]
    out["per"] = per
    out["bytes"] = [b["bytes"] for b in buckets]
    return out


def _spread(reps: List[List[float]]) -> float:
    """The larger of the interquartile range of every value and the range of the repetitions' medians, over the
    median of every value (0 when it is 0)."""
    values = [v for r in reps for v in r]
    med = statistics.median(values)
    if med <= 0:
        return 0.0
    iqr = 0.0
    if len(values) >= 2:
        q1, _, q3 = statistics.quantiles(values, n=4, method="inclusive")
        iqr = q3 - q1
    medians = [statistics.median(r) for r in reps if r]
    return max(iqr, max(medians) - min(medians)) / med


def _summary(reps: List[List[float]]):
    return statistics.median(v for r in reps for v in r), _spread(reps)


def profile(model: torch.nn.Module, loss_fn: Callable, batch, optimizer: Optional[torch.optim.Optimizer] = None,
            out: Optional[str] = None, steps: int = 3, warmup: int = 2, bucket_mb: float = 25.0,
            name: Optional[str] = None, repeats: int = 3) -> dict:
    """Measure ``model`` for ``osp.plan`` (module docstring): ``repeats`` repetitions of ``warmup`` untimed and
    ``steps`` timed iterations of every mode; ``loss_fn(model, batch)`` returns the loss, ``optimizer``
    (default SGD with momentum) is rebuilt on the copies with its defaults. Warns ``NoisyProfileWarning`` when
    the profile's noise is above ``osp.plan.NOISY``."""
    if not callable(loss_fn):
        raise TypeError(f"osp.profile: loss_fn must be callable as loss_fn(model, batch), got {loss_fn!r}")
    for key, value, least in (("steps", steps, 1), ("warmup", warmup, 0), ("repeats", repeats, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"osp.profile: expected an integer {key} >= {least}, got {key}={value!r}")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("osp.profile: the model has no trainable parameters")
    runs: Dict[str, List[dict]] = {m: [] for m in MODES}
    made = _one_rank_group()
    try:
        for r in range(repeats):
            for m in MODES[r % len(MODES):] + MODES[:r % len(MODES)]:
                runs[m].append(_time_mode(m, model, loss_fn, batch, optimizer, steps, warmup, bucket_mb))
    finally:
        if made:
            torch.distributed.destroy_process_group()
    modes = {}
    for m, reps in runs.items():
        iteration = [[f + b + s for f, b, s in zip(r["forward_s"], r["backward_s"], r["step_s"])] for r in reps]
        got = {k: _summary([r[k] for r in reps]) for k in ("forward_s", "backward_s", "step_s")}
        got["iteration_s"] = _summary(iteration)
        modes[m] = {**{k: v[0] for k, v in got.items()}, "spread": {k: v[1] for k, v in got.items()}}
    bsp = runs["bsp"]
    buckets = [{"bytes": nbytes, **dict(zip(("ready_s", "spread"), _summary([[it[k] for it in r["ready_s"]]
                                                                               for r in bsp])))}
               for k, nbytes in enumerate(bsp[0]["bytes"])]
    noisiest = max(modes, key=lambda m: modes[m]["spread"]["iteration_s"])
    noise = modes[noisiest]["spread"]["iteration_s"]
    if repeats * steps < 2:  # one timed iteration a mode: no spread to see
        noisiest = noise = None
    params = [p for p in model.parameters() if p.requires_grad]
    result = {"version": VERSION, "model": name or type(model).__name__, "batch": _batch_size(batch),
              "params": sum(p.numel() for p in params), "bytes": sum(b["bytes"] for b in buckets),
              "device": str(params[0].device), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "repeats": repeats, "steps": steps, "warmup": warmup, "noise": noise, "noisiest": noisiest,
              "averaged": {m: max(r["per"] for r in reps) for m, reps in runs.items()},
              "bucket_mb": bucket_mb, "buckets": buckets,
              "first_ready_s": _summary([r["first_ready_s"] for r in bsp])[0], "modes": modes,
              "mode_options": {"plain": type(optimizer).__name__ if optimizer else "SGD(lr=0.01, momentum=0.9)",
                               **MODE_OPTIONS}}
    if out:
        with open(out, "w") as fh:
            json.dump(result, fh, indent=1)
    if noise is not None and noise > NOISY:
        warnings.warn(NoisyProfileWarning(noise_message(result)), stacklevel=2)
    return result


def noise_message(p: dict) -> str:
    """What a profile's noise means for a plan, in words."""
    n, m = p["noise"], p["noisiest"]
    med = 1e3 * p["modes"][m]["iteration_s"]
    text = (f"osp.profile: the host is noisy: {m}'s iterations ({med:.1f} ms at the median) varied by {n:.0%} "
            f"over {p['repeats']} repetitions of {p['steps']} (quiet: under {NOISY:.0%}). ")
    if n > EXTREME:
        return text + (f"osp.plan refuses a profile noisier than {EXTREME:.0%}: take it again on a quiet host (or "
                       "with --threads below the free cores)")
    return text + (f"osp.plan will call two modes a tie when their predictions overlap with every time ±{n:.0%}, "
                   "and a profile taken again may recommend another mode; a quiet host (or --threads below the free "
                   "cores) narrows it")


# ----------------------------------------------------------------------------------------------------------------
# the models ``--model`` names: in the installed package, so the command runs from any directory

def _mlp(batch: int):
    """The throughput bench's MLP (``bench/models.py``'s ``mlp``, same weights and data): 1024 -> 2048 -> 2048 ->
    1000, ReLU, cross-entropy on standard normal inputs; 8.4M parameters."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 2048),
                                torch.nn.ReLU(), torch.nn.Linear(2048, 1000))
    g = torch.Generator().manual_seed(0)
    data = (torch.randn(batch, 1024, generator=g), torch.randint(0, 1000, (batch,), generator=g))
    return model, _cross_entropy, data


def _digits(make):
    def factory(batch: int):
        from osp import train

        torch.manual_seed(0)
        model = make(train)
        g = torch.Generator().manual_seed(0)
        return model, _cross_entropy, (torch.randn(batch, 1, 8, 8, generator=g),
                                       torch.randint(0, 10, (batch,), generator=g))

    return factory


def _cross_entropy(model, batch):
    return torch.nn.functional.cross_entropy(model(batch[0]), batch[1])


# the digits models on random 8x8 images (their timing does not depend on the values): DigitsMLP at width 32
# (4.35M parameters), DigitsCNN with 64 channels (206K parameters, the stragglers bench's)
MODELS = {"mlp": _mlp,
          "digits-mlp": _digits(lambda train: train.DigitsMLP(width=32)),
          "digits-cnn": _digits(lambda train: train.DigitsCNN(channels=64))}


def _made(spec: str, factory, batch: int):
    """``factory(batch)``, checked to be ``(model, loss_fn, batch)``: what it raised, with its type and the line
    that raised it, or what it returned instead, named."""
    if not callable(factory):
        raise TypeError(f"--model {spec!r}: expected a callable factory(batch_size) -> (model, loss_fn, batch), "
                        f"got {type(factory).__name__} {factory!r}")
    try:
        got = factory(batch)
    except Exception as e:
        tb = traceback.extract_tb(e.__traceback__)[-1]
        raise ValueError(f"--model {spec!r}: the factory raised {type(e).__name__}: {e} (at {tb.filename}:"
                         f"{tb.lineno}, in {tb.name})") from e
    shape = "expected the factory to return (model, loss_fn, batch), with model a torch.nn.Module and " \
            "loss_fn(model, batch) -> loss"
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        what = f"a {type(got).__name__} of {len(got)}" if isinstance(got, (tuple, list)) else type(got).__name__
        raise TypeError(f"--model {spec!r}: {shape}; got {what}")
    model, loss_fn, _ = got
    if not isinstance(model, torch.nn.Module) or not callable(loss_fn):
        raise TypeError(f"--model {spec!r}: {shape}; got ({type(model).__name__}, {type(loss_fn).__name__}, ...)")
    return tuple(got)


def _load_model(spec: str, batch: int):
    """``(model, loss_fn, batch)`` for ``--model``: one of ``MODELS``, ``pkg.module:factory``, or a bench model
    where ``bench/`` is importable."""
    if ":" in spec:
        mod, _, attr = spec.partition(":")
        try:
            factory = getattr(importlib.import_module(mod), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"--model {spec!r}: cannot load {attr!r} from {mod!r} ({e})") from None
        return _made(spec, factory, batch)
    if spec in MODELS:
        return MODELS[spec](batch)
    try:  # the checkout's other bench models, when its root is on sys.path (python -m puts the cwd there)
        from bench.models import MODELS as BENCH
        from bench.models import build
    except ImportError:
        BENCH, build = (), None
    if spec not in BENCH:
        where = (f"; in the checkout's bench: {', '.join(m for m in BENCH if m not in MODELS)}" if BENCH else
                 " (bench/models.py's resnet18 and gpt only from the checkout's root)")
        raise ValueError(f"unknown model {spec!r}: expected one of {', '.join(MODELS)}, or pkg.module:factory"
                         + where)
    model, make_batch, lf = build(spec)
    return model, (lambda m, b: lf(m(b[0]), b[1])), make_batch(batch, torch.Generator().manual_seed(0))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m osp.profile", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help=f"one of {', '.join(MODELS)}, or pkg.module:factory "
                    "(from the checkout's root also bench/models.py's resnet18 and gpt)")
    ap.add_argument("--batch", type=int, required=True, help="samples per rank and step")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3, help="timed iterations per mode and repetition (default 3)")
    ap.add_argument("--warmup", type=int, default=2, help="untimed iterations before them (default 2)")
    ap.add_argument("--repeats", type=int, default=3, help="repetitions of every mode (default 3)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    try:
        model, loss_fn, batch = _load_model(a.model, a.batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", NoisyProfileWarning)
            p = profile(model, loss_fn, batch, out=a.out, steps=a.steps, warmup=a.warmup, name=a.model,
                        repeats=a.repeats)
    except (ValueError, TypeError, RuntimeError) as e:
        msg = str(e)
        print(msg if msg.startswith("osp.profile:") else f"osp.profile: {msg}", file=sys.stderr)
        return 2
    m = p["modes"]

    def ms(mode, key):
        return f"{1e3 * m[mode][key]:.1f} ms ±{m[mode]['spread'][key]:.0%}"

    print(f"{a.model}: {p['params']} parameters, {p['bytes'] / 2**20:.1f} MiB of gradient in {len(p['buckets'])} "
          f"buckets; forward {ms('plain', 'forward_s')}, backward {ms('plain', 'backward_s')}; step "
          + ", ".join(f"{k} {1e3 * v['step_s']:.1f} ms" for k, v in m.items())
          + ("; noise unknown (one timed iteration a mode)" if p["noise"] is None else
             f"; noise {p['noise']:.0%} ({p['noisiest']})") + f" -> {a.out}")
    for w in caught:
        if issubclass(w.category, NoisyProfileWarning):
            print(f"warning: {w.message}", file=sys.stderr)
        else:
            warnings.showwarning(w.message, w.category, w.filename, w.lineno)
    return 0


class _CallableModule(types.ModuleType):
    """``osp.profile(model, ...)`` calls :func:`profile`: the module and the function share the name the issue
    and the docs give the tool, and ``python -m osp.profile`` needs the module."""

    def __call__(self, *args, **kwargs):
        return profile(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule

if __name__ == "__main__":
    sys.exit(main())
