"""Side-by-side table of ``osp.train --json`` results: ``python -m osp.report RUN.json ...``"""
from __future__ import annotations

import json
import sys


def label(r: dict) -> str:
    c = r["config"]
    return f"osp critical={c['critical']}" if c["sync"] == "osp" else c["sync"]


def table(results: list) -> str:
    base = next((r for r in results if r["config"]["sync"] == "bsp"), results[0])
    rows = ["| run | ranks | final test acc | vs BSP (points) | samples/s | x BSP | critical share | "
            "stage-1 ms | stage-2 wait ms | compute ms |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        m = r.get("osp_stats", {}).get("mean", {})
        cells = [label(r), str(r["config"]["ranks"]), f"{100 * r['final_test_acc']:.2f}%",
                 f"{100 * (r['final_test_acc'] - base['final_test_acc']):+.2f}", f"{r['samples_per_s']:.0f}",
                 f"{r['samples_per_s'] / base['samples_per_s']:.2f}",
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
