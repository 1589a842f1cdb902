"""Side-by-side table of ``osp.train --json`` results: ``python -m osp.report RUN.json ...``

Runs of the same configuration (the same ``--sync`` and its options, compression and ranks) are repeats: each
row is one configuration, its figures the median over its runs with their range. A ratio to BSP (or DDP) is
shown with its spread over the repeats; from a single run it has none, and is not called a speedup.
"""
from __future__ import annotations

import json
import statistics
import sys
from typing import List, Optional

SETTLE_STEPS = 10  # steps left out of a steady rate: warm-up, and OSP auto's first decision and its check
NOTHING_DEFERRED = 0.95  # a critical share at least this: the run deferred almost nothing


def label(r: dict) -> str:
    c = r["config"]
    sync = c["sync"]

    def mode(name):
        if name == "osp":
            return f"osp critical={c['critical']}"
        if name == "dsync":
            return f"dsync delay={c['delay']}"
        return name
    text = f"hsp+{mode(c.get('hsp_sync', 'bsp'))}" if sync == "hsp" and c.get("hsp_sync", "bsp") != "bsp" \
        else mode(sync)
    if c.get("compression", "none") != "none":
        text += f" {c['compression']}"
    return text


def baseline(results: list) -> dict:
    """The run the others are compared with: the first BSP run, else the first."""
    return next((r for r in results if r["config"]["sync"] == "bsp"), results[0])


def time_to(r: dict, target: float):
    """Training wall time (evaluation excluded) at the end of the first epoch whose test accuracy reaches
    ``target``, from the per-epoch records; None if none does (or the run has no records)."""
    for e in r.get("epochs") or []:
        if e["test_acc"] >= target - 1e-9:
            return e["wall_s"]
    return None


def steady_rate(r: dict, skip: int = SETTLE_STEPS):
    """(samples/s, steady): the throughput from the end of the first evaluation record at or past step ``skip``
    to the end of the run (OSP auto's measuring steps left out, for every contender alike), with
    ``steady=True``; the whole run's samples/s and False where the records do not allow it."""
    steps, start = 0, None
    eps = r.get("epochs") or []
    for i, e in enumerate(eps):
        steps += e.get("steps", 0)
        if steps >= skip and i + 1 < len(eps) and "samples" in e:
            start = e
            break
    if start is None:
        return r["samples_per_s"], False
    last = eps[-1]
    dt = last["wall_s"] - start["wall_s"]
    if dt <= 0:
        return r["samples_per_s"], False
    return (last["samples"] - start["samples"]) / dt, True


def critical_share(r: dict) -> Optional[float]:
    """The share of blocks the run kept critical: what OSP auto ran at the end, else the mean over its steps; None
    for a run that is not OSP's."""
    c = r["config"]
    st = r.get("osp_stats") or {}
    if "osp" not in (c["sync"], c.get("hsp_sync") if c["sync"] == "hsp" else None) \
            or "critical_fraction" not in st.get("mean", {}):
        return None
    b = st.get("budget")
    if b and b.get("phase") == "auto":  # what it runs now (stats()["budget"]["decisions"]: when it changed)
        return b["fraction"]
    return st["mean"]["critical_fraction"]


class Group:
    """The runs of one configuration."""

    def __init__(self, key, runs):
        self.key, self.runs = key, runs
        self.label, self.ranks = key
        rates = [steady_rate(r) for r in runs]
        self.rates = [x for x, _ in rates]
        self.steady = all(ok for _, ok in rates)
        self.sync = runs[0]["config"]["sync"]

    @property
    def n(self) -> int:
        return len(self.runs)

    def median(self, values):
        vals = [v for v in values if v is not None]
        return statistics.median(vals) if vals else None


def groups(results: list) -> List[Group]:
    """Runs grouped by configuration, in the order each first appears."""
    order, by = [], {}
    for r in results:
        key = (label(r), r["config"]["ranks"])
        if key not in by:
            order.append(key)
            by[key] = []
        by[key].append(r)
    return [Group(k, by[k]) for k in order]


def spread(values: list, digits: int = 0) -> str:
    """``median (min-max)``, or the value alone with one."""
    med = statistics.median(values)
    if len(values) < 2:
        return f"{med:.{digits}f}"
    return f"{med:.{digits}f} ({min(values):.{digits}f}-{max(values):.{digits}f})"


def ratio(num: list, den: list):
    """(median ratio, low, high, has_spread): the medians' ratio, and its range over the repeats (the
    slowest run over the fastest baseline to the fastest over the slowest)."""
    r = statistics.median(num) / statistics.median(den)
    lo, hi = min(num) / max(den), max(num) / min(den)
    return r, lo, hi, len(num) > 1 and len(den) > 1


