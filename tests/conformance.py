"""The conformance tables and their one-rank oracle (tests/test_conformance.py, docs: README "Works with").

A case is one value from each table: a mode setting (``MODES``), a loop pattern as users write it
(``PATTERNS``), an optimizer (``OPTIMIZERS``) and a parameter dtype (``DTYPES``). ``run_case`` runs the
pattern's loop twice from the same seed, once with plain ``torch.optim`` and once with the optimizer
wrapped by osp on one rank (in this process), where every average is the rank's own gradient, so
osp must equal ``torch.optim``: after every step (the parameters the next forward computes with) and,
after ``flush()``, in parameters and optimizer state. Its outcome is one of

- ``bitwise``: every compared tensor equal bit for bit;
- ``ulp``: within the documented bound (``tolerance``): per step, ``ULPS`` ulps of the tensor's scale;
- ``refused``: osp raised, and ``REFUSED`` says this pattern is refused under this mode (a clear error
  at the step where the loop does what the mode cannot do exactly);
- ``torch-refuses``: plain ``torch.optim`` raised too (e.g. GradScaler with fp16 parameters), and so did osp;
- ``torch-nonfinite``: plain ``torch.optim`` wrote inf or nan into the parameters (Adam's eps underflows in
  fp16); osp skips such steps on every rank instead (README), and equals torch up to that step;
- anything else is a failure the oracle names: ``differs`` (a silent difference) or ``error``.

The tables are what the tests generate from: ``pairwise`` covers every pair of values of the four
tables at least once, so combinations nobody listed are covered by construction.
"""
from __future__ import annotations

import contextlib
import itertools
import math
import random
import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import features as FE
import torch

import osp

STEPS = 7
BUCKET_MB = 0.0004  # ~100 fp32 elements: several buckets, bucket boundaries inside parameters
BLOCK = 16  # parameters of 13, 65, 91 and 169 elements: blocks straddle parameters and buckets

# -- modes: every setting that takes another code path --------------------------------------------


def _auto_state(fraction: float) -> dict:
    """A budget state for ``OSP("auto")`` resumed at ``fraction`` of the blocks critical (version 2: the step model
    decides again from the next step's figures; on one rank, where nothing travels, it hands the steps to BSP)."""
    return {"budget": {"version": 2, "steps": 4, "fraction": fraction, "phase": "auto", "decisions": []},
            "size": 1, "scores": None}


@dataclass(frozen=True)
class Mode:
    name: str
    make: Callable[[], osp.modes.base.Options]
    #: called once after wrapping (e.g. to put ``auto`` into one of its phases)
    prepare: Optional[Callable[[osp.DistributedOptimizer], None]] = None
    closure: bool = False  # step(closure) (HSP)

    @property
    def late(self) -> int:
        """How many steps late a GradScaler hears of an overflow: DSync(delay=d), alone or inside HSP, finds
        it when the average lands (``delay="auto"`` refuses a GradScaler: 0)."""
        options = self.make()
        delay = getattr(getattr(options, "sync", options), "delay", 0)
        return delay if isinstance(delay, int) else 0

    @property
    def family(self) -> str:
        return self.name.split("-")[0]


def _resumed_at(fraction):
    def prepare(opt):
        state = _auto_state(fraction)
        state["size"] = opt.comm.size
        opt.mode.load_state_dict(state)
    return prepare


MODES: Dict[str, Mode] = {m.name: m for m in [
    Mode("bsp", lambda: osp.BSP(bucket_mb=BUCKET_MB)),
    Mode("osp-0.25", lambda: osp.OSP(0.25, block_size=BLOCK, bucket_mb=BUCKET_MB)),
    Mode("osp-0.0", lambda: osp.OSP(0.0, block_size=BLOCK, bucket_mb=BUCKET_MB)),
    Mode("osp-1.0", lambda: osp.OSP(1.0, block_size=BLOCK, bucket_mb=BUCKET_MB)),
    # auto: BSP's code while it measures, then the step model (on one rank nothing travels: BSP)
    Mode("osp-auto", lambda: osp.OSP("auto", block_size=BLOCK, bucket_mb=BUCKET_MB)),
    Mode("osp-auto-warmup", lambda: osp.OSP("auto", warmup=STEPS + 2, block_size=BLOCK, bucket_mb=BUCKET_MB)),
    # resumed at a deferring share: BSP's code to OSP's at the first step (the corrector adopts BSP's state);
    # on one rank the step model may send it back to BSP once it has measured (the other handover) or not
    Mode("osp-auto-trials", lambda: osp.OSP("auto", block_size=BLOCK, bucket_mb=BUCKET_MB),
         prepare=_resumed_at(0.4)),
    Mode("osp-auto-deferring", lambda: osp.OSP("auto", block_size=BLOCK, bucket_mb=BUCKET_MB),
         prepare=_resumed_at(0.3)),
    Mode("dsync-1", lambda: osp.DSync(delay=1, bucket_mb=BUCKET_MB)),
    Mode("dsync-2", lambda: osp.DSync(delay=2, bucket_mb=BUCKET_MB)),
    Mode("dsync-3", lambda: osp.DSync(delay=3, bucket_mb=BUCKET_MB)),
    Mode("dsync-auto", lambda: osp.DSync(delay="auto", max_delay=3, bucket_mb=BUCKET_MB)),
    Mode("hsp", lambda: osp.HSP(max_extra=2)),
    Mode("hsp-closure", lambda: osp.HSP(max_extra=2), closure=True),
    # HSP composed with OSP and DSync (on one rank no extra runs: the composed mode, synchronizing at step())
    Mode("hsp-osp", lambda: osp.HSP(max_extra=2, sync=osp.OSP(0.25, block_size=BLOCK, bucket_mb=BUCKET_MB))),
    # auto inside HSP on BSP's steps (where .grad is not the average: HSP unscales for it), as auto starts
    Mode("hsp-osp-auto-closure", lambda: osp.HSP(max_extra=2, sync=osp.OSP("auto", block_size=BLOCK,
                                                                          bucket_mb=BUCKET_MB)), closure=True),
    Mode("hsp-dsync", lambda: osp.HSP(max_extra=2, sync=osp.DSync(delay=2, bucket_mb=BUCKET_MB))),
]}

