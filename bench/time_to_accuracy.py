"""Time to accuracy where the network matters: a ~4M-parameter digits model on 2 ranks behind an
emulated 1 Gbit/s link, BSP against DDP, FSDP2, Horovod's optimizer and OSP ``auto``, several seeds.

Every run is ``python -m osp.train`` on 2 ranks: by default ``--model mlp --width 32`` (DigitsMLP,
64-2048-2048-10, 4.35M parameters, 17 MB of fp32 gradient a step) at batch 256 per rank, evaluated
every 5 epochs; ``--model cnn`` runs DigitsCNN widened (``--width 120`` makes fc1 512->7680, 4.02M
parameters, 16 MB) at batch 64, evaluated every epoch (DEFAULTS). Each rank runs in its own network namespace with its
link shaped by tc (``bench.netem.netem.NetEm``, a fresh one per run). ``bsp``, ``osp-auto``, ``ddp`` and
``fsdp`` (osp.train ``--sync fsdp``: FSDP2's fully_shard per layer) run on torch.distributed (Gloo, env://),
``hvd`` on Horovod (Gloo controller). All
contenders get the same epochs, batch per rank, lr and seed; the seeds loop outside the contenders,
so a drift of the (shared) machine's load touches every contender alike.

The target accuracy is the mean over seeds of BSP's final test accuracy (its last epoch's). A run's
time to accuracy is osp.train's ``wall_s`` (training time, evaluation and start-up excluded) at the
end of the first epoch whose test accuracy reaches the target ("not reached" if none does); the
speedup is BSP's mean time to the target over a contender's mean time (over the seeds where both
reached it), and per seed BSP's time over the contender's with the same seed.

    python bench/time_to_accuracy.py                         # needs root (namespaces, tc)
    python bench/time_to_accuracy.py --model cnn --channels 128 --width 15      # the CNN, more compute
    python bench/time_to_accuracy.py --seeds 0 --epochs 2 --contenders bsp,osp-auto   # a smoke run
    python bench/time_to_accuracy.py --report bench/out/time_to_accuracy.json         # re-print

Writes bench/out/time_to_accuracy.json and bench/out/time_to_accuracy.png (test accuracy against
wall time, one thin line per contender and seed) and prints markdown tables.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time

from osp.report import time_to  # the first epoch's wall time at a target accuracy

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# contender -> (osp.train options, engine)
CONTENDERS = {
    "bsp": (["--sync", "bsp"], "torch"),
    "ddp": (["--sync", "ddp"], "torch"),
    "fsdp": (["--sync", "fsdp"], "torch"),
    "hvd": (["--sync", "hvd"], "horovod"),
    "osp-auto": (["--sync", "osp", "--critical", "auto"], "torch"),
    # HSP alone (with BSP) and composed with OSP(auto) and DSync(2): for --straggler
    "hsp": (["--sync", "hsp"], "torch"),
    "hsp-osp-auto": (["--sync", "hsp", "--hsp-sync", "osp", "--critical", "auto"], "torch"),
    "hsp-dsync-2": (["--sync", "hsp", "--hsp-sync", "dsync", "--delay", "2"], "torch"),
}
COLORS = {"bsp": "tab:blue", "ddp": "tab:gray", "fsdp": "tab:olive", "hvd": "tab:orange", "osp-auto": "tab:green",
          "hsp": "tab:purple", "hsp-osp-auto": "tab:red", "hsp-dsync-2": "tab:brown"}
# a contender may carry "+fp16" / "+bf16" (osp.train --compression: osp's compression=, Horovod's
# Compression.fp16, DDP's compress hooks, FSDP2's reduce_dtype) or "+powersgd" (DDP's PowerSGD hook: rank 4,
# error feedback)
COMPRESSIONS = ("fp16", "bf16", "powersgd")
LINES = {"": "-", "fp16": "--", "bf16": "-.", "powersgd": ":"}  # the plot's line per compression
PRESETS = {"compression": ["bsp", "bsp+fp16", "ddp+fp16", "ddp+powersgd", "fsdp+fp16", "hvd+fp16", "osp-auto",
                           "osp-auto+fp16"],
           "stragglers": ["bsp", "ddp", "osp-auto", "hsp", "hsp-osp-auto"]}
TARGET_RULE = "mean over seeds of BSP's final test accuracy (last epoch)"
# per model: where compute and the allreduce are within 2x of each other at 1 Gbit/s on 2 ranks (the MLP:
# ~70 ms against ~140 ms a step, its big layer's gradient ready only at the end of the backward), or as close
# as digits allows (the CNN: ~25 ms against ~130 ms). Digits' epoch is 2 steps at batch 256 on 2 ranks,
# and each evaluation first waits for the averages in flight: the MLP is evaluated every 5 epochs
DEFAULTS = {"mlp": dict(width=32, batch_size=256, epochs=60, eval_every=5),
            "cnn": dict(width=120, batch_size=64, epochs=12, eval_every=1)}


def apply_defaults(a) -> None:
    """Fill the options left unset (None) on ``a`` with ``DEFAULTS`` of its ``a.model``."""
    for key, value in DEFAULTS[a.model].items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def split_contender(contender: str):
    """``name[+compression]`` -> (osp.train options, engine); ValueError for an unknown one."""
    name, _, comp = contender.partition("+")
    if name not in CONTENDERS or comp and comp not in COMPRESSIONS:
        raise ValueError(f"unknown contender {contender!r}: one of {','.join(CONTENDERS)}, each optionally "
                         f"+{'/+'.join(COMPRESSIONS)}")
    if comp == "powersgd" and name != "ddp":
        raise ValueError(f"unknown contender {contender!r}: +powersgd is DDP's PowerSGD hook (ddp+powersgd only)")
    opts, engine = CONTENDERS[name]
    return opts + (["--compression", comp] if comp else []), engine


def train_argv(contender: str, seed: int, a, out: str, progress: bool = False) -> list:
    opts, engine = split_contender(contender)
    return [sys.executable, "-m", "osp.train", *opts, "--backend", engine, "--epochs", str(a.epochs),
            "--batch-size", str(a.batch_size), "--lr", str(a.lr), "--model", a.model, "--eval-every", str(a.eval_every),
            "--width", str(a.width),
            "--channels", str(a.channels), "--seed", str(seed), "--json", out] + straggler_argv(a) \
        + ([] if progress else ["--no-progress"])


def straggler_argv(a) -> list:
    """``--straggler FACTOR``: the last rank that many times slower, HSP's cap on extras."""
    if getattr(a, "straggler", 1.0) == 1.0:
        return []
    return ["--max-extra", str(a.max_extra), "--straggler", f"{a.ranks - 1}:{a.straggler:g}"]


