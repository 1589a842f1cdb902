"""osp.plan against measurement: every configuration of the throughput bench predicted from profiles taken on
this machine, then measured, side by side.

    python bench/plan_validation.py                 # profiles, the bench, the comparison (~100 min, root, idle)
    python bench/plan_validation.py --compare bench/results/plan_validation.json   # the comparison again, no runs
    python bench/plan_validation.py --profile-only --out bench/out/profiles         # fresh profiles alone
    python bench/plan_validation.py --compare bench/results/plan_validation.json --profiles bench/out/profiles.json

1. Profiles: for each model and rank count ``N``, ``N`` copies of ``python -m osp.profile`` at once (one torch
   thread each, as the bench's ranks), so the profile's compute is the compute of ``N`` ranks sharing this
   machine's cores; the slowest copy's profile is the one used (every synchronous mode waits for it).
2. The throughput bench (``bench/train_throughput.py``) for the same models, ranks and links, with the contenders
   ``compute``, ``allreduce`` and the modes ``osp-bsp``, ``osp-auto``, ``osp-0.25``, ``dsync-2``, ``hsp-bsp``.
3. ``osp.plan`` per configuration, with the link's rate and ``host`` = the rate the unshaped ``allreduce`` row
   (the collective alone, no mode) moved the gradient at for that model and ``N``: the ranks' CPUs, which cap
   every link here and do the collective's work on the cores compute runs on. Nothing else is fitted.

Every contender runs ``--repeats`` times (taking turns); ``--also`` pools earlier runs in (their rows, and the
profiles of the models this run did not profile: ``make bench-plan`` measures a model at a time). Reports each mode's
predicted samples/s against the median of its runs, the runs' spread (the measurement's own repeatability), and
whether the predicted order of the modes holds wherever measured modes differ by more than 10% (and among those,
where their runs do not overlap). Writes OUT.json and OUT.md (default bench/out/plan_validation).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "python"))
from bench.models import DEFAULT_BATCH  # noqa: E402
from osp.plan import AUTO_MIN_CRITICAL, TCP_ETHERNET_1500, Cluster, parse_bandwidth, plan, step_osp  # noqa: E402

# the bench's contender -> osp.plan's mode
MODES = {"osp-bsp": "bsp", "osp-auto": "osp-auto", "osp-0.25": "osp-0.25", "dsync-2": "dsync-2", "hsp-bsp": "hsp"}
TOLERANCE, ORDER_GAP = 0.15, 0.10


def take_profiles(model: str, ranks: int, tmp: str, steps: int) -> dict:
    """``ranks`` concurrent profiles of ``model``; the slowest (forward + backward of the plain step)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "python"), ROOT]),
           "OMP_NUM_THREADS": "1"}
    outs = [os.path.join(tmp, f"profile-{model}-r{ranks}-{i}.json") for i in range(ranks)]
    procs = [subprocess.Popen([sys.executable, "-m", "osp.profile", "--model", model, "--batch",
                               str(DEFAULT_BATCH[model]), "--threads", "1", "--steps", str(steps), "--warmup", "2",
                               "--out", out], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for out in outs]
    for p in procs:
        log, _ = p.communicate(timeout=1800)
        if p.returncode:
            raise RuntimeError(f"osp.profile failed ({p.returncode}): {log[-2000:]}")
    profiles = []
    for out in outs:
        with open(out) as fh:
            profiles.append(json.load(fh))
    slowest = max(profiles, key=lambda p: p["modes"]["plain"]["forward_s"] + p["modes"]["plain"]["backward_s"])
    slowest["concurrent"] = ranks
    return slowest


def measure(a, tmp: str) -> list:
    out = os.path.join(tmp, "measured.json")
    cmd = [sys.executable, os.path.join(ROOT, "bench", "train_throughput.py"), "--models", a.models, "--ranks",
           a.ranks, "--bandwidths", a.bandwidths, "--contenders", "compute,allreduce," + ",".join(MODES),
           "--no-digits", "--warmup", str(a.warmup), "--steps", str(a.steps), "--repeats", str(a.repeats),
           "--json", out]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=ROOT)
    with open(out) as fh:
        return json.load(fh)["rows"]