# -- optimizers: every per-parameter optimizer of torch.optim, and one that reads the whole group ----


class GroupNormSGD(torch.optim.Optimizer):
    """A custom optimizer whose update of each parameter depends on all of its group's gradients (as
    LARS/LAMB-style global-norm optimizers do): SGD with the gradient scaled by 1 / (1 + ||g_group||)."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            grads = [p.grad for p in group["params"] if p.grad is not None]
            if not grads:
                continue
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
            for p in group["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                st["count"] = st.get("count", 0) + 1
                p.add_(p.grad / (1.0 + norm).to(p.dtype), alpha=-group["lr"])


OPT = torch.optim
# eps=1e-4 for the Adam family: torch's 1e-8 underflows in fp16 (fp16's smallest normal is 6e-5), and the
# trajectories of plain torch.optim then blow up, with nothing left to compare
OPTIMIZERS: Dict[str, Callable] = {
    "sgd": lambda ps: OPT.SGD(ps, lr=0.1),
    "sgd-momentum": lambda ps: OPT.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-nesterov-wd": lambda ps: OPT.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-dampening-maximize": lambda ps: OPT.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3, maximize=True),
    "sgd-foreach": lambda ps: OPT.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd-fused": lambda ps: OPT.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam": lambda ps: OPT.Adam(ps, lr=1e-2, eps=1e-4),
    "adam-amsgrad": lambda ps: OPT.Adam(ps, lr=1e-2, eps=1e-4, amsgrad=True, weight_decay=1e-2),
    "adam-foreach": lambda ps: OPT.Adam(ps, lr=1e-2, eps=1e-4, foreach=True),
    "adam-fused": lambda ps: OPT.Adam(ps, lr=1e-2, eps=1e-4, fused=True),
    "adamw": lambda ps: OPT.AdamW(ps, lr=1e-2, eps=1e-4, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: OPT.AdamW(ps, lr=1e-2, eps=1e-4, amsgrad=True),
    "adamw-fused": lambda ps: OPT.AdamW(ps, lr=1e-2, eps=1e-4, fused=True),
    "nadam": lambda ps: OPT.NAdam(ps, lr=1e-2, eps=1e-4),
    "radam": lambda ps: OPT.RAdam(ps, lr=1e-2, eps=1e-4),
    "adamax": lambda ps: OPT.Adamax(ps, lr=1e-2, eps=1e-4),
    "adagrad": lambda ps: OPT.Adagrad(ps, lr=5e-2),
    "adadelta": lambda ps: OPT.Adadelta(ps, lr=1.0),
    "rmsprop": lambda ps: OPT.RMSprop(ps, lr=1e-2, momentum=0.5),
    "rprop": lambda ps: OPT.Rprop(ps, lr=1e-2),
    "asgd": lambda ps: OPT.ASGD(ps, lr=5e-2),
    "group-norm-sgd": lambda ps: GroupNormSGD(ps, lr=0.1),
}

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
#: (optimizer, dtype) whose optimizer state torch itself leaves partly uninitialized: torch's CPU fused SGD
#: in fp16/bf16 (three plain torch runs of bsp|plain|sgd-fused|bf16 differ in a few momentum elements). Only
#: the parameters are compared there. (Its momentum also starts uninitialized when its first step is skipped:
#: no pattern skips the first step.)
NONDETERMINISTIC_STATE = {("sgd-fused", "fp16"), ("sgd-fused", "bf16")}

ULPS = 2  # per step, ulps of the tensor's scale: the bound of an ``ulp`` outcome, which only ULP_ALLOWED may have
#: (optimizer, dtype) whose cases may end within the bound rather than bitwise: torch's own fused Adam in 16-bit
#: (osp re-steps it; one case of 3858 ended 1 ulp off). Every other case must be bitwise: osp's kernels are
#: torch.optim's arithmetic (docs/api.md, Kernels), and a last-bit difference is what Adam grows into a visible one
ULP_ALLOWED = {(o, d) for o in ("adam-fused", "adamw-fused") for d in ("fp16", "bf16")}


# -- the model and the loop environment --------------------------------------------------------------

class Net(torch.nn.Module):
    """Parameters of 91, 13, 169, 65 and 5 elements (none a multiple of the block size), a branch some
    loops take on some steps only, and a parameter some loops never use."""

    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(7, 13)
        self.branch = torch.nn.Linear(13, 13, bias=False)
        self.b = torch.nn.Linear(13, 5)
        self.unused = torch.nn.Parameter(torch.randn(3))
        self.to(dtype)

    def forward(self, x, branch=True, tied=False):
        if hasattr(self, "emb"):  # conformance.Pattern(prepare=_embedding): rows picked by the input
            x = x + self.emb((x[:, 0].float().abs() * 5).long() % self.emb.num_embeddings)
        h = torch.tanh(self.a(x))
        if branch:
            h = h + torch.tanh(self.branch(h))
        if tied:  # the same parameter twice in one graph
            h = h + torch.tanh(self.branch(torch.tanh(self.branch(h))))
        return self.b(h)


class Env:
    """One run of a loop: the model, the (wrapped or plain) optimizer, and the calls a pattern makes,
    each doing what the user would write with plain torch.optim or with osp."""

    def __init__(self, case: "Case", wrapped: bool, steps: int = STEPS, backend: str = "torch", rank: int = 0):
        self.case, self.wrapped, self.steps = case, wrapped, steps
        self.backend, self.rank = backend, rank  # several ranks: each draws its own data
        self.record: Optional[Callable[["Env"], None]] = None  # called right before each step()
        self.feature = FE.FEATURES[case.feature]
        self.synced: List[torch.Tensor] = []  # the parameters at every on_synced call (feature "on-synced")
        self.dtype = DTYPES[case.dtype]
        self.pattern = PATTERNS[case.pattern]
        self.mode = MODES[case.mode]
        self.bpps = self.pattern.bpps
        self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8) if self.pattern.scaler else None
        self.build()

    def build(self) -> None:
        self.model = Net(self.dtype)
        if self.pattern.prepare is not None:
            self.pattern.prepare(self.model)
        if self.wrapped and self.feature.apart and self.rank:  # every rank's own initial weights
            with torch.no_grad():
                for p in self.model.parameters():
                    p.add_(0.01 * self.rank)
        self.forward = self.model
        groups = self.pattern.groups(self.model)
        self.inner = OPTIMIZERS[self.case.optimizer](groups)
        if self.wrapped:
            self.opt = osp.DistributedOptimizer(self.inner, self.model.named_parameters(), sync=self.mode.make(),
                                                backend=self.backend, backward_passes_per_step=self.bpps,
                                                timeout=60, compression=self.case.compression,
                                                **self.feature.keywords(self))
            if self.mode.prepare is not None:
                self.mode.prepare(self.opt)
        else:
            self.opt = self.inner
        self.sched = self.pattern.scheduler(self.opt) if self.pattern.scheduler else None
        self.ema = None
        if self.pattern.after_wrap is not None:
            self.pattern.after_wrap(self)

    def digest(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1).double() for p in self.model.parameters()])

    def data(self, t: int, micro: int = 0):
        g = torch.Generator().manual_seed(1000 * t + micro + 100003 * self.rank)
        x = torch.randn(6, 7, generator=g).to(self.dtype)
        y = torch.randn(6, 5, generator=g)
        return x, y

    def loss(self, t: int, micro: int = 0, branch: bool = True, factor: float = 1.0):
        x, y = self.data(t, micro)
        out = self.forward(x, branch=branch, **self.pattern.forward).float()
        loss = ((out - y) ** 2).mean() * factor
        if self.pattern.use_unused:
            loss = loss + (self.model.unused.float() ** 2).sum() * 0.1
        return loss

    def backward(self, t: int, micro: int = 0, **kw) -> None:
        loss = self.loss(t, micro, **kw)
        if self.pattern.penalty:  # a gradient-norm penalty through torch.autograd.grad (as WGAN-GP, R1, SAM do)
            params = [p for p in self.model.parameters() if p.requires_grad]
            grads = torch.autograd.grad(loss, params, create_graph=True, allow_unused=True)
            loss = loss + 0.1 * sum((g.float() ** 2).sum() for g in grads if g is not None)
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.opt.zero_grad(set_to_none=set_to_none)

    def no_sync(self):
        return self.opt.no_sync() if self.wrapped else contextlib.nullcontext()

    def clip_torch(self, m: float) -> None:
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), m)

    def clip(self, m: float) -> None:
        """Clip by the norm of the averaged gradient: osp's own, torch's on the plain optimizer."""
        if self.wrapped:
            self.opt.clip_grad_norm_(m)
        else:
            self.compress()
            self.clip_torch(m)

    def clip_value(self, v: float) -> None:
        """Clip every element of the averaged gradient into [-v, v]: osp's own, torch's on the plain optimizer."""
        if self.wrapped:
            self.opt.clip_grad_value_(v)
        else:
            self.compress()
            torch.nn.utils.clip_grad_value_(self.model.parameters(), v)

    def compress(self) -> None:
        """The plain optimizer's gradients as one rank's compressed average gives them (once per step)."""
        wire = osp.compression.wire_dtype(osp.compression.resolve(self.case.compression), self.dtype)
        if self.wrapped or wire is None or getattr(self, "_compressed", False):
            return
        self._compressed = True
        for p in self.model.parameters():
            if p.grad is not None:
                p.grad.copy_(p.grad.to(wire).to(p.grad.dtype))

    def step(self, t: int) -> None:
        self.compress()
        self._compressed = False
        if self.record is not None:
            self.record(self)
        if self.scaler is not None:
            self.scaler.step(self.opt)
            self.scaler.update()
        elif self.wrapped and self.mode.closure:
            self.opt.step(lambda: self.backward(t, micro=99))
        elif self.wrapped or not self.pattern.skips_nonfinite or all(
                bool(p.grad.isfinite().all()) for p in self.model.parameters() if p.grad is not None):
            self.opt.step()
        if self.sched is not None:
            self.sched.step()
        if self.ema is not None:
            self.ema.update_parameters(self.model)

    def sync_clip(self, m: float) -> None:
        """Horovod's idiom for clipping: the average finished, clipped by torch, then stepped as it is."""
        if not self.wrapped:
            self.clip_torch(m)
            self.opt.step()
            return
        self.opt.synchronize()
        self.clip_torch(m)
        with self.opt.skip_synchronize():
            self.opt.step()

    def flush(self) -> None:
        if self.wrapped:
            self.opt.flush()

    def reload(self) -> None:
        """A state_dict round trip: save the model and optimizer, build both anew, load them."""
        self.flush()
        model_sd = {k: v.clone() for k, v in self.model.state_dict().items()}
        opt_sd = self.opt.state_dict()
        sched_sd = self.sched.state_dict() if self.sched else None
        scaler_sd = self.scaler.state_dict() if self.scaler else None
        self.build()
        self.model.load_state_dict(model_sd)
        self.opt.load_state_dict(opt_sd)
        if sched_sd is not None:
            self.sched.load_state_dict(sched_sd)
        if scaler_sd is not None:
            self.scaler.load_state_dict(scaler_sd)

    def params(self) -> List[torch.Tensor]:
        """The parameters (and an EMA copy's, where the loop keeps one)."""
        ps = list(self.model.parameters()) + (list(self.ema.parameters()) if self.ema is not None else [])
        return [p.detach().clone() for p in ps]

    def state(self) -> List[Tuple[str, torch.Tensor]]:
        """The optimizer's state, per parameter in model order, as (name, tensor) pairs."""
        out = []
        st = self.opt.state
        for name, p in self.model.named_parameters():
            for k, v in sorted((st.get(p) or {}).items()):
                v = v if torch.is_tensor(v) else torch.tensor(float(v))
                out.append((f"{name}.{k}", v.detach().clone()))
        return out