def _follow(path: str, stop: threading.Event, emit) -> None:
    """Pass the lines osp.train's rank 0 prints (its start line and one per epoch) to ``emit`` as they
    appear in its log, until ``stop`` is set and the log is read to its end."""
    fh = None
    try:
        while fh is None:
            try:
                fh = open(path)
            except OSError:
                if stop.wait(0.2):
                    return
        buf = ""
        while True:
            done = stop.is_set()
            buf += fh.read()
            *lines, buf = buf.split("\n")
            for ln in lines:
                if ln.startswith(("osp.train:", "epoch ")):
                    emit(ln)
            if done:
                return
            stop.wait(0.2)
    finally:
        if fh is not None:
            fh.close()


def run_one(NetEm, contender: str, seed: int, a, tmp: str, emit=None) -> dict:
    """One ``osp.train`` run of ``contender`` on ``a.ranks`` ranks behind links of ``a.rate``: its
    result JSON, or {"error": ...} with the tail of rank 0's log. ``emit``: called with each line of
    rank 0's progress (its start line and one per epoch) as it comes."""
    out = os.path.join(tmp, f"{contender}-{seed}.json")
    log = os.path.join(tmp, f"log-{contender}-{seed}")
    engine = split_contender(contender)[1]
    for old in [out] + [f"{log}.rank{i}.log" for i in range(a.ranks)]:  # of an earlier run into the same place
        if os.path.exists(old):
            os.remove(old)
    stop, follower = threading.Event(), None
    if emit is not None:
        follower = threading.Thread(target=_follow, args=(log + ".rank0.log", stop, emit), daemon=True)
        follower.start()
    try:
        with NetEm(a.ranks, rate=None if a.rate == "none" else a.rate) as net:
            codes = net.run(engine, train_argv(contender, seed, a, out, progress=emit is not None),
                            timeout=a.run_timeout, env={"PYTHONPATH": ROOT + "/python:" + ROOT}, log_prefix=log)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 - a failed setup is reported like a failed run
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if follower is not None:
            stop.set()
            follower.join(timeout=5)
    if any(codes) or not os.path.exists(out):
        try:
            with open(log + ".rank0.log") as fh:
                tail = fh.read()[-2000:]
        except OSError:
            tail = ""
        return {"error": f"exit codes {codes}: {tail}"}
    with open(out) as fh:
        return json.load(fh)