def pool_runs(rowsets: list) -> list:
    """One row per (model, ranks, rate, contender) from one or more benches' rows: every run's samples/s
    (``runs_sps``), their median as ``samples_per_s`` and ``step_s``, and ``spread`` (fastest over slowest run,
    less 1): the measurement's own repeatability, which no model can be asked to beat."""
    groups = {}
    for rows in rowsets:
        for r in rows:
            if "error" not in r:
                groups.setdefault((r["model"], r["ranks"], r["rate"], r["contender"]), []).append(r)
    pooled = []
    for rs in groups.values():
        steps = [s for r in rs for s in r.get("step_s_runs", [r["step_s"]])]
        runs = sorted(r["samples_per_s"] * r["step_s"] / s for r in rs for s in r.get("step_s_runs", [r["step_s"]]))
        pooled.append({**rs[0], "samples_per_s": statistics.median(runs), "step_s": statistics.median(steps),
                       "runs_sps": runs, "spread": runs[-1] / runs[0] - 1,
                       "criticals_runs": [r["critical_fraction"] for r in rs if r.get("critical_fraction")]})
    return pooled


def compare(profiles: dict, rows: list) -> list:
    """One dict per (model, ranks, rate): the calibration, and per mode the predicted and measured figures."""
    ok = [r for r in rows if "error" not in r]
    configs = []
    for (model, ranks, rate) in sorted({(r["model"], r["ranks"], r["rate"]) for r in ok},
                                       key=lambda k: (k[0], k[1], k[2] != "1gbit", k[2] == "none")):
        peers = {r["contender"]: r for r in ok if (r["model"], r["ranks"], r["rate"]) == (model, ranks, rate)}
        unshaped = next((r for r in ok if (r["model"], r["ranks"], r["rate"], r["contender"]) ==
                         (model, ranks, "none", "allreduce")), None)
        profile = profiles[f"{model}-r{ranks}"]
        if unshaped is None:
            raise ValueError(f"no unshaped allreduce row for {model} at {ranks} ranks: the host's rate is unknown")
        host = 2 * (ranks - 1) / ranks * 8 * unshaped["bytes"] / unshaped["step_s"]
        # the bench's links are tc limits on veths at MTU 1500: they count each frame's headers
        cluster = Cluster(ranks, None if rate == "none" else parse_bandwidth(rate), host=host,
                          efficiency=TCP_ETHERNET_1500)
        predicted = {p["mode"]: p for p in plan(profile, cluster, shares=(0.25,), delays=(2,),
                                                max_noise=math.inf)}  # profiles ran side by side
        modes = []
        for contender, mode in MODES.items():
            if contender not in peers:
                continue
            m, p = peers[contender], predicted[mode]
            row = {"contender": contender, "mode": mode, "measured_sps": m["samples_per_s"],
                   "predicted_sps": p["samples_per_s"], "error": p["samples_per_s"] / m["samples_per_s"] - 1,
                   "runs_sps": m.get("runs_sps", [m["samples_per_s"]]), "spread": m.get("spread", 0.0),
                   "measured_critical": m.get("critical_fraction"), "predicted_critical": p.get("critical")}
            if mode == "osp-auto":  # the model of the mode, apart from auto's choice: at the shares auto ran
                shares = m.get("criticals_runs") or [m.get("critical_fraction") or 1.0]
                at = statistics.median(ranks * profile["batch"] / step_osp(profile, cluster, c, AUTO_MIN_CRITICAL)
                                       for c in shares)
                row.update(at_measured_sps=at, at_measured_error=at / m["samples_per_s"] - 1)
            modes.append(row)
        plain = profile["modes"]["plain"]
        check = {"compute_predicted_s": plain["forward_s"] + plain["backward_s"] + plain["step_s"],
                 "compute_measured_s": peers["compute"]["step_s"] if "compute" in peers else None,
                 "allreduce_predicted_s": cluster.allreduce_s(profile["bytes"]),
                 "allreduce_measured_s": peers["allreduce"]["step_s"] if "allreduce" in peers else None}
        configs.append({"model": model, "ranks": ranks, "rate": rate, "host_bits_per_s": host, "modes": modes,
                        "order": order_holds(modes), **check})
    return configs