# -- loop patterns --------------------------------------------------------------------------------

def _plain_groups(model):
    return list(model.parameters())


@dataclass(frozen=True)
class Pattern:
    name: str
    body: Callable[[Env, int], None]  # one iteration of the loop at step t
    bpps: int = 1
    scaler: bool = False
    use_unused: bool = True  # the parameter ``Net.unused`` is in the loss (False: it never gets a gradient)
    #: plain torch.optim skips a step whose gradient is not finite, as osp does in every mode (README)
    skips_nonfinite: bool = False
    groups: Callable = _plain_groups
    scheduler: Optional[Callable] = None
    forward: Dict[str, bool] = field(default_factory=dict)  # keywords of Net.forward (tied=True)
    penalty: bool = False  # the loss gets a gradient-norm penalty through torch.autograd.grad
    prepare: Optional[Callable] = None  # changes the model before its optimizer is built (a parametrization)
    after_wrap: Optional[Callable] = None  # called with the Env once the optimizer is built (an EMA copy)


def _plain(env, t):
    env.zero_grad()
    env.backward(t)
    env.step(t)


def _accumulate(env, t):
    env.zero_grad()
    for k in range(env.bpps):
        env.backward(t, micro=k)
    env.step(t)


def _no_sync(env, t):
    """DDP's no_sync(): two passes accumulated locally, then the step's pass (with plain torch.optim all
    three simply accumulate); with backward_passes_per_step=2 one no_sync pass between the counted two."""
    env.zero_grad()
    if env.bpps == 1:
        with env.no_sync():
            env.backward(t, micro=0)
            env.backward(t, micro=1)
        env.backward(t, micro=2)
    else:
        env.backward(t, micro=0)
        with env.no_sync():
            env.backward(t, micro=1)
        env.backward(t, micro=2)
    env.step(t)


