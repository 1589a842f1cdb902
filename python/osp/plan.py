"""Predict each mode's speed on a cluster from a profile of the model (``osp.profile``).

    python -m osp.plan profile.json --ranks 64 --link 100gbit [--latency 5] [--nodes 8 --intra 400gbit]
                       [--straggler 1.5] [--host 1.3gbit] [--efficiency 0.956] [--json]

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
  (the profile's ready times) and starts once the link is free.
- **BSP** (DDP alike): the buckets during backward; the step waits for the last, then ``S``:
  ``t = max(F + B, end of the last bucket) + S``.
- **OSP(share s)**: the critical share of each bucket during backward (the bucket ready last keeps only
  ``min_critical``; the others take over the rest of its quota), behind the previous step's stage 2 (the
  deferred ``1 - s`` of the gradient, issued at the previous ``step()``) on the link:
  ``t = max(F + B, end of the last critical bucket) + S``, the link starting the step busy for
  ``T(deferred) - S``. ``auto``: the share ``auto``'s rule picks, by this model's times instead of measured
  ones (``0.8 * W / T(all)``, ``W`` the backward window ``auto`` measures, from the first gradient landing to the
  last; a quarter of it, and 1; a smaller share only if at least 3% faster).
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
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from typing import Dict, List, Optional, Sequence

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
AUTO_MIN_CRITICAL = 0.05  # osp.OSP(critical="auto")'s default floor (docs/design.md, The budget)
# TCP over Ethernet at MTU 1500: 1448 bytes of payload (1500 less IPv4's 20 and TCP's 32 with timestamps) in a
# 1514-byte frame, which is what tc's rate limits count on a veth (the bench's emulated links)
TCP_ETHERNET_1500 = 1448 / 1514


def parse_bandwidth(text: str) -> float:
    """Bits per second of a rate written as tc writes it: ``1gbit``, ``400mbit``, ``100gbit``, ``10kbit``,
    ``125mbps`` (bytes), or a plain number of bits per second."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[0-9]+)?)\s*([kmgt]?)(bit|bps)?\s*", str(text).lower())
    if not m or (m.group(2) and not m.group(3)):
        raise ValueError(f"osp.plan: a bandwidth is a rate as tc writes it (1gbit, 400mbit, 100gbit), got {text!r}")
    value = float(m.group(1)) * _UNITS[m.group(2)] * (8.0 if m.group(3) == "bps" else 1.0)
    if not value > 0:
        raise ValueError(f"osp.plan: a bandwidth must be positive, got {text!r}")
    return value


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
    modes = profile.get("modes", {})
    if name not in modes:
        raise ValueError(f"osp.plan: the profile has no timings for {name!r} (it has {sorted(modes)}); "
                         "take it again with osp.profile")
    return modes[name]


def _compute(profile: dict, mode: str, cluster: Cluster):
    """Forward, backward and step of ``mode`` on the slowest rank. Forward and backward are the median over the
    profile's modes (one rank's hooks cost less than the profile's noise between its runs of the modes: up to 12%
    here), the step is the mode's own. A mode that communicates while it computes loses the collective's CPU
    work on a shared host (``Cluster.host_cpu_s``), counted into backward."""
    S = _mode(profile, mode)["step_s"]
    x = cluster.straggler
    F, B = (statistics.median(m[k] for m in profile["modes"].values()) for k in ("forward_s", "backward_s"))
    steal = 0.0 if mode in ("plain", "hsp") else cluster.host_cpu_s(sum(b["bytes"] for b in profile["buckets"]))
    return x * F, x * B + steal, S



def _ready(profile: dict, cluster: Cluster) -> List[float]:
    """Each bucket's ready time from the start of backward, on the slowest rank."""
    return [cluster.straggler * b["ready_s"] for b in profile["buckets"]]


def _link_chain(start_free: float, issues: Sequence[tuple], cluster: Cluster) -> float:
    """When the last of ``issues`` (``(bytes, issued at)``, in issue order) ends on a link free from
    ``start_free``: each starts at max(its issue, the previous one's end)."""
    end = start_free
    for nbytes, at in issues:
        if nbytes > 0:
            end = max(end, at) + cluster.allreduce_s(nbytes)
    return end