def model_name(a) -> str:
    if getattr(a, "model", "cnn") == "mlp":
        return f"DigitsMLP width {a.width}"
    return f"DigitsCNN width {a.width} channels {a.channels}"


def short(error: str) -> str:
    """A run's error in one line: the exit codes and the log's last line (the exception, usually)."""
    head, _, log = error.partition(": ")
    last = [ln for ln in log.splitlines() if ln.strip()][-1:] if log else []
    return f"{head}: {last[0].strip()}"[:200] if last else error.splitlines()[0][:200]


def summarize(runs: dict, contenders: list, seeds: list, bases=("bsp",)) -> dict:
    """runs: {"contender/seed": result} -> the target, per-run rows and per-contender means, with each
    contender's speedup over each of ``bases`` (``speedup_vs_<base>``: the base's mean time to the target
    over the contender's, over the seeds where both reached it; per row, the same seed's ratio)."""
    bsp_final = [runs[f"bsp/{s}"]["final_test_acc"] for s in seeds if "error" not in runs.get(f"bsp/{s}", {"error": 1})]
    if not bsp_final:
        return {"target": None, "target_rule": TARGET_RULE, "rows": [], "contenders": {}}
    target = statistics.mean(bsp_final)
    rows, per = [], {}
    for c in contenders:
        for s in seeds:
            r = runs.get(f"{c}/{s}", {"error": "not run"})
            if "error" in r:
                rows.append({"contender": c, "seed": s, "error": r["error"]})
                continue
            t = time_to(r, target)
            row = {"contender": c, "seed": s, "final_test_acc": r["final_test_acc"], "time_to_target_s": t,
                   "train_s": r["train_s"], "samples_per_s": r["samples_per_s"],
                   "critical_fraction": r.get("osp_stats", {}).get("mean", {}).get("critical_fraction")}
            for base in bases:
                tb = time_to(runs.get(f"{base}/{s}", {}), target)
                row[f"speedup_vs_{base}"] = tb / t if t and tb else None
            rows.append(row)
    for c in contenders:
        mine = [x for x in rows if x["contender"] == c and "error" not in x]
        reached = [x for x in mine if x["time_to_target_s"] is not None]
        per[c] = {
            "runs": len(mine), "reached": len(reached),
            "final_test_acc": statistics.mean(x["final_test_acc"] for x in mine) if mine else None,
            "time_to_target_s": statistics.mean(x["time_to_target_s"] for x in reached) if reached else None,
            "samples_per_s": statistics.mean(x["samples_per_s"] for x in mine) if mine else None,
            "train_s": statistics.mean(x["train_s"] for x in mine) if mine else None,
        }
        for base in bases:
            both = [(x, next((b for b in rows if b["contender"] == base and b["seed"] == x["seed"]
                              and b.get("time_to_target_s") is not None), None)) for x in reached]
            both = [(x, b) for x, b in both if b is not None]
            per[c][f"speedup_vs_{base}"] = (statistics.mean(b["time_to_target_s"] for _, b in both)
                                            / statistics.mean(x["time_to_target_s"] for x, _ in both)) if both else None
    return {"target": target, "target_rule": TARGET_RULE, "rows": rows, "contenders": per}


