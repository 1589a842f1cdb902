"""Faults survived: ranks SIGKILLed mid-step under Horovod Elastic and under torchrun restarts, on digits.

Horovod Elastic (``osp.train --elastic``): 3 ranks, each on a host of its own name (localhost,
127.0.0.1 and this machine's name: Horovod blacklists the host of a failed rank, and with one name for
all, that would be every rank's), ``--min-np 1``, ``--blacklist-cooldown-range 1 2`` (a failed host
may come back after about 2 s, and a new process joins there). Rank 2 SIGKILLs itself after step 25
and rank 0 (the coordinator) after step 67, both right after the step's update with OSP's stage 2 in
flight; commits every 10 steps. Against the same job without faults.

torchrun (``--max-restarts 2``): 2 ranks, checkpoints every 8 steps; rank 1 SIGKILLs itself after step
30; the restarted job resumes from step 24. Against the same job without the fault: the final
parameters must be bitwise equal, and the difference in wall time is the cost of the fault.

    python bench/faults.py [--seeds 0,1,2]    # about 4 minutes on 2 cores

Prints markdown tables; writes bench/results/faults.json.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from osp.elastic import local_host_names

HERE = os.path.dirname(os.path.abspath(__file__))
# a rank that waits for a peer that died learns of it when the peer's connection resets, or else when
# Gloo's receive times out (Horovod's default: 30 s); 10 s is still far above any step here
ENV = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_GLOO_TIMEOUT_SECONDS="10")


def timed(kind, cmd, faults, out):
    """Run a job (a launcher command) with ``--fault`` for each of ``faults``; its JSON, wall time and
    output. Past the time limit the launcher's whole session (every rank) is killed."""
    for f in faults:
        cmd = cmd + ["--fault", f]
    t0 = time.perf_counter()
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=ENV,
                         start_new_session=True)
    try:
        text = p.communicate(timeout=600)[0]
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise SystemExit(f"faults: {kind} job timed out\n{p.communicate()[0][-4000:]}") from None
    if p.returncode != 0:
        raise SystemExit(f"faults: {kind} job failed\n{text[-6000:]}")
    res = json.load(open(out))
    res["wall_s"] = time.perf_counter() - t0
    res["resumed"] = [line for line in text.splitlines() if line.startswith("resumed from step")]
    return res


def elastic(seed, faults, tmp, a):
    hosts = os.path.join(tmp, "hosts")
    with open(hosts, "w") as f:
        f.write("".join(f"{h}:1\n" for h in local_host_names(3)))
    script = os.path.join(tmp, "discover.sh")
    with open(script, "w") as f:
        f.write(f"#!/bin/sh\ncat {hosts}\n")
    os.chmod(script, 0o755)
    out = os.path.join(tmp, "e.json")
    hvd = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return timed("elastic", [
        hvd, "--gloo", "-np", "3", "--min-np", "1", "--max-np", "3", "--host-discovery-script", script,
        "--blacklist-cooldown-range", "1", "2", "--reset-limit", "10", sys.executable, "-m", "osp.train",
        "--elastic", "--sync", "osp", "--critical", "0.25", "--epochs", str(a.epochs), "--commit-every", "10",
        "--seed", str(seed),
        "--no-progress", "--json", out], faults, out)


def torchrun(seed, faults, tmp, a):
    out = os.path.join(tmp, "t.json")
    return timed("torchrun", [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "--max-restarts", "2", "-m", "osp.train", "--sync", "osp", "--critical", "0.25", "--epochs", str(a.epochs),
        "--seed", str(seed),
        "--checkpoint-dir", os.path.join(tmp, "ck"), "--checkpoint-every", "8", "--no-progress", "--json", out],
        faults, out)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--json", default=os.path.join(HERE, "results", "faults.json"))
    ap.add_argument("--report", default=None, metavar="JSON", help="print the tables of a saved run")
    a = ap.parse_args()
    if a.report:
        report(json.load(open(a.report))["runs"])
        return
    seeds = [int(s) for s in a.seeds.split(",")]
    runs = []
    for seed in seeds:
        row = {"seed": seed}
        for kind, fn, faults in (("elastic", elastic, ["2:25", "0:67"]), ("torchrun", torchrun, ["1:30"])):
            for name, f in (("fault", faults), ("clean", [])):
                with tempfile.TemporaryDirectory() as tmp:
                    r = fn(seed, f, tmp, a)
                row[f"{kind}_{name}"] = {k: r[k] for k in ("final_test_acc", "steps", "resets", "wall_s",
                                                           "replica_digests") if k in r}
                row[f"{kind}_{name}"]["resumed"] = r.get("resumed", [])
                print(f"seed {seed} {kind} {name}: acc {r['final_test_acc']:.4f} wall {r['wall_s']:.1f} s "
                      f"resets {r['resets']}", flush=True)
        runs.append(row)
    os.makedirs(os.path.dirname(a.json), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"seeds": seeds, "epochs": a.epochs, "runs": runs}, fh, indent=1)
    report(runs)


def report(runs):
    print("\n| engine | seed | kills survived | steps redone per kill | time to recover (s) | final acc, faults "
          "| final acc, no fault | replicas at the end |")
    print("|---|---|---|---|---|---|---|---|")
    for r in runs:
        e, c = r["elastic_fault"], r["elastic_clean"]
        kills = [x for x in e["resets"] if x["steps_redone"] > 0]
        redone = ", ".join(str(x["steps_redone"]) for x in kills)
        recover = ", ".join(f"{x['recover_s']:.2f}" for x in kills)
        n = len(e["replica_digests"])
        equal = "one rank left" if n == 1 else \
            f"bitwise equal ({n} ranks)" if len(set(e["replica_digests"])) == 1 else f"DIFFER ({n} ranks)"
        print(f"| Horovod Elastic | {r['seed']} | {len(kills)} of 2 | {redone} | {recover} "
              f"| {100 * e['final_test_acc']:.2f}% | {100 * c['final_test_acc']:.2f}% | {equal} |")
    for r in runs:
        t, c = r["torchrun_fault"], r["torchrun_clean"]
        same = set(t["replica_digests"]) == set(c["replica_digests"])
        print(f"| torchrun restart | {r['seed']} | {len(t['resumed'])} of 1 | 6 (from step 30 to the checkpoint of "
              f"24) | {t['wall_s'] - c['wall_s']:.1f} (job wall time over the run without fault) "
              f"| {100 * t['final_test_acc']:.2f}% | {100 * c['final_test_acc']:.2f}% "
              f"| {'bitwise equal to the run without fault' if same else 'DIFFER from the run without fault'} |")
    rec = [x["recover_s"] for r in runs for x in r["elastic_fault"]["resets"] if x["steps_redone"] > 0]
    if rec:
        print(f"\nHorovod Elastic: time to recover, median {statistics.median(rec):.2f} s over {len(rec)} kills")


if __name__ == "__main__":
    main()
