"""How OSP picks the critical blocks: the budget (a fixed ratio, or "auto" with what it measures), the selection, and
each step's split."""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import torch

from . import ops, stepmodel


def select_critical(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Mask of the ``k`` highest-scoring blocks. Deterministic for the same input, so ranks that hold
    the same (allreduced) scores pick the same set; ties go to the lower block index."""
    n = scores.numel()
    mask = torch.zeros(n, dtype=torch.bool, device=scores.device)
    if k >= n:
        mask.fill_(True)
    elif k > 0:
        # stable descending sort: equal scores keep index order, whatever topk's internals do
        order = torch.sort(scores, descending=True, stable=True).indices
        mask[order[:k]] = True
    return mask


class Meter:
    """What one rank measures of its steps for ``auto`` (and ``stats()``), in the terms of ``osp.stepmodel``: from
    the step's start (the end of the previous ``step()``), when each bucket's average was issued and when backward
    ended; the ``step()``'s own work (its time less its waits for the network); the time from one step's end to
    the next; and the link's achieved rate: the gradient bytes of the collectives that completed over the time
    the link had at least one of them in flight (the union of their intervals, so that stage 2 and the next
    stage 1 sharing the link count once). A collective's end is when its engine completed it (a Gloo future's
    callback); where the engine tells nobody (Horovod, NCCL), when osp found it done: a rate then errs low.

    ``figures()`` is this rank's part of the step's agreement (``FIELDS``, milliseconds and MB/s); the sum lands
    identical on every rank and ``Budget.update`` decides from it, so every rank decides alike."""

    def __init__(self, nbuckets: int):
        self.nbuckets = nbuckets
        self.fields = ("compute_ms", "work_ms", "iteration_ms", "rate_mbps", "rate_n", "started") + tuple(
            f"ready{b}_ms" for b in range(nbuckets))
        self._t_end: Optional[float] = None  # the last step's end: this step's start
        self._iteration = 0.0  # the last step's time from the end of the one before it
        self._ready: List[Optional[float]] = [None] * nbuckets
        self._compute: Optional[float] = None
        self._entry: Optional[float] = None
        self._waited = 0.0
        self._work = 0.0  # the last step's own work
        self._flights: List[tuple] = []  # (handle, gradient bytes) of collectives not yet seen complete
        self._done: List[tuple] = []  # (t0, t1, bytes) of the completed ones of the last two samples
        self._marks: List[int] = []  # how many of ``_done`` each of the last samples added
        self.sample_rate: Optional[float] = None  # bytes/s: overrides every sample while set (tests)

    @staticmethod
    def now() -> float:
        return time.monotonic()  # the clock of Handle.t0 / t1 and osp.linkemu

    def _since_start(self) -> float:
        return 0.0 if self._t_end is None else self.now() - self._t_end

    def issued(self, b: int, handle) -> None:
        """Bucket ``b``'s average was issued (its gradient is ready); ``handle``: None where nothing travels."""
        if self._ready[b] is None:
            self._ready[b] = self._since_start()
        if handle is not None:
            self.track(handle)

    def track(self, handle) -> None:
        """A bulk collective whose time measures the link (not the agreement's small sums)."""
        if handle is not None and handle.t0 is not None:  # an empty one never travels
            res = handle.result
            self._flights.append((handle, res.numel() * res.element_size()))

    def backward_end(self) -> None:
        if self._compute is None:
            self._compute = self._since_start()

    def entry(self) -> None:
        """``step()`` was called: backward ended by now (a mode told of no backward pass: its buckets start here)."""
        self.backward_end()
        self._entry, self._waited = self.now(), 0.0

    def waited(self, seconds: float) -> None:
        """``step()`` waited this long for the network (not its own work)."""
        self._waited += seconds

    def end(self) -> None:
        """``step()`` returns: the step's work and iteration; the next step starts now."""
        t = self.now()
        if self._entry is not None:
            self._work = max(0.0, t - self._entry - self._waited)
        self._iteration = 0.0 if self._t_end is None else t - self._t_end
        self._t_end, self._entry = t, None
        self._ready, self._compute = [None] * self.nbuckets, None

    def restart(self) -> None:
        """This step's backward runs again (``no_sync``-less re-entry): its ready times start over."""
        self._ready, self._compute = [None] * self.nbuckets, None

    def _rate(self) -> float:
        """The link's achieved rate over the collectives completed since the last two samples (bytes/s; 0: none)."""
        keep = []
        added = 0
        for h, nbytes in self._flights:
            if h.t1 is None:
                keep.append((h, nbytes))
            else:  # an emulated link (osp.linkemu) ends it no sooner than its booked end
                self._done.append((h.t0, h.t1 if h.due is None else max(h.t1, h.due), nbytes))
                added += 1
        self._flights = keep
        self._marks.append(added)
        if len(self._marks) > 2:
            self._done = self._done[self._marks.pop(0):]
        if not added:
            return 0.0
        union, end, total = 0.0, -math.inf, 0
        for t0, t1, nbytes in sorted(self._done):
            total += nbytes
            if t1 > end:
                union += t1 - max(t0, end)
                end = t1
        return total / union if union > 0 and total > 0 else 0.0

    def figures(self) -> dict:
        """This rank's part of the step's agreement (see ``FIELDS``): this step's compute and ready times, the
        last step's work and iteration, a rate sample (``rate_n`` 1 where there is one), and whether this step's
        start is known (``started``: not on a rank's first step, whose times count from nothing)."""
        rate = self._rate()
        if self.sample_rate is not None:
            rate = self.sample_rate
        compute = self._compute if self._compute is not None else self._since_start()
        out = {"compute_ms": 1e3 * compute, "work_ms": 1e3 * self._work, "iteration_ms": 1e3 * self._iteration,
               "rate_mbps": rate / 1e6, "rate_n": 1.0 if rate > 0 else 0.0,
               "started": 1.0 if self._t_end is not None else 0.0}
        for b, r in enumerate(self._ready):
            out[f"ready{b}_ms"] = 1e3 * (compute if r is None else min(r, compute))
        return out

    def agreed(self, total) -> dict:
        """Every rank's mean of the figures (``total``: the agreement's sum, an ``Agreed``), in seconds and
        bytes/s; ``started``: every rank knew when this step started, so its compute and ready times are real)."""
        n = total.total("rate_n")
        return {"compute": total.mean("compute_ms") * 1e-3, "work": total.mean("work_ms") * 1e-3,
                "iteration": total.mean("iteration_ms") * 1e-3,
                "rate": total.total("rate_mbps") * 1e6 / n if n > 0 else 0.0,
                "ready": [total.mean(f"ready{b}_ms") * 1e-3 for b in range(self.nbuckets)],
                "started": total.mean("started") >= 1.0}


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