def tables(summary: dict, a, bases=("bsp",)) -> str:
    if summary["target"] is None:
        return "no BSP run finished: no target accuracy, no table"
    head = (f"{a.ranks} ranks behind {a.rate} links; {model_name(a)}"
            f"{' (' + str(a.params) + ' parameters)' if getattr(a, 'params', None) else ''}, SGD momentum 0.9, "
            f"lr {a.lr}, batch {a.batch_size} per rank, {a.epochs} epochs (evaluated every "
            f"{getattr(a, 'eval_every', 1)}), seeds {a.seeds}"
            + (f", rank {a.ranks - 1} {a.straggler:g}x slower" if getattr(a, "straggler", 1.0) != 1.0 else "") + ".\n"
            f"Target: {100 * summary['target']:.2f}% = {summary['target_rule']}. Times are training wall time "
            f"(evaluation and start-up excluded) at the end of the first epoch reaching it; speedup vs X = X's "
            f"time / the contender's.\n")
    vs = "".join(f" speedup vs {b} |" for b in bases)
    dash = "---|" * len(bases)

    def ratios(x):
        out = ""
        for b in bases:
            r = x[f"speedup_vs_{b}"]
            out += f" {'-' if r is None else f'{r:.2f}x'} |"
        return out

    lines = [head, f"| contender | seed | final test acc | time to target (s) |{vs} train s | samples/s | "
             "critical share |", f"|---|---|---|---|{dash}---|---|---|"]
    for x in summary["rows"]:
        if "error" in x:
            lines.append(f"| {x['contender']} | {x['seed']} | failed: {short(x['error'])} | |{' |' * len(bases)} | | |")
            continue
        t, cf = x["time_to_target_s"], x["critical_fraction"]
        lines.append(f"| {x['contender']} | {x['seed']} | {100 * x['final_test_acc']:.2f}% | "
                     f"{'not reached' if t is None else f'{t:.2f}'} |{ratios(x)} "
                     f"{x['train_s']:.2f} | {x['samples_per_s']:.0f} | {'-' if cf is None else f'{cf:.2f}'} |")
    lines += ["", f"| contender | mean final test acc | reached target | mean time to target (s) |{vs} "
              "mean train s | mean samples/s |", f"|---|---|---|---|{dash}---|---|"]
    for c, m in summary["contenders"].items():
        if not m["runs"]:
            lines.append(f"| {c} | failed | | |{' |' * len(bases)} | |")
            continue
        t = m["time_to_target_s"]
        lines.append(f"| {c} | {100 * m['final_test_acc']:.2f}% | {m['reached']}/{m['runs']} | "
                     f"{'not reached' if t is None else f'{t:.2f}'} |{ratios(m)} "
                     f"{m['train_s']:.2f} | {m['samples_per_s']:.0f} |")
    return "\n".join(lines)