def order_holds(modes: list) -> dict:
    """Every pair of modes whose measured samples/s differ by more than ORDER_GAP: predicted in the same order?
    ``clear``: those of them whose runs do not overlap (every run of the faster beat every run of the slower),
    so the measured order is not the noise's."""
    pairs, wrong, clear, clear_wrong = 0, [], 0, []
    for i, x in enumerate(modes):
        for y in modes[i + 1:]:
            hi, lo = (x, y) if x["measured_sps"] >= y["measured_sps"] else (y, x)
            if hi["measured_sps"] > (1 + ORDER_GAP) * lo["measured_sps"]:
                pairs += 1
                ok = hi["predicted_sps"] > lo["predicted_sps"]
                if not ok:
                    wrong.append(f"{hi['mode']} > {lo['mode']}")
                if min(hi["runs_sps"]) > max(lo["runs_sps"]):
                    clear += 1
                    if not ok:
                        clear_wrong.append(f"{hi['mode']} > {lo['mode']}")
    return {"pairs": pairs, "wrong": wrong, "clear": clear, "clear_wrong": clear_wrong}


def markdown(configs: list) -> str:
    lines = ["| model | ranks | link | mode | measured samples/s (runs' spread) | predicted | error | critical "
             "measured / predicted |", "|" + "---|" * 8]
    for c in configs:
        for m in c["modes"]:
            crit = ("-" if m["predicted_critical"] is None else
                    f"{m['measured_critical'] or 0:.2f} / {m['predicted_critical']:.2f}")
            mark = "" if abs(m["error"]) <= TOLERANCE else " **x**"
            if "at_measured_error" in m:
                crit += f" (at the measured share: {m['at_measured_error']:+.0%})"
            lines.append(f"| {c['model']} | {c['ranks']} | {c['rate']} | {m['mode']} | {m['measured_sps']:.1f} "
                         f"({len(m['runs_sps'])} runs, {m['spread']:.0%}) | {m['predicted_sps']:.1f} | "
                         f"{m['error']:+.0%}{mark} | {crit} |")
    lines += ["", "| model | ranks | link | compute ms measured / profile | allreduce ms measured / predicted | "
              "host Gbit/s | pairs > 10% apart (runs apart) | predicted in the wrong order (runs apart: bold) |",
              "|" + "---|" * 8]
    for c in configs:
        cm, am, o = c["compute_measured_s"], c["allreduce_measured_s"], c["order"]
        wrong = ", ".join(f"**{w}**" if w in o["clear_wrong"] else w for w in o["wrong"]) or "-"
        lines.append(f"| {c['model']} | {c['ranks']} | {c['rate']} | "
                     f"{1e3 * cm:.0f} / {1e3 * c['compute_predicted_s']:.0f} | "
                     f"{1e3 * am:.0f} / {1e3 * c['allreduce_predicted_s']:.0f} | {c['host_bits_per_s'] / 1e9:.2f} | "
                     f"{o['pairs']} ({o['clear']}) | {wrong} |")
    lines += ["", summary(configs)]
    return "\n".join(lines)