def step_bsp(profile: dict, cluster: Cluster) -> float:
    F, B, S = _compute(profile, "bsp", cluster)
    sizes = [b["bytes"] for b in profile["buckets"]]
    end = _link_chain(0.0, [(b, F + r) for b, r in zip(sizes, _ready(profile, cluster))], cluster)
    return max(F + B, end) + S


def osp_quotas(profile: dict, share: float, min_critical: float = 0.0) -> List[float]:
    """Critical bytes per bucket at ``share``: the bucket ready last keeps ``min_critical`` of its bytes,
    the others take over the rest of its quota in proportion to their size (docs/design.md, OSP)."""
    sizes = [b["bytes"] for b in profile["buckets"]]
    if not sizes:
        return []
    last = max(range(len(sizes)), key=lambda i: profile["buckets"][i]["ready_s"])
    if share >= 1.0 or len(sizes) == 1:
        return [share * s for s in sizes]
    quota = [share * s for s in sizes]
    keep = min(quota[last], max(min_critical, 0.0) * sizes[last])
    spare = quota[last] - keep
    quota[last] = keep
    others = [i for i in range(len(sizes)) if i != last]
    room = sum(sizes[i] - quota[i] for i in others)
    for i in others:  # in proportion to what each can still take; whatever does not fit stays with the last
        quota[i] += spare * (sizes[i] - quota[i]) / room if room > 0 else 0.0
    if room < spare:
        quota[last] += spare - room
    return quota


def step_osp(profile: dict, cluster: Cluster, share: float, min_critical: float = 0.0) -> float:
    if share >= 1.0:
        return step_bsp(profile, cluster)
    F, B, S = _compute(profile, "osp", cluster)
    total = sum(b["bytes"] for b in profile["buckets"])
    quotas = osp_quotas(profile, share, min_critical)
    ready = _ready(profile, cluster)
    deferred = total - sum(quotas)
    # the previous step's stage 2, issued at its step() (S before this step starts), holds the link first
    start_free = cluster.allreduce_s(deferred) - S if deferred > 0 else 0.0
    end = _link_chain(start_free, [(q, F + r) for q, r in zip(quotas, ready)], cluster)
    return max(F + B, end) + S


def auto_share(profile: dict, cluster: Cluster) -> float:
    """The share ``critical="auto"`` settles on, by this model's step times: fully critical, the modelled
    share ``0.8 * window / allreduce`` (the window: what ``auto`` measures, from the first gradient landing to the
    last; the whole backward for a profile without ``first_ready_s``), and a quarter of it (at least 0.05); a
    smaller share only if at least 3% faster."""
    _, B, _ = _compute(profile, "bsp", cluster)
    if "first_ready_s" in profile:  # auto's own window: from the first gradient landing to the last
        total = sum(b["bytes"] for b in profile["buckets"])
        B = max(_ready(profile, cluster), default=0.0) - cluster.straggler * profile["first_ready_s"] \
            + cluster.host_cpu_s(total)  # the collective's CPU work lengthens it on a shared host, as backward
    t_all = cluster.allreduce_s(sum(b["bytes"] for b in profile["buckets"]))
    if t_all <= 0:
        return 1.0
    model = 0.8 * B / t_all
    if model >= 1.0:
        return 1.0
    best, best_t = 1.0, step_bsp(profile, cluster)
    for share in (model, max(AUTO_MIN_CRITICAL, model / 4)):
        t = step_osp(profile, cluster, share, AUTO_MIN_CRITICAL)
        if t <= best_t / 1.03:
            best, best_t = share, t
    return best


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