def _clip_torch(env, t):
    env.zero_grad()
    env.backward(t)
    env.clip_torch(0.05)
    env.step(t)


def _clip_opt(max_norm: float, every: int = 1):
    """``opt.clip_grad_norm_(max_norm)`` on every ``every``-th step (a step that does not ask is not
    clipped); a ``max_norm`` above the gradient's norm caps the factor at 1 (nothing scaled up)."""
    def pattern(env, t):
        env.zero_grad()
        env.backward(t)
        if t % every == 0:
            env.clip(max_norm)
        env.step(t)
    return pattern


def _clip_value_opt(env, t):
    """``opt.clip_grad_value_`` at a value that clamps part of the gradient's elements, not all."""
    env.zero_grad()
    env.backward(t)
    env.clip_value(0.02)
    env.step(t)


def _grad_inplace(env, t):
    env.zero_grad()
    env.backward(t)
    for i, p in enumerate(env.model.parameters()):
        if p.grad is not None:
            p.grad.mul_(0.5 + 0.1 * i)
    env.step(t)


def _grad_replaced(env, t):
    env.zero_grad()
    env.backward(t)
    for i, p in enumerate(env.model.parameters()):
        if p.grad is not None:
            p.grad = p.grad * (0.5 + 0.1 * i)
    env.step(t)


def _scaler_overflow(env, t):
    env.zero_grad()
    env.backward(t, factor=math.inf if t == 2 else 1.0)
    env.step(t)


def _scaler_overflows_flushed(env, t):
    """Two overflows in a row, flushed right after: a GradScaler backs off twice."""
    env.zero_grad()
    env.backward(t, factor=math.inf if t in (1, 2) else 1.0)
    env.step(t)
    if t == 2:
        env.flush()


def _scaler_overflow_reload(env, t):
    """An overflow, then a state_dict round trip before the scaler has heard of it (DSync)."""
    if t == 2:
        env.reload()
    env.zero_grad()
    env.backward(t, factor=math.inf if t == 1 else 1.0)
    env.step(t)


def _scaler_unscale_clip(env, t):
    env.zero_grad()
    env.backward(t, factor=math.inf if t == 3 else 1.0)
    env.scaler.unscale_(env.opt)
    env.clip(0.05)
    env.step(t)


def _sometimes(env, t):
    env.zero_grad()
    env.backward(t, branch=t % 3 == 1)
    env.step(t)


