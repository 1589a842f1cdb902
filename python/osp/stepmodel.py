"""The model of a step: how long one step takes at a critical share, and which share to run.

One implementation, used twice: ``OSP(critical="auto")`` feeds it online with what the running job measures
(``osp.policy.Budget``), and ``osp.plan`` feeds it offline with a profile and a cluster's links. Both decide
by ``decide``, so the plan's ``osp-auto`` row predicts the share that ``auto`` will run.

A step is described from its start (the end of the previous ``step()``):

- ``compute``: when its backward ends (forward, backward and whatever the hooks do);
- ``ready[b]``: when bucket ``b``'s gradient is complete and its average is issued (buckets in issue order);
  a mode that starts everything at ``step()`` (OSP composed with HSP: the gradient is complete only after the
  extras) has every bucket ready at ``compute``;
- ``nbytes[b]``: the bucket's gradient bytes;
- ``link(b)``: the seconds an allreduce of ``b`` bytes takes;
- ``work_bsp`` / ``work_osp``: the mode's own ``step()`` work once its averages are in (OSP: packing,
  scoring, the correction of the last step's deferred blocks and the wrapped optimizer).
- ``deferring``: optionally, the same figures as measured while OSP defers (``auto`` measures each side;
  on ranks whose collectives share the host's CPUs with the compute, deferring lengthens the compute and
  lowers the link's achieved rate); OSP's predictions use them.

The formulas (``tests/test_stepmodel.py`` holds them):

- **Link**: one collective at a time, in issue order: each starts at max(its issue, the previous one's end).
- **BSP** (share 1): ``t = max(compute, end of the last bucket) + work_bsp``.
- **OSP(share s)**: each bucket's critical share is issued when it is ready (the bucket ready last keeps only
  ``min_critical`` of its bytes, the others take over the rest of its quota in proportion to their room), behind
  the previous step's stage 2 (the deferred ``1 - s`` of the gradient, issued in the previous ``step()`` before
  its ``work_osp``): ``t = max(compute, end of the last critical bucket) + work_osp``, the link starting the step
  busy for ``link(deferred) - work_osp``.

``decide`` picks, among the shares of ``GRID`` (and the current one), the one with the shortest predicted step;
it leaves the current share only for a predicted gain above ``margin`` (hysteresis: the measurement noise, at
least ``MARGIN``), and among shares predicted within ``TIE`` of the fastest it takes the largest (it defers less:
BSP's code where nothing pays; and a choice that does not flip on rounding).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

#: the critical shares ``auto`` chooses from (one grid step: the next share in it)
GRID = (1.0, 0.5, 0.35, 0.25, 0.15, 0.1, 0.05)
MARGIN = 0.03  # the least predicted gain that moves ``auto`` off its current share
TIE = 0.01  # shares predicted within this of the shortest step tie: the largest of them is chosen


@dataclass
class Step:
    """One step's figures (seconds, bytes); see the module docstring."""
    compute: float
    ready: Sequence[float]
    nbytes: Sequence[float]
    link: Callable[[float], float]
    work_bsp: float = 0.0
    work_osp: float = 0.0
    notes: Dict[str, float] = field(default_factory=dict)  # where the figures came from (reported, not used)
    #: the figures as measured while OSP defers, where they differ (ranks sharing a host's CPUs with the
    #: collectives: stage 2 in flight during the next compute slows both it and the link's achieved rate);
    #: ``None``: as BSP measured them. OSP's predictions take theirs from it.
    deferring: Optional["Step"] = None

    @property
    def total(self) -> float:
        return float(sum(self.nbytes))


def chain(start_free: float, issues: Iterable[Tuple[float, float]], link: Callable[[float], float]) -> float:
    """When the last of ``issues`` (``(bytes, issued at)``, in issue order) ends on a link free from
    ``start_free``: each starts at max(its issue, the previous one's end)."""
    end = start_free
    for nbytes, at in issues:
        if nbytes > 0:
            end = max(end, at) + link(nbytes)
    return end


def quotas(nbytes: Sequence[float], ready: Sequence[float], share: float, min_critical: float = 0.0) -> List[float]:
    """Critical bytes per bucket at ``share``: the bucket ready last keeps ``min_critical`` of its bytes, the
    others take over the rest of its quota in proportion to their room (``osp.split.Split._quotas`` in blocks)."""
    sizes = list(nbytes)
    if not sizes:
        return []
    if share >= 1.0 or len(sizes) == 1:
        return [min(share, 1.0) * s for s in sizes]
    last = max(range(len(sizes)), key=lambda i: (ready[i], i))
    quota = [share * s for s in sizes]
    keep = min(quota[last], max(min_critical, 0.0) * sizes[last])
    spare = quota[last] - keep
    quota[last] = keep
    others = [i for i in range(len(sizes)) if i != last]
    room = sum(sizes[i] - quota[i] for i in others)
    for i in others:
        quota[i] += spare * (sizes[i] - quota[i]) / room if room > 0 else 0.0
    if room < spare:
        quota[last] += spare - room
    return quota


def step_bsp(st: Step) -> float:
    """Every bucket during backward; the step waits for the last."""
    return max(st.compute, chain(0.0, zip(st.nbytes, st.ready), st.link)) + st.work_bsp


def step_osp(st: Step, share: float, min_critical: float = 0.0) -> float:
    """The critical share during backward, behind the previous step's stage 2 on the link."""
    if share >= 1.0:
        return step_bsp(st)
    st = st.deferring or st
    q = quotas(st.nbytes, st.ready, share, min_critical)
    deferred = st.total - sum(q)
    start_free = st.link(deferred) - st.work_osp if deferred > 0 else 0.0
    return max(st.compute, chain(start_free, zip(q, st.ready), st.link)) + st.work_osp


def predict(st: Step, share: float, min_critical: float = 0.0) -> float:
    return step_bsp(st) if share >= 1.0 else step_osp(st, share, min_critical)


def shares(min_critical: float, grid: Sequence[float] = GRID) -> List[float]:
    """The grid's shares ``auto`` may run with this floor (a share below it runs at the floor)."""
    return sorted({max(s, min_critical) if s < 1.0 else 1.0 for s in grid}, reverse=True)


def decide(st: Step, current: float, min_critical: float = 0.0, margin: float = MARGIN,
           grid: Sequence[float] = GRID, vetoed: Sequence[float] = ()) -> Tuple[float, Dict[float, float]]:
    """``(share, predicted step of each share)``: the share with the shortest predicted step (on a tie, within
    ``TIE``, the largest: it defers least), unless it is not at least ``margin`` faster than ``current``'s
    predicted step, then ``current``. ``vetoed`` shares (measured slower than predicted, ``Budget``) are not chosen."""
    options = [s for s in shares(min_critical, grid) if s not in vetoed or s == current]
    if current not in options:
        options.append(current)
    pred = {s: predict(st, s, min_critical) for s in options}
    fastest = min(pred.values())
    best = max(s for s in options if pred[s] <= fastest + TIE * abs(fastest))
    if best != current and pred[best] < (1.0 - margin) * pred[current]:
        return best, pred
    return current, pred
