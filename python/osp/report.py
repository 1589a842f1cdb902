"""Side-by-side table of ``osp.train --json`` results: ``python -m osp.report RUN.json ...``"""
from __future__ import annotations

import json
import sys


def label(r: dict) -> str:
    c = r["config"]
    return f"osp critical={c['critical']}" if c["sync"] == "osp" else c["sync"]


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


def table(results: list) -> str:
    base = baseline(results)
    target = base["final_test_acc"]
    t_base = time_to(base, target)
    rows = ["| run | ranks | final test acc | vs BSP (points) | time to BSP's acc (s) | speedup | samples/s | x BSP | "
            "critical share | stage-1 ms | stage-2 wait ms | compute ms |", "|---" * 12 + "|"]
    for r in results:
        m = r.get("osp_stats", {}).get("mean", {})
        t = time_to(r, target)
        cells = [label(r), str(r["config"]["ranks"]), f"{100 * r['final_test_acc']:.2f}%",
                 f"{100 * (r['final_test_acc'] - base['final_test_acc']):+.2f}",
                 "not reached" if t is None else f"{t:.2f}", f"{t_base / t:.2f}" if t and t_base else "-",
                 f"{r['samples_per_s']:.0f}", f"{r['samples_per_s'] / base['samples_per_s']:.2f}",
                 f"{m['critical_fraction']:.2f}" if m else "-"]
        cells += [f"{1e3 * m[k]:.2f}" if m else "-" for k in ("stage1_s", "stage2_wait_s", "compute_s")]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def main(argv=None):
    paths = (argv if argv is not None else sys.argv[1:])
    if not paths:
        print(__doc__)
        return 2
    results = [json.load(open(p)) for p in paths]
    print(table(results))
    base = baseline(results)
    print(f"\ntime to BSP's acc: training wall time (evaluation excluded) at the end of the first epoch whose test "
          f"accuracy reaches {label(base)}'s final one ({100 * base['final_test_acc']:.2f}%); speedup: its time / "
          f"the run's")
    return 0


if __name__ == "__main__":
    sys.exit(main())
