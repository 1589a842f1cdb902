"""Predict each mode's speed on a cluster from a profile of the model (``osp.profile``).

    python -m osp.plan profile.json --ranks 64 --link 100gbit [--latency 5] [--nodes 8 --intra 400gbit]
                       [--straggler 1.5] [--host 1.3gbit] [--efficiency 0.956] [--max-noise 0.5] [--json]

Rates are bits per second spelled with ``bit`` as tc writes them (``1gbit``, ``400mbit``, ``25Gbit/s``; a bare
number is bits per second); ``...bps``, ``b/s`` and ``B/s`` are refused (``parse_bandwidth``): tc reads ``1gbps``
as a gigaBYTE per second, network specifications as a gigabit.

The model, stated so it can be checked (``tests/test_plan.py`` holds it to these formulas):

- **Allreduce** of ``b`` bytes over ``N`` ranks, ring: ``2(N-1)/N * 8b / link + 2(N-1) * latency``. With
  ``--nodes M`` (``G = N/M`` ranks a node), hierarchical: a ring inside each node over ``--intra``
  (``2(G-1)/G * 8b / intra + 2(G-1) * latency``) plus a ring across the nodes over the node's link, which the
  node's ``G`` ranks share (``2(M-1)/M * 8b / link + 2(M-1) * latency``).
- **The link's payload**: ``--efficiency`` (default 1) of a link's rate carries the gradient, the rest is
  headers and framing: ``1448/1514`` (0.956) for TCP over Ethernet at MTU 1500 as tc counts a frame.
- **The host** (``--host BANDWIDTH``, for ranks that share one machine's CPUs, as ``bench/``'s emulated cluster
  does; leave it out for GPUs with NCCL): the rate the ranks' own CPUs move an allreduce at when no link limits
  it (the unshaped allreduce alone, measured). A link is then never faster than the host
  (``--link none``: the host alone), and the collective's CPU work is taken from compute: every mode that
  communicates while it computes (BSP, OSP, DSync) computes ``T_host(all bytes)`` longer a step.
- **Compute**: the profile's forward ``F`` and backward ``B``, the median over its modes (one rank's hooks cost
  less than the noise between the profile's runs of the modes), times
  ``--straggler`` (the slowest rank's factor: every synchronous mode waits for it), then the mode's own
  ``step()`` time ``S`` as the profile measured it with one rank (packing, scoring, correction, the wrapped
  optimizer).
- **One link, collectives in issue order**: a bucket's average is issued when backward makes it ready
  and starts once the link is free. The profile measured the ready times inside BSP's backward; they are placed
  at the same fraction of ``B`` (``ready * B / B_bsp``).
- **BSP** (DDP alike): the buckets during backward; the step waits for the last, then ``S``:
  ``t = max(F + B, end of the last bucket) + S``.
- **OSP(share s)**: the critical share of each bucket during backward (the bucket ready last keeps only
  ``min_critical``; the others take over the rest of its quota), behind the previous step's stage 2 (the
  deferred ``1 - s`` of the gradient, issued at the previous ``step()``) on the link:
  ``t = max(F + B, end of the last critical bucket) + S``, the link starting the step busy for
  ``T(deferred) - S``. These two formulas are ``osp.stepmodel``'s, the model ``OSP(critical="auto")`` decides by
  online. ``auto``: the share ``osp.stepmodel.decide`` picks from BSP by this model's times, as ``auto`` does from
  its measurements (the shares of ``stepmodel.GRID``; a smaller share only if predicted at least 3% faster).
- **DSync(k)**, ``k >= 1``: the averages start during backward and are needed ``k`` steps later, so in steady
  state ``t = max(F + B + S, T(all buckets))``.
- **HSP**: one sum of the whole gradient at ``step()`` after a tiny "ready" round (no overlap with backward):
  ``t = F + B + 2(N-1) * latency + T(all) + S``; with a straggler ``x`` the fast ranks compute
  ``min(x, 1 + max_extra)`` micro-batches a step instead of waiting, so a step carries
  ``(N-1) * min(x, 1 + max_extra) + 1`` micro-batches (``x = 1``: ``N``).
- **Bound**: the perfect-overlap step ``max(x * (F + B) + S_plain, T(all))`` (``S_plain``: the wrapped
  optimizer alone); a mode's ``bound_share`` is its samples/s over the bound's, where the bound with a straggler
  carries HSP's micro-batches (``bench/train_throughput.py``'s ceiling).

Not in the model: congestion beyond the slowest link, jitter (DSync's reason for a delay > 1), the host's CPU
work of a collective that runs after compute (HSP's) slowing anything but the collective itself.

The profile is checked first (``check_profile``: positive times, every bucket ready inside BSP's backward, a noise
of at most ``--max-noise``). The recommendation (``recommend``, ``choose``) ranks by **synchronized steps/s**:
every mode but HSP carries the same samples a step, and HSP's extra micro-batches make a step's gradient less
noisy, not the steps more (what that is worth depends on the task: docs/plan.md), so they count for nothing here
and HSP's samples/s is shown beside. HSP is a candidate only with a straggler (``--straggler``: the profile is one
rank's). Among the modes that **tie** with the fastest (within ``MIN_GAIN``, 5%, or within the profile's noise:
the fastest's step predicted from the profile with every time ``1 + noise`` times as long is no shorter than the
other's with every time ``1 - noise`` times as long), the simplest wins: BSP, OSP(auto), OSP at a larger share,
DSync at a shorter delay, HSP.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from typing import Dict, List, Optional, Sequence

from . import stepmodel
from .units import parse_bandwidth, parse_latency  # noqa: F401  (osp.plan.parse_bandwidth: its API)

AUTO_MIN_CRITICAL = 0.05  # osp.OSP(critical="auto")'s default floor (docs/design.md, The budget)
# TCP over Ethernet at MTU 1500: 1448 bytes of payload (1500 less IPv4's 20 and TCP's 32 with timestamps) in a
# 1514-byte frame, which is what tc's rate limits count on a veth (the bench's emulated links)
TCP_ETHERNET_1500 = 1448 / 1514
NOISY = 0.10     # a profile's noise above this: the host was busy (osp.profile warns, the plan says so)
EXTREME = 0.50   # a profile noisier than this is refused: nothing in it can be ranked
MIN_GAIN = 0.05  # the least predicted gain worth leaving a simpler mode for
MODE_NAMES = ("plain", "bsp", "osp", "dsync", "hsp")

class Cluster:
    """Ranks, links and latency (seconds) the plan predicts for."""

    def __init__(self, ranks: int, link: Optional[float], latency: float = 0.0, nodes: Optional[int] = None,
                 intra: Optional[float] = None, straggler: float = 1.0, host: Optional[float] = None,
                 efficiency: float = 1.0):
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"osp.plan: ranks must be an integer >= 1, got {ranks!r}")
        if host is not None and not host > 0:
            raise ValueError(f"osp.plan: the host's rate must be positive, got {host!r}")
        if not 0.0 < efficiency <= 1.0:
            raise ValueError(f"osp.plan: the link's efficiency is the share of its rate that carries payload, in "
                             f"(0, 1], got {efficiency!r}")
        if link is None:  # unshaped: the host is the link (a measured payload rate: no framing to take off)
            if host is None:
                raise ValueError("osp.plan: --link none (no link limit) needs the host's rate (--host)")
            link = host
        else:  # the payload's rate: headers and framing ride on the link's rate too
            link = link * efficiency
            intra = None if intra is None else intra * efficiency
        if not link > 0 or latency < 0 or not straggler >= 1.0:
            raise ValueError(f"osp.plan: expected link > 0, latency >= 0 and straggler >= 1, got link={link!r}, "
                             f"latency={latency!r}, straggler={straggler!r}")
        if nodes is not None and (nodes < 1 or ranks % nodes or intra is None or not intra > 0):
            raise ValueError(f"osp.plan: nodes must divide ranks ({ranks}) and need an intra-node bandwidth, got "
                             f"nodes={nodes!r}, intra={intra!r}")
        self.ranks, self.link, self.latency, self.straggler = ranks, link, latency, float(straggler)
        self.nodes, self.intra, self.host = nodes, intra, host

    def _ring(self, n: int, rate: float, nbytes: float) -> float:
        if self.host is not None:
            rate = min(rate, self.host)
        return 0.0 if n <= 1 else 2 * (n - 1) / n * 8 * nbytes / rate + 2 * (n - 1) * self.latency

    def allreduce_s(self, nbytes: float) -> float:
        """Seconds an allreduce of ``nbytes`` takes (ring; hierarchical with nodes; never faster than the host)."""
        if self.nodes is None:
            return self._ring(self.ranks, self.link, nbytes)
        per_node = self.ranks // self.nodes
        return self._ring(per_node, self.intra, nbytes) + self._ring(self.nodes, self.link, nbytes)

    def host_cpu_s(self, nbytes: float) -> float:
        """Compute time a step loses to the collective's CPU work on a shared host (0 without ``host``)."""
        if self.host is None or self.ranks <= 1:
            return 0.0
        return 2 * (self.ranks - 1) / self.ranks * 8 * nbytes / self.host