def ratio_cell(num: list, den: list) -> str:
    r, lo, hi, has = ratio(num, den)
    return f"{r:.2f} ({lo:.2f}-{hi:.2f})" if has else f"{r:.2f} (one run: no spread)"


def baselines(gs: List[Group]) -> list:
    """The groups ratios are taken against: BSP's (else the first), and DDP's where there is one."""
    out = [next((g for g in gs if g.sync == "bsp"), gs[0])]
    ddp = next((g for g in gs if g.sync == "ddp"), None)
    if ddp is not None and ddp is not out[0]:
        out.append(ddp)
    return out


def table(results: list) -> str:
    gs = groups(results)
    bases = baselines(gs)
    base = bases[0]
    target = statistics.median(r["final_test_acc"] for r in base.runs)
    t_base = [time_to(r, target) for r in base.runs]
    head = ["run", "ranks", "runs", "final test acc", f"vs {base.label} (points)", f"time to {base.label}'s acc (s)",
            f"{base.label}'s time / its", "samples/s"]
    head += [f"x {b.label}" for b in bases]
    head += ["critical share", "stage-1 ms", "stage-2 wait ms", "compute ms"]
    rows = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for g in gs:
        accs = [r["final_test_acc"] for r in g.runs]
        times = [time_to(r, target) for r in g.runs]
        reached = [t for t in times if t is not None]
        tb = [t for t in t_base if t]
        cells = [g.label, str(g.ranks), str(g.n), f"{100 * statistics.median(accs):.2f}%",
                 f"{100 * (statistics.median(accs) - target):+.2f}",
                 "not reached" if not reached else spread(reached, 2),
                 ratio_cell(tb, reached) if reached and tb else "-", spread(g.rates)]
        cells += [ratio_cell(g.rates, b.rates) for b in bases]
        shares = [critical_share(r) for r in g.runs]
        means = [r.get("osp_stats", {}).get("mean", {}) for r in g.runs]
        cells.append(f"{statistics.median(shares):.2f}" if None not in shares else "-")
        for k in ("stage1_s", "stage2_wait_s", "compute_s"):
            vals = [m[k] for m in means if k in m]
            cells.append(f"{1e3 * statistics.median(vals):.2f}" if len(vals) == g.n else "-")
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def notes(results: list) -> List[str]:
    """What the table's ratios can and cannot say: repeats, steady throughput, runs that deferred nothing."""
    gs = groups(results)
    bases = baselines(gs)
    base = bases[0]
    out = []
    if all(g.steady for g in gs):
        out.append(f"samples/s: from the end of the first evaluation at or past step {SETTLE_STEPS} to the end of the "
                   "run (OSP auto measures and tries shares before it; every run alike), evaluation excluded; median "
                   "over the runs (min-max)")
    else:
        out.append("samples/s: over whole runs, their first steps included (too few evaluation records to leave "
                   f"out the first {SETTLE_STEPS} steps); median over the runs (min-max)")
    if any(g.n < 2 for g in gs):
        out.append("one run of some configuration: its ratios have no spread over repeats, so they are not a "
                   "measured speedup (a few percent either way is noise here); run each configuration several times "
                   "(e.g. 3) and pass every JSON")
    else:
        out.append("x BSP / x DDP: the median samples/s over the baseline's, in brackets its range over the repeats "
                   "(the slowest run over the fastest baseline run to the fastest over the slowest)")
    for g in gs:
        shares = [critical_share(r) for r in g.runs]
        if g.sync not in ("osp", "hsp") or None in shares or statistics.median(shares) < NOTHING_DEFERRED:
            continue
        for b in bases:
            r, lo, hi, has = ratio(g.rates, b.rates)
            if g is not b and r > 1.0:
                out.append(f"{g.label}: critical share {statistics.median(shares):.2f}: it deferred almost nothing, "
                           f"so its {r:.2f}x {b.label} is not OSP's doing (its steps were BSP's: noise between runs, "
                           "or how the engines differ)")
    links = {r["config"].get("link") for r in results}
    if len(links) > 1:
        out.append(f"the runs were not behind the same link ({sorted(map(str, links))}): their ratios compare unlike "
                   "networks")
    elif None not in links:
        out.append(f"every run behind an emulated link (--link {links.pop()}; osp.linkemu, user space: not a real "
                   "network); for real shaped links (tc, network namespaces) see docs/benchmarks.md")
    out.append(f"time to {base.label}'s acc: training wall time (evaluation excluded) at the end of the first epoch "
               f"whose test accuracy reaches {base.label}'s final one (median over its runs)")
    return out


def main(argv=None):
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__)
        return 2
    results = [json.load(open(p)) for p in paths]
    print(table(results))
    print()
    for line in notes(results):
        print("- " + line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