def freeze_schedule(model, t):
    """The freeze-unfreeze pattern's requires_grad changes at step ``t`` (a replay repeats them)."""
    if t in (2, 5):
        model.branch.weight.requires_grad_(t == 5)
        model.a.bias.requires_grad_(t == 5)


def _freeze(env, t):
    freeze_schedule(env.model, t)
    _plain(env, t)


def _freeze_two_groups(env, t):
    """A branch skipped on one step, then a parameter of the same group frozen and unfrozen: the group's
    parameters are one update apart, then equal again (two groups; found by the hypothesis layer)."""
    if t == 3:
        env.model.a.weight.requires_grad_(False)
    if t == 5:
        env.model.a.weight.requires_grad_(True)
    env.zero_grad()
    env.backward(t, branch=t != 2)
    env.step(t)


def _group_without_gradients(env, t):
    """The first of two groups has no gradient at all in the first step (its parameters frozen or off the
    branch), then trains (found by the hypothesis layer: a fused correction of a group with no state)."""
    env.model.a.weight.requires_grad_(t != 0)
    env.zero_grad()
    env.backward(t, branch=t != 0)
    env.step(t)


def _zero_false(env, t):
    env.zero_grad(set_to_none=False)
    env.backward(t)
    env.step(t)


def _flush_reload(env, t):
    if t == 3:
        env.reload()
    _plain(env, t)


def _flush_mid(env, t):
    _plain(env, t)
    if t in (2, 3):
        env.flush()


def _edit(flush):
    def body(env, t):
        _plain(env, t)
        if t == 2:
            if flush:
                env.flush()
            with torch.no_grad():
                env.model.a.weight.clamp_(-0.2, 0.2)
    return body


def _edit_data(env, t):
    """An edit through ``.data`` (no version counter of the parameter sees it), without a flush."""
    _plain(env, t)
    if t == 2:
        env.model.a.weight.data.mul_(0.5)


def _reset_world(env, t):
    if t == 3 and env.wrapped:
        env.opt.flush()
        env.opt.reset_world()
    _plain(env, t)


def _branch_one_rank(env, t):
    """A parameter with a gradient on rank 0 only, on some steps (on one rank: a branch some steps take)."""
    env.zero_grad()
    env.backward(t, branch=env.rank == 0 and t % 2 == 1)
    env.step(t)


def _overflow_one_rank(env, t):
    """A GradScaler overflow on rank 1 only (none on one rank)."""
    env.zero_grad()
    env.backward(t, factor=math.inf if (t == 2 and env.rank == 1) else 1.0)
    env.step(t)


def _sync_clip(env, t):
    env.zero_grad()
    env.backward(t)
    env.sync_clip(0.05)
    if env.sched is not None:
        env.sched.step()


def _weight_norm(model):
    torch.nn.utils.parametrizations.weight_norm(model.a)


def _embedding(model):
    torch.manual_seed(1)
    model.emb = torch.nn.Embedding(11, 7, max_norm=1.0).to(model.a.weight.dtype)


def _ema(env):
    swa = torch.optim.swa_utils
    env.ema = swa.AveragedModel(env.model, multi_avg_fn=swa.get_ema_multi_avg_fn(0.9))


def _compiled(env):
    env.forward = torch.compile(env.model, backend="eager")


def _two_groups(model):
    return [{"params": [model.a.weight, model.branch.weight], "lr": 0.02},
            {"params": [model.a.bias, model.b.weight, model.b.bias, model.unused], "weight_decay": 0.01}]


def _step_lr(opt):
    return torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def _tensor_lr_groups(model):
    return [{"params": list(model.parameters()), "lr": torch.tensor(0.02)}]


PATTERNS: Dict[str, Pattern] = {p.name: p for p in [
    Pattern("plain", _plain),
    Pattern("accumulate-2", _accumulate, bpps=2),
    Pattern("accumulate-3", _accumulate, bpps=3),
    Pattern("no-sync", _no_sync),
    Pattern("no-sync-accumulate-2", _no_sync, bpps=2),
    Pattern("clip-torch", _clip_torch),
    Pattern("clip-opt", _clip_opt(0.05)),
    Pattern("clip-opt-loose", _clip_opt(50.0)),
    Pattern("clip-opt-sometimes", _clip_opt(0.05, every=2)),
    Pattern("clip-value-opt", _clip_value_opt),
    Pattern("param-groups-clip-opt", _clip_opt(0.05), groups=_two_groups),
    Pattern("grad-inplace", _grad_inplace),
    Pattern("grad-replaced", _grad_replaced),
    Pattern("scaler", _plain, scaler=True),
    Pattern("scaler-overflow", _scaler_overflow, scaler=True),
    Pattern("scaler-unscale-clip", _scaler_unscale_clip, scaler=True),
    Pattern("scaler-overflows-flushed", _scaler_overflows_flushed, scaler=True),
    Pattern("scaler-overflow-reload", _scaler_overflow_reload, scaler=True),
    Pattern("unused-param", _plain, use_unused=False),
    Pattern("nonfinite-skipped", _scaler_overflow, skips_nonfinite=True),
    Pattern("branch-sometimes", _sometimes),
    Pattern("branch-one-rank", _branch_one_rank),
    Pattern("scaler-overflow-one-rank", _overflow_one_rank, scaler=True),
    Pattern("freeze-unfreeze", _freeze),
    Pattern("param-groups-freeze-unfreeze", _freeze_two_groups, groups=_two_groups),
    Pattern("param-group-without-gradients", _group_without_gradients, groups=_two_groups),
    Pattern("param-groups", _plain, groups=_two_groups),
    Pattern("param-groups-branch-sometimes", _sometimes, groups=_two_groups),
    Pattern("lr-scheduler", _plain, scheduler=_step_lr),
    Pattern("tensor-lr-scheduler", _plain, groups=_tensor_lr_groups, scheduler=_step_lr),
    Pattern("zero-grad-keep", _zero_false, use_unused=False),  # a gradient that is None must stay None
    Pattern("flush-mid-run", _flush_mid),
    Pattern("state-dict-round-trip", _flush_reload),
    Pattern("edit-after-flush", _edit(True)),
    Pattern("edit-unflushed", _edit(False)),
    Pattern("edit-data-unflushed", _edit_data),
    Pattern("reset-world", _reset_world),
    # loops users write (issue #48): Horovod's clipping idiom, a gradient penalty through torch.autograd.grad,
    # a parameter used twice in one graph, a parametrization, an EMA copy, a compiled model, an embedding that
    # renormalizes its rows inside forward
    Pattern("synchronize-clip", _sync_clip),
    Pattern("grad-penalty", _plain, penalty=True),
    Pattern("tied-weights", _plain, forward={"tied": True}),
    Pattern("weight-norm", _plain, prepare=_weight_norm),
    Pattern("ema", _plain, after_wrap=_ema),
    Pattern("compiled-eager", _plain, after_wrap=_compiled),
    Pattern("max-norm-embedding", _plain, prepare=_embedding),
]}