def _mode(profile: dict, name: str) -> dict:
    modes = profile.get("modes", {}) if isinstance(profile, dict) else {}
    if not isinstance(modes, dict) or name not in modes:
        raise ValueError(f"osp.plan: the profile has no timings for {name!r} (it has "
                         f"{sorted(modes) if isinstance(modes, dict) else modes!r}); take it again with osp.profile")
    return modes[name]


def _seconds(value, where: str, positive: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not (value > 0 if positive else value >= 0):
        raise ValueError(f"osp.plan: the profile's {where} must be a {'positive' if positive else 'non-negative'} "
                         f"number of seconds, got {value!r}; take it again with osp.profile")
    return float(value)


def check_profile(profile: dict, max_noise: float = EXTREME) -> Optional[float]:
    """Refuse a profile no measurement could give (``ValueError`` naming the field and the numbers): times that
    are not positive, no buckets, a bucket ready after BSP's backward has ended (every gradient lands before its
    backward returns, so each iteration's ready times are inside its backward, and so are their medians), the
    first gradient after the last, or a noise above ``max_noise``. Returns the profile's noise (``None``: a profile
    without one, from before osp.profile measured it)."""
    for name in MODE_NAMES:
        m = _mode(profile, name)
        if not isinstance(m, dict):
            raise ValueError(f"osp.plan: the profile's modes.{name} must be a dict of times, got {m!r}")
        for key in ("forward_s", "backward_s"):
            _seconds(m.get(key), f"modes.{name}.{key}")
        _seconds(m.get("step_s"), f"modes.{name}.step_s", positive=False)
    buckets = profile.get("buckets")
    if not isinstance(buckets, list) or not buckets:
        raise ValueError(f"osp.plan: the profile needs its gradient's buckets (a list of {{bytes, ready_s}}), got "
                         f"{buckets!r}")
    backward = profile["modes"]["bsp"]["backward_s"]
    for k, b in enumerate(buckets):
        nbytes = b.get("bytes") if isinstance(b, dict) else None
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not 0 < nbytes < math.inf:
            raise ValueError(f"osp.plan: the profile's bucket {k} must have a positive number of bytes, got {b!r}")
        ready = _seconds(b.get("ready_s"), f"buckets[{k}].ready_s", positive=False)
        if ready > backward * (1 + 1e-9):
            raise ValueError(f"osp.plan: the profile's bucket {k} ({nbytes / 1e6:.2f} MB) is ready "
                             f"{1e3 * ready:.3g} ms into backward, after BSP's backward ended "
                             f"(modes.bsp.backward_s, {1e3 * backward:.3g} ms): no measurement gives that (every "
                             f"gradient lands before backward returns); take the profile again with osp.profile")
    if "first_ready_s" in profile:
        first, last = _seconds(profile["first_ready_s"], "first_ready_s", positive=False), \
            max(b["ready_s"] for b in buckets)
        if first > last * (1 + 1e-9):
            raise ValueError(f"osp.plan: the profile's first gradient lands {1e3 * first:.3g} ms into backward, "
                             f"after the last bucket is ready ({1e3 * last:.3g} ms); take it again with osp.profile")
    batch = profile.get("batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise ValueError(f"osp.plan: the profile's batch must be a positive integer, got {batch!r}")
    noise = profile.get("noise")
    if noise is None:
        return None
    if isinstance(noise, bool) or not isinstance(noise, (int, float)) or not 0 <= noise < math.inf:
        raise ValueError(f"osp.plan: the profile's noise must be a non-negative number, got {noise!r}")
    if noise > max_noise:
        raise ValueError(f"osp.plan: the profile is too noisy to plan from: its iterations "
                         f"({profile.get('noisiest', 'a mode')}'s) varied by {noise:.0%}, more than {max_noise:.0%}: "
                         "every mode would tie with every other. Take it again on a quiet host (or with --threads "
                         "below the free cores)")
    return float(noise)


def _backward(profile: dict) -> float:
    """Backward as the plan computes it: the median over the profile's modes."""
    return statistics.median(m["backward_s"] for m in profile["modes"].values())


def _compute(profile: dict, mode: str, cluster: Cluster):
    """Forward, backward and step of ``mode`` on the slowest rank. Forward and backward are the median over the
    profile's modes (one rank's hooks cost less than the profile's noise between its runs of the modes: up to 12%
    here), the step is the mode's own. A mode that communicates while it computes loses the collective's CPU
    work on a shared host (``Cluster.host_cpu_s``), counted into backward."""
    S = _mode(profile, mode)["step_s"]
    x = cluster.straggler
    F = statistics.median(m["forward_s"] for m in profile["modes"].values())
    steal = 0.0 if mode in ("plain", "hsp") else cluster.host_cpu_s(sum(b["bytes"] for b in profile["buckets"]))
    return x * F, x * _backward(profile) + steal, S


def _ready_scale(profile: dict) -> float:
    """The ready times are moments inside BSP's backward as the profile measured it; the plan computes the
    median backward over the modes, so they are placed at the same fraction of that one."""
    bsp = profile["modes"]["bsp"]["backward_s"]
    return _backward(profile) / bsp if bsp > 0 else 1.0


def _ready(profile: dict, cluster: Cluster) -> List[float]:
    """Each bucket's ready time from the start of backward, on the slowest rank."""
    scale = cluster.straggler * _ready_scale(profile)
    return [scale * b["ready_s"] for b in profile["buckets"]]


def model_step(profile: dict, cluster: Cluster) -> stepmodel.Step:
    """The profile on ``cluster`` as ``osp.stepmodel`` describes a step (the slowest rank's): compute ``F + B``,
    each bucket ready at ``F`` plus its ready time, the link ``cluster.allreduce_s``, BSP's and OSP's own step."""
    F, B, S_bsp = _compute(profile, "bsp", cluster)
    return stepmodel.Step(compute=F + B, ready=[F + r for r in _ready(profile, cluster)],
                          nbytes=[b["bytes"] for b in profile["buckets"]], link=cluster.allreduce_s,
                          work_bsp=S_bsp, work_osp=_mode(profile, "osp")["step_s"])


def step_bsp(profile: dict, cluster: Cluster) -> float:
    return stepmodel.step_bsp(model_step(profile, cluster))


def osp_quotas(profile: dict, share: float, min_critical: float = 0.0) -> List[float]:
    """Critical bytes per bucket at ``share`` (``osp.stepmodel.quotas``)."""
    return stepmodel.quotas([b["bytes"] for b in profile["buckets"]], [b["ready_s"] for b in profile["buckets"]],
                            share, min_critical)


def step_osp(profile: dict, cluster: Cluster, share: float, min_critical: float = 0.0) -> float:
    return stepmodel.step_osp(model_step(profile, cluster), share, min_critical)


def auto_share(profile: dict, cluster: Cluster) -> float:
    """The share ``critical="auto"`` runs: ``osp.stepmodel.decide`` from BSP (where ``auto`` starts), by this
    model's step times, as ``auto`` decides by the same model fed with its measurements."""
    return stepmodel.decide(model_step(profile, cluster), 1.0, AUTO_MIN_CRITICAL)[0]


def step_dsync(profile: dict, cluster: Cluster, delay: int) -> float:
    if delay < 1:
        raise ValueError(f"osp.plan: DSync's delay must be >= 1, got {delay!r}")
    F, B, S = _compute(profile, "dsync", cluster)
    return max(F + B + S, sum(cluster.allreduce_s(b["bytes"]) for b in profile["buckets"] if b["bytes"] > 0))


def step_hsp(profile: dict, cluster: Cluster) -> float:
    F, B, S = _compute(profile, "hsp", cluster)
    total = sum(b["bytes"] for b in profile["buckets"])
    ready = 2 * (cluster.ranks - 1) * cluster.latency if cluster.ranks > 1 else 0.0
    return F + B + ready + cluster.allreduce_s(total) + S


def _scaled(profile: dict, factor: float) -> dict:
    """The profile with every time in it ``factor`` times as long (forward, backward, step, ready times)."""
    out = dict(profile)
    out["modes"] = {name: {**m, **{k: factor * m[k] for k in ("forward_s", "backward_s", "step_s")}}
                    for name, m in profile["modes"].items()}
    out["buckets"] = [{**b, "ready_s": factor * b["ready_s"]} for b in profile["buckets"]]
    if "first_ready_s" in profile:
        out["first_ready_s"] = factor * profile["first_ready_s"]
    return out


def _rows(profile: dict, cluster: Cluster, shares, delays, max_extra: int) -> List[Dict]:
    batch = profile.get("batch") or 1
    x, n = cluster.straggler, cluster.ranks
    total = sum(b["bytes"] for b in profile["buckets"])
    F, B, S = _compute(profile, "plain", cluster)  # the straggler's factor included
    bound_s = max(F + B + S, cluster.allreduce_s(total))
    hsp_micro = (n - 1) * min(x, 1 + max_extra) + 1
    bound_sps = hsp_micro * batch / bound_s  # the ceiling: with x = 1, n micro-batches in the bound's step

    rows = []

    def row(mode, step_s, micro=n, **extra):
        sps = micro * batch / step_s
        rows.append({"mode": mode, "steps_per_s": 1.0 / step_s, "samples_per_s": sps, "micro_batches": micro,
                     "step_s": step_s, "bound_share": sps / bound_sps, **extra})

    row("bsp", step_bsp(profile, cluster))
    share = auto_share(profile, cluster)
    row("osp-auto", step_osp(profile, cluster, share, AUTO_MIN_CRITICAL), critical=share)
    for s in shares:
        row(f"osp-{s:g}", step_osp(profile, cluster, s))
    for d in delays:
        row(f"dsync-{d}", step_dsync(profile, cluster, d))
    row("hsp", step_hsp(profile, cluster), micro=hsp_micro)
    return rows


def plan(profile: dict, cluster: Cluster, shares: Sequence[float] = (0.1, 0.25, 0.5), delays: Sequence[int] = (1, 2, 4),
         max_extra: int = 4, max_noise: float = EXTREME) -> List[Dict]:
    """One dict per mode: ``mode``, ``steps_per_s`` (synchronized steps: what ``recommend`` ranks by),
    ``samples_per_s``, ``micro_batches`` (a step's, over all ranks), ``bound_share``, ``step_s``, ``noise`` (the
    profile's), ``step_s_range`` (the step predicted from the profile with every time ``1 - noise`` and
    ``1 + noise`` times as long; a noise of 1 or more, from a profile measured on a busy machine, floors
    the low end at 0) and, for ``osp-auto``, ``critical``; in the order bsp, osp-auto,
    osp-<share>..., dsync-<delay>..., hsp. The profile is checked first (``check_profile``)."""
    noise = check_profile(profile, max_noise)
    rows = _rows(profile, cluster, shares, delays, max_extra)
    ends = [_rows(_scaled(profile, f), cluster, shares, delays, max_extra) for f in (max(0.0, 1 - noise), 1 + noise)] \
        if noise else [rows]
    for k, r in enumerate(rows):
        got = [r["step_s"]] + [e[k]["step_s"] for e in ends]
        r.update(noise=noise, step_s_range=[min(got), max(got)])
    return rows


def _preference(mode: str) -> tuple:
    """Simpler and closer to exact first: BSP; OSP (its applied updates are exact; ``auto`` before fixed shares,
    a larger share defers less); DSync (whole gradients up to k steps ahead: a shorter delay first); HSP (it
    changes what a step averages)."""
    kind, _, arg = mode.partition("-")
    rank = {"bsp": 0, "osp": 1, "dsync": 2, "hsp": 3}.get(kind, 4)
    if kind == "osp":
        return (rank, 0, 0.0) if arg == "auto" else (rank, 1, -float(arg))
    return (rank, 1, float(arg) if kind == "dsync" else 0.0)


def _tie(a: Dict, b: Dict) -> bool:
    """Whether ``a`` counts as fast as ``b``: within ``MIN_GAIN`` of it, or as fast within the profile's noise
    (its shortest predicted step no longer than ``b``'s longest)."""
    lo, hi = a.get("step_s_range", [a["step_s"]] * 2)[0], b.get("step_s_range", [b["step_s"]] * 2)[1]
    return a["step_s"] <= (1 + MIN_GAIN) * b["step_s"] or lo <= hi


def _choice(rows: List[Dict]):
    """(chosen row, fastest row, HSP rows left out as they have no straggler)."""
    bsp = next(r for r in rows if r["mode"] == "bsp")
    no_straggler = [r for r in rows if r["mode"] == "hsp" and r.get("micro_batches", 0) <= bsp.get("micro_batches", 0)]
    candidates = [r for r in rows if r not in no_straggler]
    fastest = max(candidates, key=lambda r: r["steps_per_s"])
    chosen = next(r for r in sorted(candidates, key=lambda r: _preference(r["mode"])) if _tie(r, fastest))
    return chosen, fastest, no_straggler


def choose(rows: List[Dict]) -> str:
    """The mode ``recommend`` recommends: the simplest (``_preference``) of the modes that tie with the fastest by
    synchronized steps/s (``_tie``: within 5%, or within the profile's noise); HSP only with a straggler
    (``Cluster(straggler=)``, ``--straggler``: its fast ranks then compute extras)."""
    return _choice(rows)[0]["mode"]


def recommend(rows: List[Dict]) -> str:
    """The mode ``choose`` picks, and why."""
    chosen, fastest, no_straggler = _choice(rows)
    bsp = next(r for r in rows if r["mode"] == "bsp")
    x = fastest["steps_per_s"] / bsp["steps_per_s"]

    def within(a):
        if a["step_s"] <= (1 + MIN_GAIN) * fastest["step_s"]:
            return f"less than the {MIN_GAIN:.0%} worth leaving a simpler mode for"
        ms = lambda r: "-".join(f"{1e3 * t:.0f}" for t in r["step_s_range"])  # noqa: E731
        return (f"a tie within the profile's noise (±{a['noise']:.0%}: {fastest['mode']} {ms(fastest)} ms a step, "
                f"{a['mode']} {ms(a)})")

    if chosen is bsp:
        text = ("bsp: no mode is faster than BSP here" if fastest is bsp else
                f"bsp: the fastest, {fastest['mode']}, is {x:.2f}x BSP's steps/s, {within(bsp)}: BSP is simpler")
        text += f"; BSP reaches {bsp['bound_share']:.0%} of the perfect-overlap bound"
    else:
        text = (f"{chosen['mode']}: {chosen['steps_per_s'] / bsp['steps_per_s']:.2f}x BSP's steps/s, "
                f"{chosen['bound_share']:.0%} of the perfect-overlap bound (BSP {bsp['bound_share']:.0%})")
        if fastest["steps_per_s"] > 1.005 * chosen["steps_per_s"]:
            text += (f"; {fastest['mode']} is {fastest['steps_per_s'] / chosen['steps_per_s']:.2f}x faster still, "
                     f"{within(chosen)}: {chosen['mode']} is simpler")
    hsp = next((r for r in rows if r["mode"] == "hsp"), None)
    if hsp is not None and hsp not in no_straggler:
        text += (f". HSP with this straggler: {hsp['micro_batches'] / bsp['micro_batches']:.2f}x the samples a step "
                 f"({hsp['samples_per_s'] / bsp['samples_per_s']:.2f}x BSP's samples/s) at "
                 f"{hsp['steps_per_s'] / bsp['steps_per_s']:.2f}x its steps/s; the extras make a step's gradient "
                 "less noisy, not the steps more: they pay only where a bigger batch speeds progress (docs/plan.md)")
    elif hsp is not None and hsp["steps_per_s"] > fastest["steps_per_s"]:
        text += (". HSP, predicted faster, is left out: without a straggler (--straggler) it only sends one message "
                 "instead of one a bucket, which is not what HSP is for")
    return text


def notes(rows: List[Dict]) -> List[str]:
    """What the reader of a plan should know about its profile's noise."""
    noise = rows[0].get("noise") if rows else None
    if noise is None:
        return [f"note: the profile has no measured noise (one timed iteration a mode, or osp.profile before "
                f"version 2): ties are judged at "
                f"{MIN_GAIN:.0%} only; take it again to know how much its times vary"]
    if noise > NOISY:
        return [f"note: the profile is noisy (its iterations varied by {noise:.0%}): modes whose predictions overlap "
                f"with every measured time ±{noise:.0%} are ties (the link's times are the cluster's: the noise does "
                f"not move them, so a lead where the link decides can stand), and a profile taken again may rank the "
                f"modes otherwise; a quiet host narrows it"]
    return []


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m osp.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a profile written by python -m osp.profile")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--link", required=True, help="each rank's (with --nodes: each node's) link in bits per second "
                    "as tc writes it: 1gbit, 400mbit, 25Gbit/s ('bps' and 'B/s' are refused); none: no link limit")
    ap.add_argument("--latency", default="0", help="per hop of the ring, with its unit: 50us, 0.2ms (a bare number "
                    "is microseconds)")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--intra", default=None, help="the bandwidth inside a node (with --nodes), in bits as --link")
    ap.add_argument("--straggler", type=float, default=1.0, help="the slowest rank's compute over the others', as "
                    "measured on the cluster (the profile is one rank's: it cannot see one); HSP is recommended only "
                    "with one")
    ap.add_argument("--efficiency", type=float, default=1.0, help="the share of a link's rate that carries the "
                    f"gradient (headers and framing take the rest): {TCP_ETHERNET_1500:.3f} for TCP over Ethernet at "
                    "MTU 1500 as tc counts it, about 0.99 at MTU 9000; default 1")
    ap.add_argument("--host", default=None, help="the ranks' own allreduce rate when no link limits it (ranks "
                    "sharing one machine's CPUs; leave out for GPUs), in bits as --link")
    ap.add_argument("--max-noise", type=float, default=EXTREME, help="refuse a profile noisier than this "
                    f"(default {EXTREME:g}: its iterations varied by half)")
    ap.add_argument("--json", action="store_true", help="print the modes as a JSON list")
    a = ap.parse_args(argv)
    try:
        with open(a.profile) as fh:
            profile = json.load(fh)
        link = None if a.link == "none" else parse_bandwidth(a.link)
        cluster = Cluster(a.ranks, link, parse_latency(a.latency),
                          a.nodes, parse_bandwidth(a.intra) if a.intra else None, a.straggler,
                          parse_bandwidth(a.host) if a.host else None, a.efficiency)
        rows = plan(profile, cluster, max_noise=a.max_noise)
    except (OSError, ValueError, KeyError, TypeError) as e:
        msg = str(e)
        print(msg if msg.startswith("osp.plan:") else f"osp.plan: {msg}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=1))
        for line in notes(rows):
            print(line, file=sys.stderr)
        return 0
    rate = "" if link is None else f" ({link / 1e9:g} Gbit/s)"
    print(f"{profile.get('model', 'model')}: {a.ranks} ranks, link {a.link}{rate}"
          + (f", {a.nodes} nodes, intra {a.intra}" if a.nodes else "")
          + (f", straggler {a.straggler:g}x" if a.straggler != 1 else ""))
    print(f"{'mode':10s} {'steps/s':>8s} {'samples/s':>10s} {'bound share':>12s}   (ranked by steps/s)")
    for r in sorted(rows, key=lambda r: -r["steps_per_s"]):  # stable: a tie keeps plan()'s order
        extra = f"  (critical {r['critical']:.2f})" if "critical" in r else ""
        if r["micro_batches"] != rows[0]["micro_batches"]:
            extra += f"  ({r['micro_batches']:g} micro-batches a step)"
        print(f"{r['mode']:10s} {r['steps_per_s']:8.2f} {r['samples_per_s']:10.1f} {r['bound_share']:12.2f}{extra}")
    for line in notes(rows):
        print(line)
    print("recommended: " + recommend(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
