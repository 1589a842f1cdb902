"""`make demo`: a first look at osp. BSP, then OSP (``--critical auto``), on 2 ranks, side by side.

Where it can (root, ``ip`` and ``tc`` present, network namespaces can be made), the two ranks run in
network namespaces whose links are shaped to 1 Gbit/s (bench/netem), training a 4.3M-parameter digits
MLP (``osp.train --model mlp --width 32``: 17 MB of gradient a step, so the network matters) at batch
256 per rank, where a step computes about half as long as its allreduce takes; the table shows final
accuracy, time to BSP's final accuracy and samples/s. ``--model cnn`` runs the 4M-parameter digits CNN
(``--width 120``, batch 64) instead, whose compute is a fifth of its allreduce. Elsewhere it falls back
to the small default model under ``horovodrun`` on loopback, and says why and what that table can and
cannot show.

    python scripts/demo.py [--model mlp|cnn] [--epochs N] [--rate 1gbit] [--loopback]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = os.path.join(ROOT, "runs")


def say(text: str = "") -> None:
    print(text, flush=True)


def why_no_netem(rate: str):
    """None if 2 ranks behind shaped links can run here, else why not (one line)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "not running as root (network namespaces, veth pairs and tc need root)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` not found (it comes with iproute2: apt-get install iproute2)"
    try:
        from bench.netem.netem import NetEm

        with NetEm(2, rate=rate, tag=f"d{os.getpid() % 1000}"):  # make the namespaces and shaped links once
            pass
    except Exception as e:  # noqa: BLE001 - any failure means: no shaped links here
        return f"could not make network namespaces with shaped links ({type(e).__name__}: {e})"
    return None


def shaped(a) -> int:
    from bench.netem.netem import NetEm
    from bench.time_to_accuracy import run_one, short
    from osp.report import table, time_to
    from osp.train import build_model

    params = sum(p.numel() for p in build_model(a.model, a.width, 16).parameters())
    say(f"Two ranks, each in its own network namespace, its link shaped to {a.rate} in both directions (tc tbf).\n"
        f"Model: the digits {a.model.upper()} widened to {params / 1e6:.1f}M parameters ({4 * params / 1e6:.0f} MB "
        f"of gradient to average every step); SGD momentum 0.9, lr {a.lr}, batch {a.batch_size} per rank, "
        f"{a.epochs} epochs (evaluated every {a.eval_every}), seed 0. "
        f"The same job runs twice: BSP (every gradient averaged before each update), then OSP auto (the "
        f"most important blocks averaged before the update, the rest in the background during the next step, "
        f"then corrected exactly).\n")
    out_dir = os.path.join(RUNS, "demo-netem")
    os.makedirs(out_dir, exist_ok=True)
    cfg = argparse.Namespace(ranks=2, rate=a.rate, epochs=a.epochs, batch_size=a.batch_size, lr=a.lr, width=a.width,
                             channels=16, model=a.model, eval_every=a.eval_every, run_timeout=600)
    results = {}
    for name, title in (("bsp", "BSP"), ("osp-auto", "OSP auto")):
        say(f"== {title} ==")
        t0 = time.monotonic()
        r = run_one(NetEm, name, 0, cfg, out_dir, emit=lambda ln: say("  " + ln))
        if "error" in r:
            say(f"  {title} failed after {time.monotonic() - t0:.0f} s: {short(r['error'])}")
            say(f"  (logs: {out_dir}/log-{name}-0.rank*.log)")
            return 1
        results[name] = r
        say()
    bsp, osp_ = results["bsp"], results["osp-auto"]
    for name, r in results.items():  # where `python -m osp.report` finds them again
        with open(os.path.join(RUNS, f"demo-{name}.json"), "w") as fh:
            json.dump(r, fh, indent=1)
    say(table([bsp, osp_]))
    target = bsp["final_test_acc"]
    tb, to = time_to(bsp, target), time_to(osp_, target)
    rel = osp_["samples_per_s"] / bsp["samples_per_s"]
    say(f"\nBSP ends at {100 * target:.2f}% test accuracy after {bsp['train_s']:.1f} s of training "
        f"({bsp['samples_per_s']:.0f} samples/s); OSP auto ends at {100 * osp_['final_test_acc']:.2f}% after "
        f"{osp_['train_s']:.1f} s ({osp_['samples_per_s']:.0f} samples/s, {rel:.2f}x).")
    if to is None:
        say(f"OSP auto did not reach BSP's final accuracy ({100 * target:.2f}%) within {a.epochs} epochs.")
    else:
        say(f"Time to BSP's final accuracy ({100 * target:.2f}%): BSP {tb:.1f} s, OSP auto {to:.1f} s "
            f"({tb / to:.2f}x).")
    say("(Times are training wall time, evaluation excluded; one seed on a 2-core machine, so a few percent either "
        "way is noise. For several seeds and against DDP and Horovod's optimizer: `make bench-tta`.)")
    return 0


