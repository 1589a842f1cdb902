"""How many blocks OSP sends in stage 1: the budget, a fixed ratio or ``"auto"``, which decides online by the step
model (``osp.stepmodel``) from what ``osp.meter.Meter`` measured. Which blocks, and each step's split:
``osp.split``."""
from __future__ import annotations

import math
import statistics
from typing import Dict, List, Optional, Sequence

from . import stepmodel


class Budget:
    """The number of critical blocks per step, fixed or ``"auto"``.

    Fixed: ``ceil(critical * nblocks)`` per bucket, at least ``min_critical * nblocks``.

    ``auto`` runs BSP's code for ``warmup`` steps while ``Meter`` measures, then decides every step by
    ``osp.stepmodel.decide`` (the model ``osp.plan`` predicts with) fed with the medians of the last ``WINDOW``
    steps' agreed figures of each side, BSP's and the deferring shares' (compute, ready times, the link's rate,
    own work: ``Step.deferring`` holds the deferring side's; a side not yet measured takes the other's), once
    the share it runs has ``MEASURED`` counted steps:

    - **hysteresis**: it leaves its share only for a predicted gain above the noise: the measured steps' (twice
      their spread over the square root of their count), and the model's own error at the share it runs (its
      predicted step against the measured one), at least ``stepmodel.MARGIN``;
    - **checked**: a new share runs ``VERIFY`` counted steps (a share's first step after a change is not
      counted: it waits for no stage 2 of its own, or for the last one's flush); where its median iteration is
      no shorter than the share it left, it goes back, and every share on that side of the old one is vetoed
      (the model was wrong there: one trial, not one a share). Every verdict is logged with the two medians it
      compared (``decisions[i]["trial"]``: kind "kept" where the new share stays, the "back: ..." change where not);
    - **following**: when the link's rate or the compute moves by more than ``SHIFT`` against the figures the
      running share had when it was last measured (once its window holds only its steps: on ranks that share a
      host's CPUs a share changes both), the measured iterations, the vetoes and the other side's rate are
      forgotten, and the model decides from the new figures; deferring, where the link became faster against
      the compute, BSP is measured again as a checked trial (``_follow``).

    With ``warmup=2`` the first decision comes by the fourth step (two counted BSP steps: a step's iteration
    arrives with the next, and the first step's is not counted).
    Settled on 1.0 the steps are BSP's own code (``needs_scores`` False) and keep measuring. Every rank
    decides alike from the agreed figures. ``decisions`` keeps the last ``KEEP`` changes, with what the
    model predicted for every share and what was measured.
    """

    WINDOW = 5  # steps whose medians the model is fed
    VERIFY = 3  # counted steps a new share runs before it is compared with the old
    MEASURED = 2  # counted steps of the current share before the model may move it
    SHIFT = 0.25  # a move of the rate or compute by more than this forgets the iterations and vetoes
    KEEP = 20
    PRIOR = 1.5  # OSP's step work over BSP's until measured (packing, scoring and the correction, which redoes
    # the update of the deferred blocks); a share it misjudges is caught by the check

    def __init__(self, critical, min_critical: float, warmup: int = 2):
        self.critical, self.min_critical, self.warmup = critical, min_critical, warmup
        self.steps = 0
        self.phase = "warmup" if critical == "auto" else "fixed"
        self.fraction = 1.0 if critical == "auto" else float(critical)
        self._reset_figures()
        self.decisions: List[dict] = []

    def _reset_figures(self) -> None:
        # by side, deferring (True) or not: on ranks whose collectives share the host's CPUs with the compute,
        # deferring changes the compute and the link's achieved rate as well as the step's work, so each side
        # is predicted from its own last WINDOW steps (from the other side's until it has any)
        self._figs: Dict[bool, List[dict]] = {True: [], False: []}  # the agreed figures
        self._rates: Dict[bool, List[float]] = {True: [], False: []}
        self._work: Dict[bool, List[float]] = {True: [], False: []}
        self._iters: Dict[float, List[float]] = {}  # share -> its counted iterations (since the last shift)
        self._vetoed: Dict[float, str] = {}
        self._ran: Optional[tuple] = None  # (share, counted) of the step before this one
        self._first = True  # the next step is the first at its share
        # share -> (rate, compute) its own window measured (kept across changes: a link that moved during a
        # trial is seen when the share it left is measured again)
        self._ref: Dict[float, tuple] = {}
        self._held = 0  # steps run at this share
        self._trial: Optional[tuple] = None  # (old share, new share) while the new one is checked

    def count(self, nblocks: int) -> int:
        frac = self.fraction
        if frac < 1.0:
            frac = max(frac, self.min_critical)
        return min(nblocks, max(math.ceil(frac * nblocks), math.ceil(self.min_critical * nblocks)))

    @property
    def needs_scores(self) -> bool:
        """Whether block scores can matter (not while every block is critical: BSP's own code runs then)."""
        return self.fraction < 1.0

    @staticmethod
    def _med(xs):
        return statistics.median(xs) if xs else 0.0

    def update(self, fig: dict, nbytes: Sequence[float]) -> None:
        """Feed one step's agreed figures (``Meter.agreed``: identical on every rank); ``nbytes``: each bucket's
        gradient bytes."""
        self.steps += 1
        if self.critical != "auto":
            return
        if self._ran is not None:  # the last step's iteration and work arrive with this one
            share, counted = self._ran
            if counted and fig["iteration"] > 0:
                self._iters.setdefault(share, []).append(fig["iteration"])
                self._iters[share] = self._iters[share][-2 * self.WINDOW:]
            if fig["work"] > 0:
                w = self._work[share < 1.0]
                w.append(fig["work"])
                del w[:-self.WINDOW]
        self._ran = (self.fraction, not self._first)
        self._first = False
        self._held += 1
        side = self.fraction < 1.0
        if fig.get("started", True):
            self._figs[side] = (self._figs[side] + [fig])[-self.WINDOW:]
        if fig["rate"] > 0:
            self._rates[side] = (self._rates[side] + [fig["rate"]])[-self.WINDOW:]
        if self.phase == "warmup":
            if self.steps < self.warmup or not self._rates[side]:
                return
            self.phase = "auto"
        st = self.model(nbytes)
        if st is None:
            return
        # the figures are this share's own: a move now is the link's or the compute's, not this share's
        if self._trial is None and self._held > self.WINDOW and self._follow(st):
            st = self.model(nbytes)  # without what was forgotten
        if self._trial is not None:
            self._check_trial(st)
            return
        cur = self._iters.get(self.fraction, [])
        if len(cur) < self.MEASURED:  # the share it would leave is measured first: the check compares with it
            return
        # the margin: the noise of the measured steps, and how far the model is off at the share it runs
        noise = self.noise(cur)
        error = abs(stepmodel.predict(st, self.fraction, self.min_critical) / statistics.median(cur) - 1)
        margin = max(stepmodel.MARGIN, noise, error)
        choice, pred = stepmodel.decide(st, self.fraction, self.min_critical, margin, vetoed=tuple(self._vetoed))
        if choice != self.fraction:
            self._change(choice, st, pred, f"predicted {1e3 * pred[choice]:.1f} ms a step against "
                         f"{1e3 * pred[self.fraction]:.1f} ms at {self.fraction:g} (measured "
                         f"{1e3 * statistics.median(cur):.1f}), a gain above the margin {margin:.1%} (noise "
                         f"{noise:.1%}, model error {error:.1%})")
            self._trial = (self._ran[0], choice)

    def noise(self, iters: Sequence[float]) -> float:
        """The relative noise of the median of ``iters``: 2 x 1.4826 x MAD / median / sqrt(n) (0 under 3)."""
        if len(iters) < 3:
            return 0.0
        m = statistics.median(iters)
        mad = statistics.median(abs(x - m) for x in iters)
        return 2 * 1.4826 * mad / m / math.sqrt(len(iters)) if m > 0 else 0.0

    def _measured(self, deferring: bool) -> Optional[tuple]:
        """``(rate, compute, ready)``: the medians of one side's last ``WINDOW`` steps (each figure from the
        other side's until this side has its own; None before a rate is known)."""
        figs = self._figs[deferring] or self._figs[not deferring]
        rate = self._med(self._rates[deferring] or self._rates[not deferring])
        if rate <= 0 or not figs:
            return None
        nb = len(figs[-1]["ready"])
        return (rate, self._med([f["compute"] for f in figs]),
                [self._med([f["ready"][b] for f in figs]) for b in range(nb)])

    def model(self, nbytes: Sequence[float]) -> Optional[stepmodel.Step]:
        """The step as the last ``WINDOW`` steps of each side measured it (None before a rate is known)."""
        bsp_side, osp_side = self._measured(False), self._measured(True)
        if bsp_side is None or osp_side is None:
            return None
        work = {k: self._med(v) for k, v in self._work.items() if v}
        bsp = work.get(False, work.get(True, 0.0) / self.PRIOR)
        osp = work.get(True, self.PRIOR * bsp)  # until measured
        here = osp_side if self.fraction < 1.0 else bsp_side

        def step(figs, **extra):
            rate, compute, ready = figs
            return stepmodel.Step(compute=compute, ready=ready, nbytes=list(nbytes), link=lambda b: b / rate,
                                  work_bsp=bsp, work_osp=osp, **extra)

        notes = {"rate": here[0], "compute": here[1], "rate_bsp": bsp_side[0], "rate_osp": osp_side[0],
                 "compute_osp": osp_side[1]}
        return step(bsp_side, notes=notes, deferring=step(osp_side))

    def _follow(self, st: stepmodel.Step) -> bool:
        """Forget what was measured under another link or compute (this share's own figures moved by more than
        ``SHIFT`` since it was last measured): the iterations and vetoes, and the other side's rate (its compute
        and work are the host's). Deferring, where the link became faster against the compute (BSP's standing
        can only have improved), BSP is measured again: the model cannot see BSP's figures from OSP's."""
        now = (st.notes["rate"], st.notes["compute"])
        ref = self._ref.setdefault(self.fraction, now)
        ratio = [max(a, 1e-12) / max(b, 1e-12) for a, b in zip(now, ref)]  # (rate, compute), now over then
        moved = max(abs(math.log(r)) for r in ratio)
        if moved <= math.log1p(self.SHIFT):
            return False
        side, share = self.fraction < 1.0, self.fraction
        self._iters = {share: self._iters.get(share, [])[-self.VERIFY:]}  # the last steps: already under it
        self._vetoed, self._trial, self._ref = {}, None, {share: now}
        self._rates[not side] = []
        why = (f"rate {now[0] / 1e6:.0f} MB/s (was {ref[0] / 1e6:.0f}), compute {1e3 * now[1]:.1f} ms (was "
               f"{1e3 * ref[1]:.1f}) at {share:g}: what was measured under the old link or compute is forgotten")
        self._log("shift", share, st, None, why)
        if side and ratio[0] > ratio[1]:
            self._change(1.0, st, None, "measure BSP again: the link became faster against the compute")
            self._trial = (share, 1.0)
        return True

    def _check_trial(self, st: stepmodel.Step) -> None:
        old, new = self._trial
        mine, theirs = self._iters.get(new, []), self._iters.get(old, [])
        if len(mine) < self.VERIFY:
            return
        self._trial = None
        if not theirs:  # the share it left was never measured (the first decision came first): nothing to
            return  # compare with; the model's choice stands
        a, b = statistics.median(mine[-self.VERIFY:]), statistics.median(theirs[-self.VERIFY:])
        why = f"measured {1e3 * a:.1f} ms a step against {1e3 * b:.1f} ms at {old:g}"
        trial = {"old": old, "new": new, "new_s": a, "old_s": b, "kept": a < b}
        if trial["kept"]:
            self._log("kept", new, st, None, f"kept: {new:g} {why}", trial)
            return
        # no faster than the share it left: back, and the model is not trusted there nor beyond
        for s in stepmodel.shares(self.min_critical):  # every share on that side of the old one
            if s < old if new < old else s > old:
                self._vetoed[s] = why
        self._change(old, st, None, f"back: {new:g} {why}", trial)

    def _change(self, share: float, st, pred, why: str, trial: Optional[dict] = None) -> None:
        self._log("change", share, st, pred, why, trial)
        self.fraction, self._first, self._held = share, True, 0

    def _log(self, kind, share, st, pred, why, trial: Optional[dict] = None) -> None:
        """One entry of ``decisions``: ``kind`` "change" (the share moves: a decision, a trial's return, a shift's
        new measurement of BSP), "kept" (a trial's share stays) or "shift"; a trial's verdict ("back: ..." or
        "kept: ...") carries ``trial``: the two medians it compared and whether the new share stayed."""
        iters = {s: self._med(v) for s, v in self._iters.items()}
        self.decisions.append({"step": self.steps, "kind": kind, "from": self.fraction, "to": share, "why": why,
                               "trial": trial,
                               "rate_Bps": st.notes["rate"], "compute_s": st.notes["compute"],
                               "rate_bsp_Bps": st.notes["rate_bsp"], "rate_osp_Bps": st.notes["rate_osp"],
                               "compute_bsp_s": st.compute, "compute_osp_s": st.notes["compute_osp"],
                               "work_bsp_s": st.work_bsp, "work_osp_s": st.work_osp,
                               "predicted_s": None if pred is None else {f"{k:g}": v for k, v in pred.items()},
                               "measured_s": {f"{k:g}": v for k, v in iters.items()}})
        del self.decisions[:-self.KEEP]

    def stats(self) -> dict:
        """The state, and what the decisions rest on now (``stats()["budget"]``)."""
        return {**self.state_dict(), "measured_s": {f"{k:g}": self._med(v) for k, v in self._iters.items()},
                "vetoed": {f"{k:g}": v for k, v in self._vetoed.items()},
                "rate_Bps": self._med(self._rates[self.fraction < 1.0])}

    def state_dict(self):
        return {"version": 2, "steps": self.steps, "fraction": self.fraction, "phase": self.phase,
                "decisions": [dict(d) for d in self.decisions]}

    def load_state_dict(self, d):
        if d.get("version") != 2:  # saved by an osp whose auto decided otherwise: measure again
            return
        self.steps, self.fraction, self.phase = d["steps"], d["fraction"], d["phase"]
        self.decisions = [dict(x) for x in d.get("decisions", [])]
        # the measurements are this run's: a resumed run measures again, from the share it had
        self._reset_figures()
        self._first = True
