"""`make demo`: a first look at osp. BSP, then OSP (``--critical auto``), on 2 ranks, side by side.

Where links cannot be shaped (not root, no ``ip``/``tc``) it says so first, then emulates the link in user space
(``osp.train --link``, ``osp.linkemu``: every collective completes no earlier than a ring allreduce of its bytes
takes at ``--rate``, one at a time; not a real network) and runs the contenders side by side: osp's BSP, OSP
auto, DSync(2), Horovod's optimizer (where horovodrun is installed) and DDP, ``--repeats`` times each, taking
turns; the table gives each one's median samples/s with its range, and its ratio to BSP and to DDP with the
ratio's spread (``osp.report``).

Where it can (root, ``ip`` and ``tc`` present, network namespaces can be made), the two ranks run in
network namespaces whose links are shaped to 1 Gbit/s (bench/netem), training a 4.3M-parameter digits
MLP (``osp.train --model mlp --width 32``: 17 MB of gradient a step, so the network matters) at batch
256 per rank, where a step computes about half as long as its allreduce takes; the table shows final
accuracy, time to BSP's final accuracy and samples/s. ``--model cnn`` runs the 4M-parameter digits CNN
(``--width 120``, batch 64) instead, whose compute is a fifth of its allreduce. ``--loopback`` runs the
small default model under ``horovodrun`` on plain loopback, where there is little for OSP to hide.

    python scripts/demo.py [--model mlp|cnn] [--epochs N] [--rate 1gbit] [--latency 0us] [--repeats 3]
                           [--emulate | --loopback]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
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


# the contenders of the emulated demo: osp.train's options and the engine each runs on
EMULATED = {"bsp": (["--sync", "bsp"], "torch"), "osp-auto": (["--sync", "osp", "--critical", "auto"], "torch"),
            "dsync-2": (["--sync", "dsync", "--delay", "2"], "torch"), "hvd": (["--sync", "hvd"], "horovod"),
            "ddp": (["--sync", "ddp"], "torch")}


def horovodrun_path():
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    return exe if os.path.exists(exe) else shutil.which("horovodrun")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(engine: str, argv: list, log: str, timeout: float) -> int:
    """2 ranks of ``python -m osp.train ARGV``: under horovodrun --gloo (horovod), or started here as torchrun
    --standalone would start them (torch: RANK, WORLD_SIZE, MASTER_ADDR/PORT; without torchrun's agent, a few
    seconds less a run). Rank 0's output goes to ``log``; past ``timeout`` every rank is killed. The exit code."""
    from bench.netem.netem import wait_all

    env = dict(os.environ, OMP_NUM_THREADS="1")
    train = [sys.executable, "-m", "osp.train", *argv]
    with open(log, "w") as out:
        if engine == "horovod":
            procs = [subprocess.Popen([horovodrun_path(), "--gloo", "-np", "2", "-H", "localhost:2", *train], cwd=ROOT,
                                      env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)]
        else:
            port, procs = str(free_port()), []
            for r in range(2):
                e = dict(env, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
                procs.append(subprocess.Popen(train, cwd=ROOT, env=e, stdout=out if r == 0 else subprocess.DEVNULL,
                                              stderr=subprocess.STDOUT, start_new_session=True))
        codes, timed_out = wait_all(procs, timeout)
    return 124 if timed_out else next((c for c in codes if c), 0)


def emulated(a, reason: str) -> int:
    """The contenders side by side behind a link emulated in user space (osp.train --link), ``a.repeats`` times
    each, taking turns; then osp.report's table of medians, ranges and ratios."""
    from bench.time_to_accuracy import apply_defaults  # per model: width, batch
    from osp import linkemu
    from osp.report import notes, steady_rate, table
    from osp.train import build_model

    spec = a.rate if not a.latency else f"{a.rate},{a.latency}"
    try:
        link = linkemu.parse_link(spec)
    except ValueError as e:
        say(f"demo: --rate/--latency: {e}")
        return 2
    say(f"No shaped network for this demo: {reason}.")
    say(f"So the link is emulated in user space instead -- {link.describe()}.")
    say("Every collective osp, Horovod's optimizer and DDP issue completes no earlier than a ring allreduce of its\n"
        "bytes takes at that rate, one collective at a time; the ranks sleep meanwhile (no CPU spins), so compute\n"
        "overlaps communication as it would on a real link. The collectives themselves run on loopback.\n"
        "Real shaped links (tc, network namespaces; run this as root) are measured in docs/benchmarks.md:\n"
        "'Demo' (OSP auto 1.38x BSP's samples/s behind 1 Gbit/s) and 'Throughput under a network bottleneck'.\n")
    have_hvd = horovodrun_path() is not None
    names = [c for c in a.contenders.split(",") if c]
    unknown = [c for c in names if c not in EMULATED]
    if unknown:
        say(f"demo: unknown contender(s) {unknown}: of {','.join(EMULATED)}")
        return 2
    if "hvd" in names and not have_hvd:
        names.remove("hvd")
        say("(horovodrun not found: Horovod's optimizer is left out)")
    # an epoch of the MLP is 2 steps at batch 256 on 2 ranks, of the CNN 9 at batch 64: evaluations at steps 10, 20
    # and 30 (MLP) or 18 and 36 (CNN), the throughput counted from the first past step 10 (auto has settled)
    epochs, every = (a.epochs or 15, a.eval_every or 5) if a.model == "mlp" else (a.epochs or 4, a.eval_every or 2)
    apply_defaults(a)
    params = sum(p.numel() for p in build_model(a.model, a.width, 16).parameters())
    say(f"Model: the digits {a.model.upper()} widened to {params / 1e6:.2f}M parameters (--width {a.width}: "
        f"{4 * params / 1e6:.0f} MB of gradient a step), batch {a.batch_size} per rank, 2 ranks, SGD momentum 0.9, lr "
        f"{a.lr}, {epochs} epochs (evaluated every {every}), seed 0.\nContenders: {', '.join(names)}; {a.repeats} "
        "runs each, taking turns. samples/s counts the steps after step 10 (OSP auto measures and tries shares "
        "before), every contender alike.\n")
    out_dir = a.out or os.path.join(RUNS, "demo-emulated")
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old.endswith((".json", ".log")):
            os.remove(os.path.join(out_dir, old))
    common = ["--model", a.model, "--width", str(a.width), "--batch-size", str(a.batch_size), "--epochs", str(epochs),
              "--eval-every", str(every), "--lr", str(a.lr), "--link", spec, "--no-progress"]
    results, failed, t_all = [], [], time.monotonic()
    for rep in range(a.repeats):
        for name in names:
            opts, engine = EMULATED[name]
            path = os.path.join(out_dir, f"{name}-{rep + 1}.json")
            log = os.path.join(out_dir, f"{name}-{rep + 1}.log")
            t0 = time.monotonic()
            code = launch(engine, [*opts, "--backend", engine, *common, "--json", path], log, a.run_timeout)
            dt = time.monotonic() - t0
            if code != 0 or not os.path.exists(path):
                failed.append(name)
                tail = open(log).read().strip().splitlines()[-1:] if os.path.exists(log) else []
                say(f"  {name} run {rep + 1}: failed (exit code {code}; {tail[0] if tail else 'no output'}; log: "
                    f"{os.path.relpath(log, ROOT)})")
                continue
            with open(path) as fh:
                r = json.load(fh)
            results.append(r)
            rate, steady = steady_rate(r)
            say(f"  {name:9s} run {rep + 1}: {rate:6.0f} samples/s{'' if steady else ' (whole run)'}, test acc "
                f"{100 * r['final_test_acc']:.2f}%  ({dt:.0f} s)")
            if rep == 0:
                for line in r.get("decisions") or []:
                    if not line.startswith(("no slow rank", "arrivals")):
                        say(f"      {line}")
    say(f"\n({time.monotonic() - t_all:.0f} s in all; the runs' JSON and rank 0's logs: "
        f"{os.path.relpath(out_dir, ROOT)}/; the table again: python -m osp.report "
        f"{os.path.relpath(out_dir, ROOT)}/*.json)\n")
    if not results:
        return 1
    say(table(results))
    say()
    for line in notes(results):
        say("- " + line)
    say(f"\nAll of the above: {link.describe()}, on one machine whose 2 cores the ranks share.\nFor real shaped "
        "links see docs/benchmarks.md ('Demo', 'Throughput under a network bottleneck').")
    return 1 if failed else 0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=None, help="epochs per run (default behind the shaped link: 60 "
                    "for the MLP, 12 for the CNN; behind the emulated one: 15 for the MLP, 4 for the CNN; osp.train's "
                    "15 on loopback)")
    ap.add_argument("--rate", default="1gbit", help="the link's rate, shaped or emulated (bits, as tc writes them: "
                    "1gbit, 100mbit)")
    ap.add_argument("--model", choices=["cnn", "mlp"], default="mlp", help="behind a shaped or emulated link: mlp "
                    "(DigitsMLP, 4.35M parameters) or cnn (DigitsCNN, 4.02M)")
    ap.add_argument("--width", type=int, default=None, help="behind a shaped or emulated link (default: 32 for the "
                    "MLP, 120 for the CNN)")
    ap.add_argument("--batch-size", type=int, default=None, help="per rank, behind a shaped or emulated link "
                    "(default: 256 for the MLP, 64 for the CNN)")
    ap.add_argument("--eval-every", type=int, default=None, help="evaluate every K epochs behind a shaped link "
                    "(default: 5 for the MLP, 1 for the CNN) or an emulated one (5 for the MLP, 2 for the CNN)")
    ap.add_argument("--lr", type=float, default=0.1, help="behind the shaped link")
    ap.add_argument("--latency", default=None, help="emulated link: added latency per collective (e.g. 200us; "
                    "default none, as the shaped link has)")
    ap.add_argument("--repeats", type=int, default=3, help="emulated link: runs of each contender")
    ap.add_argument("--contenders", default=",".join(EMULATED), help="emulated link: which, of "
                    f"{','.join(EMULATED)}")
    ap.add_argument("--run-timeout", type=float, default=300, help="emulated link: seconds a run may take")
    ap.add_argument("--out", default=None, help="emulated link: where the runs' JSON and logs go (default: "
                    "runs/demo-emulated)")
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--emulate", action="store_true", help="the emulated link even where links can be shaped")
    how.add_argument("--loopback", action="store_true", help="plain loopback (no emulated link), even where links "
                     "can be shaped")
    a = ap.parse_args(argv)
    if a.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {a.repeats}")
    sys.path.insert(0, ROOT)  # bench.netem, bench.time_to_accuracy
    if a.loopback:
        return loopback(a, "asked for with --loopback")
    reason = "asked for with --emulate" if a.emulate else why_no_netem(a.rate)
    if reason is not None:
        return emulated(a, reason)
    from bench.time_to_accuracy import apply_defaults  # per model: width, batch, epochs, --eval-every

    apply_defaults(a)
    return shaped(a)


if __name__ == "__main__":
    sys.exit(main())