#: (mode family or name, pattern) -> the error osp raises by design, a regex of its message
REFUSED: Dict[Tuple[str, str], str] = {}
for _m in ("osp-0.25", "osp-0.0", "dsync-1", "dsync-2", "dsync-3", "dsync-auto", "hsp-osp", "hsp-dsync"):
    REFUSED[(_m, "edit-unflushed")] = REFUSED[(_m, "edit-data-unflushed")] = "parameters were changed between steps"
for _m in ("dsync-1", "dsync-2", "dsync-3", "dsync-auto", "hsp-dsync"):
    for _p in ("clip-torch", "grad-inplace", "grad-replaced"):
        REFUSED[(_m, _p)] = "gradients were changed in place or replaced between backward"
for _p in [p for p in PATTERNS if p.startswith("scaler")]:
    REFUSED[("dsync-auto", _p)] = "cannot take a GradScaler"
# nn.Embedding(max_norm=...) renormalizes rows inside forward: an in-place edit of provisional weights no exact
# correction can replay (refused at the first step with a correction pending)
for _m in ("osp-0.25", "osp-0.0", "dsync-1", "dsync-2", "dsync-3", "dsync-auto", "hsp-osp", "hsp-dsync"):
    REFUSED[(_m, "max-norm-embedding")] = "in-forward in-place edit"
#: (mode, pattern) -> a refusal that may come or not: OSP("auto") defers in some steps or not, by what it
#: measures on a machine whose load varies; either outcome must be correct
MAY_REFUSE: Dict[Tuple[str, str], str] = {("osp-auto", "max-norm-embedding"): "in-forward in-place edit"}
for _m in ("osp-auto-trials", "osp-auto-deferring"):
    MAY_REFUSE[(_m, "max-norm-embedding")] = "in-forward in-place edit"
    MAY_REFUSE[(_m, "edit-unflushed")] = MAY_REFUSE[(_m, "edit-data-unflushed")] = \
        "parameters were changed between steps"
# Horovod's idiom (synchronize(), clip .grad, step() in skip_synchronize()) needs .grad to be the average
for _m in [m for m in MODES if m not in ("bsp", "osp-1.0")]:
    REFUSED[(_m, "synchronize-clip")] = r"synchronize\(\) is for osp.BSP\(\)"


def refusal(mode: str, pattern: str, feature: str = "none") -> Optional[str]:
    """The error ``mode`` raises by design on ``pattern`` with ``feature`` (a regex of its message), or None."""
    wants = [w for w in (REFUSED.get((mode, pattern)), MAY_REFUSE.get((mode, pattern)), FE.refusal(mode, feature))
             if w is not None]
    return "|".join(f"(?:{w})" for w in wants) if wants else None


# -- the oracle ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    mode: str
    pattern: str
    optimizer: str
    dtype: str = "fp32"
    #: what the gradients travel as (``osp.Compression``): the plain optimizer then steps on each gradient as
    #: one rank's compressed average gives it (cast to the wire and back), from the moment it is averaged
    compression: str = "none"
    #: a value of the feature axis (``features.AXIS``: keywords of DistributedOptimizer, join() at the end)
    feature: str = "none"

    @property
    def id(self) -> str:
        tail = "" if self.compression == "none" else f"|{self.compression}"
        if self.feature != "none":
            tail = f"|{self.compression}|{self.feature}"
        return f"{self.mode}|{self.pattern}|{self.optimizer}|{self.dtype}{tail}"

    @staticmethod
    def parse(cid: str) -> "Case":
        parts = cid.split("|")
        return Case(*parts) if len(parts) > 3 else Case(*parts, "fp32")


@dataclass
class Outcome:
    kind: str  # bitwise, ulp, refused, torch-refuses, differs, error
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.kind in ("bitwise", "ulp", "refused", "torch-refuses", "torch-nonfinite")