@dataclass
class Plan:
    """The split of one step, known before its backward (from the scores of earlier averaged
    gradients): the critical blocks, how many each bucket has, and where each bucket's blocks go in its
    flat group's packed buffers (which keep block order, as ``split_blocks`` of the whole group would)."""
    mask: torch.Tensor
    counts: List[int]  # per bucket: critical blocks
    crit_at: List[int]  # per bucket: its first critical block's index in the group's packed stage 1
    deferred_at: List[int]  # per bucket: likewise in the packed stage 2
    ncrit: List[int]  # per flat group: critical blocks
    positions: Optional[torch.Tensor] = None  # ops.mask_positions(mask), once per plan (kernels take slices)


class Split:
    """OSP's choice of the critical blocks, step by step: the budget (how many), the block scores of the
    last averaged gradients (which: every rank holds them bitwise alike, so no collective decides),
    and the coming step's ``Plan``, per bucket of ``buckets`` (``Buckets.buckets``: flat group and
    element range). ``size``: the world the budget measures in."""

    def __init__(self, options, groups, buckets, size: int):
        self.options, self.groups, self.size = options, groups, size
        self.budget = self._new_budget()
        self.nblocks = sum(fg.nblocks for fg in groups)
        self.scores: Optional[torch.Tensor] = None
        # the buckets, as block ranges of their flat group (the blocks that start in the bucket's
        # elements: a block reaching into the next bucket up is ready, as that bucket started earlier)
        gindex = {id(fg): gi for gi, fg in enumerate(groups)}
        self.geo = [(gindex[id(fg)], -(-lo // fg.block_size), -(-hi // fg.block_size)) for fg, lo, hi, _ in buckets]
        self.group_lo, lo = [], 0  # each flat group's first block in the score vector
        for fg in groups:
            self.group_lo.append(lo)
            lo += fg.nblocks
        self._plan: Optional[Plan] = None

    def _new_budget(self) -> Budget:
        return Budget(self.options.critical, self.options.min_critical, warmup=self.options.warmup)

    def plan(self) -> Plan:
        """The coming step's plan (made on first use)."""
        if self._plan is None:
            self._plan = self._make_plan()
        return self._plan

    def forget_plan(self) -> None:
        self._plan = None

    def group_mask(self, gi: int) -> torch.Tensor:
        lo = self.group_lo[gi]
        return self.plan().mask[lo:lo + self.groups[gi].nblocks]

    def group_positions(self, gi: int) -> torch.Tensor:
        """``group_mask(gi)``'s positions (a slice of the plan's: the kernels count from its first entry)."""
        lo = self.group_lo[gi]
        return self.plan().positions[lo:lo + self.groups[gi].nblocks]

    def _make_plan(self) -> Plan:
        """The coming step's critical blocks: per bucket the ``budget.count`` best by the scores of the
        last averaged gradients (until there are scores, every block is critical, unless none is to be).
        Each bucket gets its own quota, so every count is known on the host without a device sync. With
        ``critical=0.0`` every step, the first too, defers everything (``DSync(delay=1)``)."""
        counts = self._quotas()
        mask = torch.ones(self.nblocks, dtype=torch.bool, device=self.groups[0].device)
        if self.scores is None:
            if not any(counts):
                mask.fill_(False)
            else:
                counts = [b1 - b0 for _, b0, b1 in self.geo]
        else:
            for (gi, b0, b1), k in zip(self.geo, counts):
                if k < b1 - b0:
                    lo = self.group_lo[gi]
                    mask[lo + b0:lo + b1] = select_critical(self.scores[lo + b0:lo + b1], k)
        crit_at, deferred_at = [0] * len(self.geo), [0] * len(self.geo)
        ncrit = [0] * len(self.groups)
        ndef = [0] * len(self.groups)
        for b in sorted(range(len(self.geo)), key=lambda b: self.geo[b][1:]):  # block order
            gi, b0, b1 = self.geo[b]
            crit_at[b], deferred_at[b] = ncrit[gi], ndef[gi]
            ncrit[gi] += counts[b]
            ndef[gi] += b1 - b0 - counts[b]
        return Plan(mask=mask, counts=counts, crit_at=crit_at, deferred_at=deferred_at, ncrit=ncrit,
                    positions=ops.mask_positions(mask))

    def _quotas(self) -> List[int]:
        """Critical blocks per bucket. The bucket ready last (the first layers, at the very end of
        backward) can only send its critical blocks after backward, where the step waits for them: it
        keeps only the ``min_critical`` floor, and the blocks it gives up go to the buckets ready
        earlier (by size, those ready first first), whose averages run while backward still computes.
        The total is what the budget's share gives every bucket alike."""
        sizes = [b1 - b0 for _, b0, b1 in self.geo]
        counts = [self.budget.count(n) for n in sizes]
        if len(sizes) < 2 or not sum(sizes[:-1]):
            return counts
        last = len(sizes) - 1
        floor = min(counts[last], math.ceil(self.options.min_critical * sizes[last]))
        extra = given = counts[last] - floor
        counts[last] = floor
        earlier = sum(sizes[:last])
        for rounding in (True, False):  # by size, then whatever rounding left over
            for b in range(last):
                if extra <= 0:
                    break
                add = min(sizes[b] - counts[b], extra, -(-given * sizes[b] // earlier) if rounding else extra)
                counts[b] += add
                extra -= add
        counts[last] += extra  # no room ready earlier: it stays with the last bucket
        return counts

    def score(self, buf: torch.Tensor, fg, mask: torch.Tensor, lo: int) -> None:
        """Score the blocks packed in ``buf`` (those where ``mask`` is set) and store them in their
        places of the score vector (from block ``lo``; a merge with one-element blocks: no device sync).
        With ``relative``, |w| is read from the parameters as they are now, which must be bitwise equal
        on every rank: call only where the replicas are."""
        if self.scores is None:
            self.scores = torch.zeros(self.nblocks, dtype=torch.float32, device=mask.device)
        w = None
        if self.options.metric == "relative":
            w = torch.empty_like(buf)
            ops.split_blocks(fg.param, mask, fg.block_size, w, None)
        scores = ops.score_blocks(buf, fg.block_size, self.options.metric, param=w)[0]
        ops.merge_blocks(scores, None, mask, 1, self.scores[lo:lo + fg.nblocks])

    def state_dict(self) -> dict:
        # the next split is chosen from the scores: needed to resume bitwise; the budget's figures hold
        # for the world size they were measured in
        return {"budget": self.budget.state_dict(), "size": self.size,
                "scores": None if self.scores is None else self.scores.detach().cpu().clone()}

    def load_state_dict(self, state: dict, device) -> None:
        if state.get("size", self.size) == self.size:
            self.budget.load_state_dict(state["budget"])
        else:  # measured in a world of another size: measure again
            self.budget = self._new_budget()
        scores = state.get("scores")
        if scores is not None and scores.numel() != self.nblocks:
            raise ValueError(f"osp: the checkpoint's scores cover {scores.numel()} blocks, this "
                             f"optimizer has {self.nblocks} (another model or block_size?)")
        self.scores = None if scores is None else scores.to(device)
        self._plan = None