def plan(profile: dict, cluster: Cluster, shares: Sequence[float] = (0.1, 0.25, 0.5), delays: Sequence[int] = (1, 2, 4),
         max_extra: int = 4) -> List[Dict]:
    """One dict per mode: ``mode``, ``steps_per_s``, ``samples_per_s``, ``bound_share``, ``step_s`` and, for
    ``osp-auto``, ``critical``; in the order bsp, osp-auto, osp-<share>..., dsync-<delay>..., hsp."""
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
        rows.append({"mode": mode, "steps_per_s": 1.0 / step_s, "samples_per_s": sps, "step_s": step_s,
                     "bound_share": sps / bound_sps, **extra})

    row("bsp", step_bsp(profile, cluster))
    share = auto_share(profile, cluster)
    row("osp-auto", step_osp(profile, cluster, share, AUTO_MIN_CRITICAL), critical=share)
    for s in shares:
        row(f"osp-{s:g}", step_osp(profile, cluster, s))
    for d in delays:
        row(f"dsync-{d}", step_dsync(profile, cluster, d))
    row("hsp", step_hsp(profile, cluster), micro=hsp_micro)
    return rows


def recommend(rows: List[Dict]) -> str:
    """The fastest mode by samples/s, BSP unless another is at least 5% faster, and why."""
    bsp = rows[0]
    best = max(rows, key=lambda r: r["samples_per_s"])
    if best is bsp or best["samples_per_s"] < 1.05 * bsp["samples_per_s"]:
        ratio = best["samples_per_s"] / bsp["samples_per_s"]
        return (f"bsp: no mode is 5% faster than BSP here (best {best['mode']} {ratio:.2f}x); BSP already reaches"
                f" {bsp['bound_share']:.0%} of the perfect-overlap bound")
    return (f"{best['mode']}: {best['samples_per_s'] / bsp['samples_per_s']:.2f}x BSP's samples/s, "
            f"{best['bound_share']:.0%} of the perfect-overlap bound (BSP {bsp['bound_share']:.0%})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m osp.plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("profile", help="a profile written by python -m osp.profile")
    ap.add_argument("--ranks", type=int, required=True)
    ap.add_argument("--link", required=True, help="each rank's (with --nodes: each node's) link, as tc writes it")
    ap.add_argument("--latency", type=float, default=0.0, help="microseconds per hop of the ring")
    ap.add_argument("--nodes", type=int, default=None)
    ap.add_argument("--intra", default=None, help="the bandwidth inside a node (with --nodes)")
    ap.add_argument("--straggler", type=float, default=1.0, help="the slowest rank's compute over the others'")
    ap.add_argument("--efficiency", type=float, default=1.0, help="the share of a link's rate that carries the "
                    f"gradient (headers and framing take the rest): {TCP_ETHERNET_1500:.3f} for TCP over Ethernet at "
                    "MTU 1500 as tc counts it, about 0.99 at MTU 9000; default 1")
    ap.add_argument("--host", default=None, help="the ranks' own allreduce rate when no link limits it (ranks "
                    "sharing one machine's CPUs; leave out for GPUs), as tc writes a rate")
    ap.add_argument("--json", action="store_true", help="print the modes as a JSON list")
    a = ap.parse_args(argv)
    try:
        with open(a.profile) as fh:
            profile = json.load(fh)
        cluster = Cluster(a.ranks, None if a.link == "none" else parse_bandwidth(a.link), a.latency * 1e-6,
                          a.nodes, parse_bandwidth(a.intra) if a.intra else None, a.straggler,
                          parse_bandwidth(a.host) if a.host else None, a.efficiency)
        rows = plan(profile, cluster)
    except (OSError, ValueError, KeyError) as e:
        msg = str(e)
        print(msg if msg.startswith("osp.plan:") else f"osp.plan: {msg}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(rows, indent=1))
        return 0
    print(f"{profile.get('model', 'model')}: {a.ranks} ranks, link {a.link}" + (f", {a.nodes} nodes, intra {a.intra}"
          if a.nodes else "") + (f", straggler {a.straggler:g}x" if a.straggler != 1 else ""))
    print(f"{'mode':10s} {'steps/s':>8s} {'samples/s':>10s} {'bound share':>12s}")
    for r in rows:
        extra = f"  (critical {r['critical']:.2f})" if "critical" in r else ""
        print(f"{r['mode']:10s} {r['steps_per_s']:8.2f} {r['samples_per_s']:10.1f} {r['bound_share']:12.2f}{extra}")
    print("recommended: " + recommend(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
