"""Oracle 1, randomized: hypothesis generates training loops and checks the one-rank oracle of
tests/conformance.py on each (osp equals plain ``torch.optim`` after every step and after ``flush()``, or
refuses by design, as ``REFUSED`` lists).

A loop is a mode (``MODES``), an optimizer (``OPTIMIZERS``), a dtype (fp32 mostly), per loop
``backward_passes_per_step`` k (1-3), a GradScaler or not, an LR scheduler or not, one or two param groups,
and 4-9 steps, each a random combination of: freezing or unfreezing a parameter, ``zero_grad`` (set to
None, zeros, or none at all), 1..k backward passes (the branch on or off per pass; under a GradScaler an
occasional loss of inf, an overflow), an in-place ``p.grad.mul_``, a clip (``opt.clip_grad_norm_``; torch's
on the plain side, after ``scaler.unscale_``), the step, a scheduler step, ``flush()``, a parameter edit
after ``flush()`` and a ``state_dict`` round trip; and a value of the feature axis (tests/features.py: a keyword of
``DistributedOptimizer``, or ``join()`` at the end). Both sides run the same generated body: it is a
``Pattern`` of conformance's, registered for the test in a copy of ``PATTERNS``, and ``run_case`` compares.
Kept out, each for a reason given where it is generated: no zero_grad at all under a GradScaler, an overflow
in the last d steps of DSync(delay=d), and overflows with torch's fused optimizers.

``make test`` runs 150 derandomized examples (deterministic); ``make conformance-random`` runs 2000 with a
random seed (``OSP_HYPOTHESIS_EXAMPLES=n`` for n, ``OSP_HYPOTHESIS_SEED=s`` to replay a seed). A failure
prints the seed and the shrunk loop.
"""
from __future__ import annotations

import math
import os
import random
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Optional, Tuple

import conformance as C
import pytest
import torch
import torch.distributed as dist
from hypothesis import HealthCheck, event, given, note, seed, settings
from hypothesis import strategies as st

EXAMPLES = os.environ.get("OSP_HYPOTHESIS_EXAMPLES")
SEED_ENV = os.environ.get("OSP_HYPOTHESIS_SEED")
#: the default run is derandomized (the same examples every time); a longer run or a given seed is not
RANDOM = EXAMPLES is not None or SEED_ENV is not None
SEED = int(SEED_ENV) if SEED_ENV else (random.SystemRandom().randrange(2 ** 32) if RANDOM else None)

FREEZABLE = ("a.weight", "a.bias", "branch.weight", "b.bias")  # b.weight always trains: a loss needs a grad
EDITABLE = ("a.weight", "a.bias", "branch.weight", "b.weight", "b.bias")


# -- the generated loop ------------------------------------------------------------------------------

@dataclass(frozen=True)
class Pass:
    branch: bool = True
    overflow: bool = False  # loss times inf (GradScaler loops only)

    def __repr__(self) -> str:
        return ("b" if self.branch else "-") + ("!" if self.overflow else "")

    def _repr_pretty_(self, p, cycle):  # hypothesis prints dataclasses field by field otherwise
        p.text(repr(self))


@dataclass(frozen=True)
class Step:
    passes: Tuple[Pass, ...]
    zero: Optional[bool] = True  # zero_grad(set_to_none=zero) first; None: no zero_grad
    freeze: Optional[Tuple[str, bool]] = None  # (parameter, requires_grad) set before everything
    grad_mul: bool = False  # p.grad.mul_(...) after the backward passes
    clip: bool = False  # opt.clip_grad_norm_(0.05) (after scaler.unscale_ under a scaler)
    sched: bool = False  # scheduler.step() after the step
    flush: bool = False
    edit: Optional[str] = None  # flush(), then this parameter edited in place
    reload: bool = False  # a state_dict round trip (Env.reload) at the end

    def __repr__(self) -> str:
        out = []
        if self.freeze:
            out.append(("unfreeze" if self.freeze[1] else "freeze") + f"({self.freeze[0]})")
        if self.zero is not None:
            out.append("zero_grad" if self.zero else "zero_grad(False)")
        out.append("bwd[" + ",".join(map(repr, self.passes)) + "]")
        out += ["mul"] * self.grad_mul + ["clip"] * self.clip + ["step"] + ["sched"] * self.sched
        out += ["flush"] * (self.flush and not self.edit)
        if self.edit:
            out.append(f"flush+edit({self.edit})")
        out += ["reload"] * self.reload
        return " ".join(out)

    _repr_pretty_ = Pass._repr_pretty_