def summary(configs: list) -> str:
    errors = sorted(abs(m["error"]) for c in configs for m in c["modes"])
    spreads = sorted(m["spread"] for c in configs for m in c["modes"])
    within = sum(e <= TOLERANCE for e in errors)
    pairs = sum(c["order"]["pairs"] for c in configs)
    wrong = sum(len(c["order"]["wrong"]) for c in configs)
    clear = sum(c["order"]["clear"] for c in configs)
    clear_wrong = sum(len(c["order"]["clear_wrong"]) for c in configs)
    by_mode = {}
    for c in configs:
        for m in c["modes"]:
            by_mode.setdefault(m["mode"], []).append(abs(m["error"]) <= TOLERANCE)
    auto = [m["at_measured_error"] for c in configs for m in c["modes"] if "at_measured_error" in m]
    auto_within = sum(abs(e) <= TOLERANCE for e in auto)
    return (f"{within} of {len(errors)} predictions within {TOLERANCE:.0%} of the measured samples/s (median "
            f"|error| {errors[len(errors) // 2]:.0%}, worst {errors[-1]:.0%}; per mode: "
            + ", ".join(f"{k} {sum(v)}/{len(v)}" for k, v in by_mode.items())
            + f"; osp-auto at the shares auto measured and ran: {auto_within}/{len(auto)}). "
            f"The measurement's own spread between runs of one mode: median {spreads[len(spreads) // 2]:.0%}, "
            f"worst {spreads[-1]:.0%}. The order of modes more than {ORDER_GAP:.0%} apart predicted right in "
            f"{pairs - wrong} of {pairs} pairs; in {clear - clear_wrong} of {clear} where the runs do not overlap.")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="mlp,resnet18,gpt")
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--bandwidths", default="1gbit,10gbit,none")
    ap.add_argument("--warmup", type=int, default=10, help="bench steps before measuring (auto settles in them)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=2, help="runs of every contender (taking turns)")
    ap.add_argument("--compare", default=None, help="a saved plan_validation.json: redo the comparison only")
    ap.add_argument("--profiles", default=None, help="a saved plan_validation.json: its profiles (none taken; with "
                    "--compare, in place of the compared file's)")
    ap.add_argument("--profile-only", action="store_true", help="take the profiles, write them to OUT.json, stop")
    ap.add_argument("--also", default=None, help="saved plan_validation.json files (comma list): their runs are "
                    "pooled with this one's (the median of every run)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "plan_validation"))
    a = ap.parse_args(argv)
    profiles = {}
    if a.profiles:
        with open(a.profiles) as fh:
            profiles = json.load(fh)["profiles"]
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    if a.compare:
        with open(a.compare) as fh:
            saved = json.load(fh)
        profiles, rowsets = profiles or saved["profiles"], saved.get("rowsets", [saved["rows"]])
    else:
        with tempfile.TemporaryDirectory() as tmp:
            for model in a.models.split(","):
                for ranks in map(int, a.ranks.split(",")):
                    if f"{model}-r{ranks}" not in profiles:
                        print(f"profiling {model} with {ranks} concurrent copies", flush=True)
                        profiles[f"{model}-r{ranks}"] = take_profiles(model, ranks, tmp, a.profile_steps)
            if a.profile_only:
                with open(a.out + ".json", "w") as fh:
                    json.dump({"config": vars(a), "profiles": profiles}, fh, indent=1)
                print(f"profiles -> {a.out}.json")
                return 0
            rowsets = [measure(a, tmp)]
    for path in (a.also.split(",") if a.also else []):  # earlier runs: their rows, and profiles of other models
        with open(path) as fh:
            saved = json.load(fh)
        rowsets += saved.get("rowsets", [saved["rows"]])
        profiles = {**saved["profiles"], **profiles}
    rows = pool_runs(rowsets)
    configs = compare(profiles, rows)
    with open(a.out + ".json", "w") as fh:
        json.dump({"config": vars(a), "profiles": profiles, "rows": rows, "rowsets": rowsets, "configs": configs},
                  fh, indent=1)
    text = markdown(configs)
    with open(a.out + ".md", "w") as fh:
        fh.write(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
