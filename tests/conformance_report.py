"""Counts of the one-rank conformance suite by outcome, per mode: the table in docs/works-with.md.

    python tests/conformance_report.py [--markdown]

Runs every case test_conformance.py runs (in this process, one rank) and prints the counts; a case
outside the accepted outcomes (a silent difference, an unexpected error) is listed and makes it exit 1.
"""
import collections
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import conformance as C  # noqa: E402
import torch.distributed as dist  # noqa: E402

KINDS = ["bitwise", "ulp", "refused", "torch-refuses", "torch-nonfinite", "differs", "error"]


def main(markdown: bool) -> int:
    import test_conformance
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    t0 = time.time()
    counts = collections.defaultdict(collections.Counter)
    bad = []
    for case in test_conformance.CASES:
        out = C.run_case(case)
        counts[case.mode][out.kind] += 1
        wrong = C.verdict(case, out)
        if wrong is not None:
            bad.append(wrong)
    total = collections.Counter()
    for c in counts.values():
        total.update(c)
    rows = [(m, counts[m]) for m in C.MODES] + [("all", total)]
    if markdown:
        print("| mode | cases | " + " | ".join(KINDS) + " |")
        print("|---|---|" + "---|" * len(KINDS))
        for m, c in rows:
            print(f"| {m} | {sum(c.values())} | " + " | ".join(str(c[k]) for k in KINDS) + " |")
    else:
        for m, c in rows:
            print(f"{m:20s} {sum(c.values()):5d}  " + "  ".join(f"{k}={c[k]}" for k in KINDS if c[k]))
    print(f"{sum(total.values())} cases in {time.time() - t0:.0f} s")
    for b in bad:
        print(b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main("--markdown" in sys.argv))