@dataclass(frozen=True)
class Loop:
    mode: str
    optimizer: str
    dtype: str
    bpps: int
    scaler: bool
    scheduler: bool
    two_groups: bool
    steps: Tuple[Step, ...]
    feature: str = "none"  # a value of the feature axis (tests/features.py): keywords, join() at the end

    @property
    def pattern(self) -> str:
        # run_case compares the loss scale of patterns named scaler*
        return "scaler-random" if self.scaler else "random"

    def refusal(self) -> Optional[str]:
        """The refusals by design this loop may meet: REFUSED's, for the fixed patterns its actions are."""
        uses = ["plain"]
        uses += ["grad-inplace"] * any(s.grad_mul for s in self.steps)
        uses += ["clip-opt"] * any(s.clip for s in self.steps)
        uses += ["scaler"] * self.scaler
        uses += ["edit-after-flush"] * any(s.edit for s in self.steps)
        wants = sorted({w for p in uses if (w := C.refusal(self.mode, p, self.feature)) is not None})
        return "|".join(f"(?:{w})" for w in wants) or None

    def __repr__(self) -> str:
        head = (f"Loop({self.mode} | {self.optimizer} | {self.dtype} | bpps={self.bpps}"
                + " | scaler" * self.scaler + " | StepLR" * self.scheduler + " | two groups" * self.two_groups
                + (f" | {self.feature}" if self.feature != "none" else "") + f" | {len(self.steps)} steps)")
        return "\n".join([head] + [f"  {t}: {s!r}" for t, s in enumerate(self.steps)])

    _repr_pretty_ = Pass._repr_pretty_


@st.composite
def steps_(draw, bpps: int, scaler: bool, overflows: bool, scheduler: bool) -> Step:
    n = draw(st.integers(1, bpps).map(lambda i: bpps + 1 - i))  # shrinks towards k passes
    passes = tuple(Pass(branch=draw(st.booleans().map(lambda b: not b)),
                        overflow=overflows and draw(st.integers(0, 9)) == 9) for _ in range(n))
    return Step(
        passes=passes,
        # no zero_grad at all: the step accumulates onto the last one's gradients; not under a GradScaler,
        # whose skipped step() leaves inf there and (BSP) more passes than k before the next step(),
        # which osp refuses as Horovod does (README)
        zero=draw(st.sampled_from([True, True, True, False] + [None] * (not scaler))),
        freeze=draw(st.none() | st.tuples(st.sampled_from(FREEZABLE), st.booleans())),
        grad_mul=draw(st.integers(0, 4)) == 4,
        clip=draw(st.integers(0, 3)) == 3,
        sched=scheduler and draw(st.booleans()),
        flush=draw(st.integers(0, 4)) == 4,
        edit=draw(st.none() | st.none() | st.none() | st.sampled_from(EDITABLE)),
        reload=draw(st.integers(0, 6)) == 6,
    )


@st.composite
def loops(draw) -> Loop:
    mode = draw(st.sampled_from(sorted(C.MODES)))
    optimizer = draw(st.sampled_from(sorted(C.OPTIMIZERS)))
    dtype = draw(st.sampled_from(["fp32"] * 6 + ["fp16", "bf16"]))
    bpps = draw(st.integers(1, 3))
    # torch's GradScaler refuses fp16 parameters (unscale_ of fp16 gradients): the fixed tables have that
    scaler = dtype != "fp16" and draw(st.booleans())
    scheduler = draw(st.booleans())
    two_groups = draw(st.booleans())
    n = draw(st.integers(4, 9))
    # DSync(delay=d) hears of an overflow when its average lands, d steps later (docs/works-with.md): the
    # scaler's scale follows torch's d steps late, so the last d steps have none (the run would end first)
    late = C.MODES[mode].late
    # torch's fused optimizers, handed found_inf by the scaler, set up the state of a parameter whose first
    # gradient came in a skipped step (fused SGD: its momentum buffer from torch.empty_like, or a
    # TypeError; fused Adam: state where none should be); osp skips such a step whole. No reference to
    # compare with: no overflows with them (the fixed tables overflow there after every state exists)
    overflows = scaler and "fused" not in optimizer
    steps = tuple(draw(steps_(bpps, scaler, overflows and t < n - late, scheduler)) for t in range(n))
    feature = draw(st.sampled_from(["none"] + [f for f in C.FE.AXIS if f != "none"]))  # shrinks to none
    return Loop(mode, optimizer, dtype, bpps, scaler, scheduler, two_groups, steps, feature)