def loopback(a, reason: str) -> int:
    say(f"No shaped network for this demo: {reason}.")
    say("Falling back to the loopback demo: BSP, then OSP auto, on 2 ranks under horovodrun over 127.0.0.1 with\n"
        "the small default digits CNN (38K parameters).\n"
        "On loopback communication is nearly free and this model's steps take a few milliseconds, so there is\n"
        "little for OSP to hide: OSP auto spends its first 10 steps timing the network and trying shares, then\n"
        "keeps whichever was measurably fastest (often BSP's own steps). Expect about BSP's speed or somewhat\n"
        "less over a short run. On a slow link with a larger model the picture turns: OSP hides most of the\n"
        "averaging behind the next step's compute. To see that, run as root: `make demo` (it shapes a 1 Gbit/s\n"
        "link itself), `make bench` (throughput against Horovod and DDP) or `make bench-tta` (time to accuracy).\n")
    os.makedirs(RUNS, exist_ok=True)
    hvdrun = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(hvdrun):
        hvdrun = shutil.which("horovodrun")
    if hvdrun:
        launch = [hvdrun, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, "-m", "osp.train"]
    else:
        say("(horovodrun not found: launching with torchrun instead)")
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                  "-m", "osp.train", "--backend", "torch"]
    extra = ["--epochs", str(a.epochs)] if a.epochs is not None else []
    paths = []
    for name, opts in (("bsp", ["--sync", "bsp"]), ("osp", ["--sync", "osp", "--critical", "auto"])):
        path = os.path.join(RUNS, f"demo-{name}.json")
        cmd = launch + opts + extra + ["--json", path]
        say("$ " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in cmd))
        if os.path.exists(path):
            os.remove(path)
        p = subprocess.run(cmd, cwd=ROOT)
        if p.returncode != 0 or not os.path.exists(path):
            say(f"the {name} run failed (exit code {p.returncode})")
            return 1
        paths.append(path)
    say()
    from osp.report import main as report

    report(paths)
    say(f"\n(Loopback, because {reason}. OSP's x BSP here is what loopback shows, not what a slow "
        "network shows: see `make bench` / `make bench-tta`, as root.)")
    return 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=None, help="epochs per run (default behind the shaped link: 60 "
                    "for the MLP, 12 for the CNN; osp.train's 15 on loopback)")
    ap.add_argument("--rate", default="1gbit", help="the shaped link's rate")
    ap.add_argument("--model", choices=["cnn", "mlp"], default="mlp", help="behind the shaped link: mlp "
                    "(DigitsMLP, 4.35M parameters) or cnn (DigitsCNN, 4.02M)")
    ap.add_argument("--width", type=int, default=None, help="behind the shaped link (default: 32 for the MLP, 120 "
                    "for the CNN)")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank, behind the shaped link (default: 256 "
                    "for the MLP, 64 for the CNN)")
    ap.add_argument("--eval-every", type=int, default=None, help="evaluate every K epochs behind the shaped link "
                    "(default: 5 for the MLP, 1 for the CNN)")
    ap.add_argument("--lr", type=float, default=0.1, help="behind the shaped link")
    ap.add_argument("--loopback", action="store_true", help="the loopback demo even where links can be shaped")
    a = ap.parse_args(argv)
    sys.path.insert(0, ROOT)  # bench.netem, bench.time_to_accuracy
    reason = "asked for with --loopback" if a.loopback else why_no_netem(a.rate)
    if reason is not None:
        return loopback(a, reason)
    from bench.time_to_accuracy import apply_defaults  # per model: width, batch, epochs, --eval-every

    apply_defaults(a)
    return shaped(a)


if __name__ == "__main__":
    sys.exit(main())