def _trace(env: Env) -> Tuple[List[List[torch.Tensor]], Optional[BaseException], int]:
    """Run the loop; the parameters after every step, the error that stopped it and at which step."""
    out = []
    for t in range(env.steps):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                env.pattern.body(env, t)
        except Exception as e:  # noqa: BLE001 - the oracle classifies it
            return out, e, t
        out.append(env.params())
    try:
        if env.feature.end is not None:
            env.feature.end(env)
        env.flush()
    except Exception as e:  # noqa: BLE001
        return out, e, env.steps
    return out, None, env.steps


def tolerance(ref: torch.Tensor, steps: int) -> float:
    """The documented bound after ``steps`` steps: ``ULPS`` ulps of the tensor's scale per step."""
    scale = float(ref.detach().abs().max()) if ref.numel() else 0.0
    return ULPS * steps * torch.finfo(ref.dtype).eps * max(scale, 1e-3) if ref.is_floating_point() else 0.0


def compare(a: torch.Tensor, b: torch.Tensor, steps: int) -> Tuple[bool, float]:
    """(bitwise equal, within tolerance); nan where ``b`` has nan must be nan in ``a`` too."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False, False
    if torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                             and torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))):
        return True, True
    if not a.is_floating_point():
        return False, False
    diff = (a.double() - b.double()).abs().nan_to_num(math.inf)
    return False, float(diff.max()) <= tolerance(b, steps)


def run_case(case: Case) -> Outcome:
    ref_env = Env(case, wrapped=False)
    ref, ref_err, _ = _trace(ref_env)
    try:
        env = Env(case, wrapped=True)
    except Exception as e:  # noqa: BLE001
        return _refused_or_error(case, e, ref_err, 0)
    got, err, at = _trace(env)
    if ref_err is not None:
        if err is not None:
            return Outcome("torch-refuses", f"torch: {ref_err!r}; osp: {err!r}")
        return Outcome("differs", f"torch raised {ref_err!r}, osp did not")
    blown = next((t for t, ps in enumerate(ref) if not all(bool(p.isfinite().all()) for p in ps)), None)
    if blown is not None:
        # plain torch.optim wrote inf/nan into the parameters (e.g. Adam's eps underflows in fp16); osp
        # skips a step with a non-finite gradient on every rank instead (README): compare up to there
        ref, got = ref[:blown], got[:blown]
        if err is None and len(got) == blown:
            return _compare_steps(got, ref) or Outcome("torch-nonfinite", f"torch's parameters non-finite "
                                                                          f"after step {blown}")
    if err is not None:
        return _refused_or_error(case, err, None, at)
    early = _compare_steps(got, ref)
    if early is not None:
        return early
    bitwise = all(torch.equal(a, b) for pa, pb in zip(got, ref) for a, b in zip(pa, pb))
    with_state = (case.optimizer, case.dtype) not in NONDETERMINISTIC_STATE
    final = ([("param", p) for p in env.params()] + (env.state() if with_state else []),
             [("param", p) for p in ref_env.params()] + (ref_env.state() if with_state else []))
    if [k for k, _ in final[0]] != [k for k, _ in final[1]]:
        return Outcome("differs", f"optimizer state keys {[k for k, _ in final[0]]} != "
                                  f"{[k for k, _ in final[1]]}")
    for (k, a), (_, b) in zip(*final):
        if a.dtype != b.dtype:
            a = a.to(b.dtype)
        eq, close = compare(a, b, env.steps)
        bitwise &= eq
        if not close:
            return Outcome("differs", f"after flush, {k}: {a.flatten()[:4].tolist()} != {b.flatten()[:4].tolist()}")
    if case.feature == "on-synced" and (not env.synced or not torch.equal(env.synced[-1], env.digest())):
        return Outcome("differs", f"on_synced: {len(env.synced)} calls, the last not at flush()'s parameters")
    if case.pattern.startswith("scaler") and ref_env.scaler.get_scale() != env.scaler.get_scale():
        return Outcome("differs", f"loss scale {env.scaler.get_scale()} != {ref_env.scaler.get_scale()}")
    return Outcome("bitwise" if bitwise else "ulp")


def verdict(case: Case, out: Outcome) -> Optional[str]:
    """What is wrong with ``out`` for ``case`` (None: nothing): not an accepted outcome, or a refusal the
    REFUSED table promises that did not come (unless torch itself refused or went non-finite first)."""
    if not out.ok:
        return f"{case.id}: {out.kind}: {out.detail}"
    if out.kind == "ulp" and (case.optimizer, case.dtype) not in ULP_ALLOWED:
        return f"{case.id}: within {ULPS} ulps a step of torch.optim, but not bitwise: {out.detail}"
    want = refusal(case.mode, case.pattern, case.feature)
    optional = (case.mode, case.pattern) in MAY_REFUSE and FE.refusal(case.mode, case.feature) is None
    if want is not None and not optional and out.kind not in ("refused", "torch-refuses", "torch-nonfinite"):
        return f"{case.id}: expected a refusal ({want!r}), got {out.kind}"
    return None


def _compare_steps(got, ref) -> Optional[Outcome]:
    """A ``differs`` outcome naming the first parameter outside the bound after some step, or None."""
    for t, (pa, pb) in enumerate(zip(got, ref)):
        for i, (a, b) in enumerate(zip(pa, pb)):
            if not compare(a, b, t + 1)[1]:
                return Outcome("differs", f"parameter {i} after step {t}: max abs diff "
                                          f"{(a.double() - b.double()).abs().max().item():.3g}, "
                                          f"bound {tolerance(b, t + 1):.3g}")
    return None


def _refused_or_error(case: Case, err: BaseException, ref_err, at: int) -> Outcome:
    import re
    if ref_err is not None:
        return Outcome("torch-refuses", f"torch: {ref_err!r}; osp: {err!r}")
    want = refusal(case.mode, case.pattern, case.feature)
    if want is not None and re.search(want, str(err)):
        return Outcome("refused", f"at step {at}: {str(err)[:120]}")
    return Outcome("error", f"at step {at}: {type(err).__name__}: {err}")


# -- generating cases -------------------------------------------------------------------------------

def pairwise(tables: List[List[str]], seed: int = 0) -> List[Tuple[str, ...]]:
    """Rows covering every pair of values of every two tables at least once (greedy, deterministic)."""
    rng = random.Random(seed)
    uncovered = {(i, a, j, b) for i, j in itertools.combinations(range(len(tables)), 2)
                 for a in tables[i] for b in tables[j]}
    rows = []
    while uncovered:
        i, a, j, b = min(uncovered)
        best, gain = None, -1
        for _ in range(40):
            row = [rng.choice(t) for t in tables]
            row[i], row[j] = a, b
            g = sum((x, row[x], y, row[y]) in uncovered for x, y in itertools.combinations(range(len(tables)), 2))
            if g > gain:
                best, gain = row, g
        rows.append(tuple(best))
        uncovered -= {(x, best[x], y, best[y]) for x, y in itertools.combinations(range(len(tables)), 2)}
    return rows


def pairwise_cases() -> List[Case]:
    """Every pair of values of the five tables: modes, patterns, optimizers, dtypes and features."""
    rows = pairwise([sorted(MODES), sorted(PATTERNS), sorted(OPTIMIZERS), sorted(DTYPES), FE.AXIS])
    return [Case(m, p, o, d, "none", f) for m, p, o, d, f in rows]


def mode_feature_cases(patterns=("plain",), optimizers=("sgd-momentum", "adamw")) -> List[Case]:
    """Every mode with every feature (``features.AXIS``) on ``patterns``, for the optimizers with fused kernels."""
    return [Case(m, p, o, "fp32", "none", f) for m in MODES for f in FE.AXIS if f != "none" for p in patterns
            for o in optimizers]


def feature_sweep_cases() -> List[Case]:
    """The full product of modes, features and patterns for two optimizers (``make conformance-features``)."""
    return mode_feature_cases(patterns=tuple(sorted(PATTERNS)))


def mode_pattern_cases(optimizers=("sgd-momentum", "adamw")) -> List[Case]:
    """Every mode with every pattern, for the optimizers with fused kernels."""
    return [Case(m, p, o) for m in MODES for p in PATTERNS for o in optimizers]


def wire_average(got: List[Optional[torch.Tensor]], dtype: torch.dtype, wire: Optional[torch.dtype]) -> torch.Tensor:
    """The average of the ranks' gradients ``got`` (None: zeros) in ``dtype`` as a compressed collective forms
    it (``osp.comm.Comm``, ``wire=``): each divided by the number of ranks, cast to ``wire``, summed there in
    rank order (exact for 2 ranks: one rounded addition), cast back. ``wire=None``: the plain average."""
    present = [g for g in got if g is not None]
    if wire is None:
        return (sum(present) / len(got)).to(dtype)
    parts = [torch.zeros_like(present[0]).to(wire) if g is None else (g.to(dtype) / len(got)).to(wire) for g in got]
    total = parts[0]
    for q in parts[1:]:
        total = (total.float() + q.float()).to(wire)
    return total.to(dtype)


#: the loops whose gradients nothing edits between backward and step but osp's own clipping, where one
#: rank's compressed average is the same whether a mode averages in backward (BSP) or in step() (OSP, DSync)
COMPRESSION_PATTERNS = ("plain", "accumulate-2", "no-sync", "unused-param", "branch-sometimes", "freeze-unfreeze",
                        "param-groups", "lr-scheduler", "clip-opt", "flush-mid-run", "state-dict-round-trip")


#: the modes whose every update is computed from the (compressed) average itself. The others apply a
#: provisional update from the rank's own gradient first (OSP's deferred blocks, DSync's steps in flight),
#: which on one rank equals the average only while nothing is compressed: the next gradient is then taken
#: at other weights than plain torch.optim's. Their compression column is the replay of the recorded
#: gradients on 2 ranks (tests/test_conformance_ranks.py) and tests/test_compression.py.
COMPRESSION_ONE_RANK_MODES = ("bsp", "hsp", "hsp-closure", "osp-1.0", "osp-auto-warmup")


def compression_cases(optimizers=("sgd-momentum", "adamw")) -> List[Case]:
    """The compression column of the one-rank oracle: those modes on those loops, float16 and bfloat16 on the
    wire."""
    return [Case(m, p, o, "fp32", c) for m in COMPRESSION_ONE_RANK_MODES for p in COMPRESSION_PATTERNS
            for o in optimizers for c in ("fp16", "bf16")] + [
        # 16-bit parameters: a gradient of the wire's dtype travels as it is; float16 on a bfloat16 wire (and
        # back) is cast both ways
        Case(m, p, o, d, c) for m in COMPRESSION_ONE_RANK_MODES for p in ("plain", "accumulate-2", "clip-opt")
        for o in optimizers for d in ("fp16", "bf16") for c in ("fp16", "bf16")]


def mode_optimizer_cases() -> List[Case]:
    """Every mode with every optimizer on the plain loop and on the loops that stress corrections. HSP's
    compositions are left out: on one rank they are the composed mode's steps, whose corrections these rows
    cover already (every pattern, and the pairwise rows, still run them)."""
    return [Case(m, p, o) for m in MODES if not m.startswith("hsp-") for o in OPTIMIZERS
            for p in ("plain", "branch-sometimes", "clip-opt")]