# -- running it through conformance's oracle ---------------------------------------------------------

@dataclass(frozen=True)
class LoopPattern(C.Pattern):
    loop: Optional[Loop] = None


def _body(loop: Loop):
    def body(env: C.Env, t: int) -> None:
        s = loop.steps[t]
        named = dict(env.model.named_parameters())
        if s.freeze:
            named[s.freeze[0]].requires_grad_(s.freeze[1])
        if s.zero is not None:
            env.zero_grad(set_to_none=s.zero)
        for k, p in enumerate(s.passes):
            env.backward(t, micro=k, branch=p.branch, factor=math.inf if p.overflow else 1.0)
        if s.grad_mul:
            for i, p in enumerate(env.model.parameters()):
                if p.grad is not None:
                    p.grad.mul_(0.5 + 0.1 * i)
        if s.clip:
            if env.scaler is not None:
                env.scaler.unscale_(env.opt)
            env.clip(0.05)
        env.step(t)
        if s.sched:
            env.sched.step()
        if s.flush or s.edit:
            env.flush()
        if s.edit:
            with torch.no_grad():
                named[s.edit].mul_(0.9).clamp_(-0.3, 0.3)
        if s.reload:
            env.reload()
    return body


class LoopEnv(C.Env):
    """conformance's Env, for as many steps as the loop has, with the scheduler stepped by the loop's
    own ``sched`` actions instead of after every step."""

    def __init__(self, case: C.Case, wrapped: bool, steps: int = C.STEPS):
        super().__init__(case, wrapped, steps)
        self.steps = len(self.pattern.loop.steps)

    def step(self, t: int) -> None:
        sched, self.sched = self.sched, None
        try:
            super().step(t)
        finally:
            self.sched = sched


@contextmanager
def _one_rank():
    """A fresh one-rank group per example, so that an example is the same whichever ran before it."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def check(loop: Loop, mp: pytest.MonkeyPatch) -> C.Outcome:
    pattern = LoopPattern(loop.pattern, _body(loop), bpps=loop.bpps, scaler=loop.scaler,
                          groups=C._two_groups if loop.two_groups else C._plain_groups,
                          scheduler=C._step_lr if loop.scheduler else None, loop=loop)
    mp.setattr(C, "Env", LoopEnv)
    mp.setattr(C, "PATTERNS", {**C.PATTERNS, loop.pattern: pattern})
    refused = {k: v for k, v in C.REFUSED.items() if k != (loop.mode, loop.pattern)}
    if loop.refusal() is not None:
        refused[(loop.mode, loop.pattern)] = loop.refusal()
    mp.setattr(C, "REFUSED", refused)
    with _one_rank():
        return C.run_case(C.Case(loop.mode, loop.pattern, loop.optimizer, loop.dtype, "none", loop.feature))


def _seeded(f):
    return seed(SEED)(f) if SEED is not None else f


@_seeded
@settings(max_examples=int(EXAMPLES or "150"), deadline=None, derandomize=not RANDOM, database=None,
          print_blob=True, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(loop=loops())
def test_random_loop_equals_torch_optim(loop):
    note(f"seed: {SEED if SEED is not None else 'derandomized'}")
    with pytest.MonkeyPatch.context() as mp:
        out = check(loop, mp)
    event(f"outcome: {out.kind}")  # pytest --hypothesis-show-statistics: how many were refused, ulp, ...
    assert out.ok, (f"seed={SEED if SEED is not None else 'derandomized'}\n{loop!r}\n"
                    f"{out.kind}: {out.detail}")