def plot(runs: dict, contenders: list, seeds: list, target, rate: str, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    for c in contenders:
        for i, s in enumerate(seeds):
            r = runs.get(f"{c}/{s}", {})
            if "epochs" not in r:
                continue
            name, _, comp = c.partition("+")
            ax.plot([e["wall_s"] for e in r["epochs"]], [100 * e["test_acc"] for e in r["epochs"]],
                    color=COLORS.get(name), ls=LINES[comp], lw=0.9, alpha=0.8, marker=".", ms=3,
                    label=c if i == 0 else None)
    if target is not None:
        ax.axhline(100 * target, color="k", ls="--", lw=0.8, label=f"target {100 * target:.2f}% (BSP final)")
    ax.set_xlabel("training wall time (s)")
    ax.set_ylabel("digits test accuracy (%)")
    ax.set_ylim(80 if target is None else min(80, 100 * target - 10), 100)  # a short run ends lower
    ax.grid(alpha=0.3)
    ax.set_title(f"Time to accuracy, 2 ranks behind {rate} links")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def pick(a):
    """The contenders to run (BSP first: it sets the target) and the speedups' baselines."""
    names = PRESETS.get(a.contenders, a.contenders.split(","))
    versus = a.versus or ("ddp+fp16" if a.contenders == "compression" else None)
    contenders = ["bsp"] + [c for c in names if c != "bsp"]
    if versus and versus not in contenders:
        raise ValueError(f"--versus {versus}: not among the contenders {','.join(contenders)}")
    return contenders, ("bsp",) + ((versus,) if versus and versus != "bsp" else ())


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", default="1gbit", help="every rank's link rate (tc tbf), e.g. 1gbit, 500mbit; none: "
                    "namespaces without shaping")
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--contenders", default=",".join(CONTENDERS),
                    help=f"of {','.join(CONTENDERS)}, each optionally +{'/+'.join(COMPRESSIONS)} (e.g. ddp+fp16), "
                    f"or a preset: " + "; ".join(f"{k}: {','.join(v)}" for k, v in PRESETS.items()))
    ap.add_argument("--versus", default=None, metavar="CONTENDER",
                    help="a second baseline for the speedups (beside BSP), e.g. ddp+fp16; the compression preset's "
                    "default")
    ap.add_argument("--model", choices=sorted(DEFAULTS), default="mlp", help="mlp: DigitsMLP; cnn: DigitsCNN "
                    "(osp.train --model); each sets the defaults of the next four: " + "; ".join(
                        f"{m}: " + ", ".join(f"{k} {v}" for k, v in d.items()) for m, d in DEFAULTS.items()))
    ap.add_argument("--epochs", type=int, default=None)
    ap.add_argument("--width", type=int, default=None, help="DigitsMLP: hidden layers of 64*width (32: 4.35M "
                    "parameters); DigitsCNN: fc1 of 64*width (120: 4.02M parameters)")
    ap.add_argument("--channels", type=int, default=16, help="DigitsCNN's first conv layer")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank")
    ap.add_argument("--eval-every", type=int, default=None, metavar="K", help="evaluate every K epochs (osp.train "
                    "--eval-every): digits' epoch is a few steps at large batches, and each evaluation waits for "
                    "the averages in flight")
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--straggler", type=float, default=1.0, metavar="FACTOR", help="the last rank computes FACTOR "
                    "times slower (osp.train --straggler); the stragglers preset runs HSP alone and composed")
    ap.add_argument("--max-extra", type=int, default=4, help="HSP's extra micro-batches per step (with --straggler)")
    ap.add_argument("--run-timeout", type=float, default=600, help="seconds per run")
    ap.add_argument("--json", default=os.path.join(ROOT, "bench", "out", "time_to_accuracy.json"))
    ap.add_argument("--plot", default=None, help="default: the --json path with .png")
    ap.add_argument("--report", default=None, metavar="JSON", help="only print the tables of a saved run")
    a = ap.parse_args(argv)
    if a.report:
        sys.path.insert(0, ROOT)
        from bench.saved import load_saved

        a.model, a.eval_every = "cnn", 1  # what runs saved before either option existed were
        saved = load_saved(a, a.report)
        contenders, bases = pick(a)
        seeds = [int(s) for s in a.seeds.split(",")]
        print(tables(summarize(saved["runs"], contenders, seeds, bases), a, bases))
        return 0
    apply_defaults(a)
    try:
        contenders, bases = pick(a)
        for c in contenders:
            split_contender(c)
    except ValueError as e:
        ap.error(str(e))
    seeds = [int(s) for s in a.seeds.split(",")]
    sys.path.insert(0, ROOT)
    from bench.netem.netem import NetEm
    from osp.train import build_model

    a.params = sum(p.numel() for p in build_model(a.model, a.width, a.channels).parameters())
    print(f"{model_name(a)}: {a.params} parameters "
          f"({4 * a.params / 1e6:.1f} MB of fp32 gradient a step); {a.ranks} ranks behind {a.rate}", flush=True)
    runs, t_start = {}, time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            for c in contenders:
                r = run_one(NetEm, c, seed, a, tmp)
                runs[f"{c}/{seed}"] = r
                msg = "failed: " + short(r["error"]) if "error" in r else (
                    f"final test acc {100 * r['final_test_acc']:.2f}%  train {r['train_s']:.2f} s  "
                    f"{r['samples_per_s']:.0f} samples/s")
                print(f"[{time.monotonic() - t_start:5.0f}s] seed {seed} {c:9s} {msg}", flush=True)
    summary = summarize(runs, contenders, seeds, bases)
    keep = ("config", "epochs", "final_test_acc", "samples_per_s", "train_s", "steps", "osp_stats", "error")
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as fh:
        json.dump({"config": vars(a), "summary": summary,
                   "runs": {k: {f: v for f, v in r.items() if f in keep} for k, r in runs.items()}}, fh, indent=1)
    print(f"results: {a.json}")
    plot(runs, contenders, seeds, summary["target"], a.rate, a.plot or a.json[:-5] + ".png")
    print()
    print(tables(summary, a, bases))
    return 0 if all("error" not in r for r in runs.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
