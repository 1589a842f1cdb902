"""The slow-rank warning on real launches: none on balanced runs, the straggler named on every slowed one.

Ordinary 2-rank runs of ``osp.train`` (the digits CNN, 3 epochs: about 60 steps, 40 under HSP, whose epochs
end sooner; the warning decides on a full window of 20) under the three launchers a user starts with
(torchrun, ``horovodrun --gloo``, mpirun), in the modes a user tries first (bsp, osp, dsync, hsp); then the
same with one rank made 2x slower (``--straggler 1:2``). Counts, per run, the warnings "rank N is ...x
slower" in its output.

    python bench/slow_rank_warning.py [--balanced 20] [--slowed 12] [--json bench/results/slow_rank_warning.json]

Exits 1 unless every balanced run is silent and every slowed run names rank 1 (``make check-slow-rank``).
Run it alone on the machine: other load makes one rank slower for real.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PY = sys.executable
BIN = os.path.dirname(PY)
NAMED = re.compile(r"osp: rank (\d+) is ([0-9.]+)x slower")


def command(launcher: str, sync: str, straggler: bool) -> list:
    job = ["-m", "osp.train", "--sync", sync, "--epochs", "3", "--no-progress", "--eval-every", "3"]
    if straggler:
        job += ["--straggler", "1:2"]
    if launcher == "torchrun":
        return [os.path.join(BIN, "torchrun"), "--standalone", "--nproc-per-node", "2", *job, "--backend", "torch"]
    if launcher == "horovodrun":
        return [os.path.join(BIN, "horovodrun"), "--gloo", "-np", "2", "-H", "localhost:2", PY, *job,
                "--backend", "horovod"]
    return [shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PATH",
            PY, *job, "--backend", "horovod"]


def run(launcher: str, sync: str, straggler: bool) -> dict:
    cmd = command(launcher, sync, straggler)
    t0 = time.perf_counter()
    env = dict(os.environ, PYTHONWARNINGS="default", OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    out = p.stdout + p.stderr
    named = [(int(r), float(x)) for r, x in NAMED.findall(out)]
    return {"launcher": launcher, "sync": sync, "straggler": straggler, "rc": p.returncode,
            "seconds": round(time.perf_counter() - t0, 1), "named": named,
            "tail": out[-1500:] if p.returncode else ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ap.add_argument("--balanced", type=int, default=20, help="balanced launches")
    ap.add_argument("--slowed", type=int, default=12, help="launches with rank 1 2x slower")
    ap.add_argument("--json", default=os.path.join(HERE, "results", "slow_rank_warning.json"))
    a = ap.parse_args(argv)
    plan = itertools.cycle(itertools.product(("torchrun", "horovodrun", "mpirun"), ("bsp", "osp", "dsync", "hsp")))
    runs = []
    for i in range(a.balanced + a.slowed):
        launcher, sync = next(plan)
        r = run(launcher, sync, straggler=i >= a.balanced)
        runs.append(r)
        print(f"{launcher:10s} {sync:5s} {'rank 1 2x slower' if r['straggler'] else 'balanced':16s} "
              f"rc={r['rc']} {r['seconds']:5.1f}s named={r['named']}", flush=True)
    balanced = [r for r in runs if not r["straggler"]]
    slowed = [r for r in runs if r["straggler"]]
    failed = [r for r in runs if r["rc"] != 0]
    false_alarms = sum(bool(r["named"]) for r in balanced)
    missed = sum(not (r["named"] and all(rank == 1 for rank, _ in r["named"])) for r in slowed)
    print(f"balanced: {false_alarms} of {len(balanced)} runs warned; rank 1 2x slower: named in "
          f"{len(slowed) - missed} of {len(slowed)}; {len(failed)} runs failed")
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"command": "python bench/slow_rank_warning.py " + " ".join(argv or sys.argv[1:]),
                   "false_alarms": false_alarms, "balanced": len(balanced), "missed": missed,
                   "slowed": len(slowed), "runs": runs}, fh, indent=1)
    for r in failed:
        print(f"--- {r['launcher']} {r['sync']} rc={r['rc']}\n{r['tail']}", file=sys.stderr)
    return 0 if not failed and not false_alarms and not missed else 1


if __name__ == "__main__":
    sys.exit(main())
