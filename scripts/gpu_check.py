"""`make gpu-check`: the CUDA side of osp on a host with one NVIDIA GPU, from the checkout alone.

No install, no network, no Horovod: the host's python (the Makefile passes .venv/bin/python where there is
one, else python3) with a CUDA build of torch, pytest and ninja, and nvcc. About 10 minutes at most. The
steps run in order, each timed, logged to build/gpu-check/STEP.log and reported PASS or FAIL; a failure
does not stop the steps after it, and the exit status is 1 when any failed:

  1. preflight  torch sees a CUDA device; nvcc is found, its CUDA major version matching torch's
  2. build      FORCE_CUDA=1 python setup.py build_ext --inplace, for the device's architecture only;
                then torch.ops.osp must have CUDA kernels (osp.ops._CUDA_BUILT) and one must run
  3. tests      pytest on the CUDA cases: tests/test_ops.py -k cuda, tests/test_optimizer.py -k cuda,
                tests/test_cuda.py, tests/test_broadcast.py and tests/test_timing.py -k cuda (no -x; JUnit
                XML and -rA summaries in build/gpu-check/)
  4. bench      bench/kernels.py --device cuda: each kernel's GB/s against copy_ of the same bytes and
                against the device's peak; score/split_blocks on 100M fp32 elements with one block of the
                whole tensor against blocks of 4096
  5. report     bench/results/gpu.json (device, versions, each step's status and seconds, the test counts,
                the kernel table) and a markdown summary to paste into README

Where torch sees no GPU, or there is no nvcc, it prints this plan and why it cannot run, builds nothing
and exits 2. --list prints the plan and exits 0 on any machine.

    python scripts/gpu_check.py [--list] [--only build,tests,bench] [--out bench/results/gpu.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORK = os.path.join(ROOT, "build", "gpu-check")
RESULTS = os.path.join("bench", "results", "gpu.json")

# (name, what it does, how long it takes on one GPU with 16 cores)
STEPS = [
    ("preflight", "torch sees a CUDA device (torch.cuda.is_available()); nvcc found, its CUDA major = torch's",
     "seconds"),
    ("build", "FORCE_CUDA=1 python setup.py build_ext --inplace for the device's arch (TORCH_CUDA_ARCH_LIST); "
              "torch.ops.osp has CUDA kernels (osp.ops._CUDA_BUILT) and one runs", "2-4 minutes"),
    ("tests", "pytest tests/test_ops.py -k cuda; tests/test_optimizer.py -k cuda; tests/test_cuda.py; "
              "tests/test_broadcast.py and tests/test_timing.py -k cuda "
              "(no -x; JUnit XML and -rA summaries in build/gpu-check/)", "2-4 minutes"),
    ("bench", "bench/kernels.py --device cuda: GB/s of each kernel against copy_ and the device's peak; "
              "score/split_blocks on 100M fp32 elements, one block of the whole tensor against blocks of 4096",
     "about 1 minute"),
    ("report", f"{RESULTS} (device, versions, steps, test counts, kernel GB/s) and a markdown summary",
     "seconds"),
]
OPTIONAL = ("build", "tests", "bench")  # --only chooses among these; preflight and report always run

# (label, pytest arguments, timeout in seconds)
TEST_RUNS = [
    ("test_ops.py -k cuda", ["tests/test_ops.py", "-k", "cuda"], 240),
    ("test_optimizer.py -k cuda", ["tests/test_optimizer.py", "-k", "cuda"], 120),
    ("test_cuda.py", ["tests/test_cuda.py"], 300),
    # a CUDA rank's state broadcast onto its own device; CUDA-event intervals time the device
    ("test_broadcast.py, test_timing.py -k cuda",
     ["tests/test_broadcast.py", "tests/test_timing.py", "-k", "cuda"], 120),
]
BUILD_TIMEOUT = 420  # bounds against a hang, well above the times STEPS gives
BENCH_TIMEOUT = 240


def plan_text() -> str:
    lines = ["make gpu-check: the CUDA side of osp on this host's GPU, from the checkout alone (about 10 minutes "
             "at most):"]
    for i, (name, what, how_long) in enumerate(STEPS, 1):
        lines.append(f"  {i}. {name:<10} {what} ({how_long})")
    return "\n".join(lines)


# -- preflight --------------------------------------------------------------------------------------------


def find_nvcc() -> Optional[str]:
    """nvcc as torch.utils.cpp_extension would find it: $NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin."""
    candidates = [os.environ.get("NVCC") or None]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def find_cuda_home(nvcc: Optional[str]) -> Optional[str]:
    """The toolkit the build uses (torch.utils.cpp_extension runs $CUDA_HOME/bin/nvcc): $CUDA_HOME,
    $CUDA_PATH, the one ``nvcc`` lives in (or links to), /usr/local/cuda; the first with nvcc and headers.
    (An nvcc on PATH may be a wrapper script elsewhere, e.g. /usr/local/bin/nvcc.)"""
    candidates = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")]
    if nvcc:
        candidates += [os.path.dirname(os.path.dirname(nvcc)), os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))]
    candidates.append("/usr/local/cuda")
    for c in candidates:
        if c and os.path.isfile(os.path.join(c, "bin", "nvcc")) and \
                os.path.isfile(os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    return None


def nvcc_version(nvcc: str) -> Optional[str]:
    try:
        out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def driver_version() -> Optional[str]:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.splitlines()[0].strip() if out else None


def preflight() -> Tuple[Dict, List[str]]:
    """(what this host has, the reasons the check cannot run here: empty when it can)."""
    info: Dict = {"python": sys.executable, "python_version": platform.python_version(), "host": platform.node()}
    reasons: List[str] = []
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - any failure to import is a reason to stop
        return info, [f"{sys.executable} cannot import torch ({e})"]
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.version.cuda is None:
        reasons.append(f"torch {torch.__version__} is built without CUDA (torch.version.cuda is None)")
    elif not torch.cuda.is_available():
        reasons.append("no CUDA device visible to torch (torch.cuda.is_available() is False"
                       + (f"; CUDA_VISIBLE_DEVICES={visible!r}" if visible is not None else "") + ")")
    else:
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, capability=f"{p.major}.{p.minor}", devices=torch.cuda.device_count(),
                    memory_gib=round(p.total_memory / 2 ** 30, 1), driver=driver_version())
    try:
        import setuptools  # noqa: F401  (torch.utils.cpp_extension builds through it)
    except ImportError:
        reasons.append(f"{sys.executable} has no setuptools (torch.utils.cpp_extension builds through it)")
    found = find_nvcc()
    home = find_cuda_home(found)
    if found is None:
        reasons.append("no nvcc (not $NVCC, not in $CUDA_HOME/bin, not on PATH, not /usr/local/cuda/bin/nvcc)")
    elif home is None:
        reasons.append(f"nvcc found ({found}), but no CUDA toolkit with nvcc and headers (include/"
                       "cuda_runtime_api.h) in $CUDA_HOME, $CUDA_PATH, next to it or in /usr/local/cuda")
    else:
        nvcc = os.path.join(home, "bin", "nvcc")
        ver = nvcc_version(nvcc)
        info.update(nvcc=nvcc, nvcc_version=ver, cuda_home=home)
        if ver and torch.version.cuda and ver.split(".")[0] != torch.version.cuda.split(".")[0]:
            reasons.append(f"nvcc {ver} ({nvcc}) and torch's CUDA {torch.version.cuda} differ in their major "
                           "version: torch.utils.cpp_extension refuses to build (NVCC=... or CUDA_HOME=... to "
                           "point at a matching toolkit)")
    return info, reasons


# -- running and logging -----------------------------------------------------------------------------------


def run_logged(cmd: List[str], log: str, env: Optional[Dict[str, str]] = None,
               timeout: Optional[float] = None) -> Tuple[Optional[int], float]:
    """Run ``cmd`` in the repository root, its output to the console and to ``log``: (exit status, or None
    when it ran past ``timeout`` seconds and was killed with its process group; seconds)."""
    os.makedirs(os.path.dirname(log), exist_ok=True)
    t0 = time.monotonic()
    with open(log, "w") as fh:
        fh.write(f"$ {shlex.join(cmd)}\n")
        fh.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", bufsize=1, start_new_session=True)

        def pump():
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
                fh.write(line)

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        try:
            rc: Optional[int] = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
        reader.join(10)
        if rc is None:
            fh.write(f"\ngpu-check: killed after {timeout:g} s\n")
    return rc, time.monotonic() - t0


def python_env(**extra: str) -> Dict[str, str]:
    """The environment of the steps: the checkout's python/ first on the path (nothing is installed)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(ROOT, "python")] + (
        [env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def tail(path: str, n: int = 3) -> str:
    try:
        with open(path, errors="replace") as fh:
            lines = [ln.rstrip() for ln in fh if ln.strip()]
    except OSError:
        return ""
    return " / ".join(lines[-n:])


# -- the steps ---------------------------------------------------------------------------------------------


CHECK_BUILD = r"""
import json, os, osp, osp.ops as o, torch
out = dict(file=os.path.realpath(osp.__file__), extension=o.HAS_EXTENSION, cuda_built=bool(o._CUDA_BUILT))
if out["cuda_built"]:
    s, nf = torch.ops.osp.score_blocks(torch.ones(10, device="cuda"), None, 4, 0, 1e-8)
    out["smoke"] = s.tolist() == [4.0, 4.0, 2.0] and int(nf) == 0
print("GPU-CHECK " + json.dumps(out))
"""


def step_build(info: Dict) -> Dict:
    env = python_env(FORCE_CUDA="1")
    env.pop("FORCE_ONLY_CPU", None)
    env.setdefault("TORCH_CUDA_ARCH_LIST", info.get("capability", ""))
    env["CUDA_HOME"] = info["cuda_home"]
    env["PATH"] = os.path.join(info["cuda_home"], "bin") + os.pathsep + env.get("PATH", "")
    log = os.path.join(WORK, "build.log")
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace", "--build-temp", os.path.join(WORK, "temp")]
    print(f"TORCH_CUDA_ARCH_LIST={env['TORCH_CUDA_ARCH_LIST']} CUDA_HOME={env['CUDA_HOME']} FORCE_CUDA=1",
          flush=True)
    rc, secs = run_logged(cmd, log, env, BUILD_TIMEOUT)
    out = dict(name="build", seconds=secs, log=os.path.relpath(log, ROOT), arch=env["TORCH_CUDA_ARCH_LIST"])
    if rc != 0:
        return dict(out, status="FAIL", detail="timed out" if rc is None else f"exit {rc}: {tail(log)}")
    proc = subprocess.run([sys.executable, "-c", CHECK_BUILD], cwd=ROOT, env=python_env(), capture_output=True,
                          text=True, timeout=300)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("GPU-CHECK ")), None)
    if line is None:
        return dict(out, status="FAIL", detail=f"import osp failed: {(proc.stderr or proc.stdout).strip()[-400:]}")
    got = json.loads(line[len("GPU-CHECK "):])
    out.update(got)
    mine = os.path.realpath(os.path.join(ROOT, "python", "osp"))
    if not got["file"].startswith(mine + os.sep):
        return dict(out, status="FAIL", detail=f"python imports another osp: {got['file']}")
    if not got["cuda_built"]:
        return dict(out, status="FAIL", detail="osp._C built, but torch.ops.osp has no CUDA kernels")
    if not got.get("smoke"):
        return dict(out, status="FAIL", detail="score_blocks on CUDA returned a wrong result")
    return dict(out, status="PASS", detail=f"osp._C with CUDA kernels for sm_{out['arch'].replace('.', '')}")


def junit_results(path: str) -> Dict:
    """Counts, failures, skip reasons and recorded properties of a pytest JUnit XML file."""
    res = dict(tests=0, passed=0, failed=0, errors=0, skipped=0, failures=[], skip_reasons={}, properties=[])
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        res["parse_error"] = str(e)
        return res
    for case in root.iter("testcase"):
        res["tests"] += 1
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skip = case.find("skipped")
        if bad is not None:
            res["failed" if bad.tag == "failure" else "errors"] += 1
            msg = (bad.get("message") or bad.text or "").strip().splitlines()
            res["failures"].append(f"{name}: {msg[0][:300] if msg else bad.tag}")
        elif skip is not None:
            res["skipped"] += 1
            why = (skip.get("message") or "").strip()[:200]
            res["skip_reasons"][why] = res["skip_reasons"].get(why, 0) + 1
        else:
            res["passed"] += 1
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props:
            res["properties"].append(dict(test=name, **props))
    return res


def step_tests() -> Dict:
    runs, t0 = [], time.monotonic()
    for label, args, timeout in TEST_RUNS:
        slug = re.sub(r"[^A-Za-z0-9]+", "-", label).strip("-")
        junit = os.path.join(WORK, f"junit-{slug}.xml")
        if os.path.exists(junit):
            os.remove(junit)
        log = os.path.join(WORK, f"tests-{slug}.log")
        cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}",
               "-o", "junit_family=xunit1"] + args
        print(f"\n-- pytest {' '.join(args)}", flush=True)
        rc, secs = run_logged(cmd, log, python_env(), timeout)
        res = junit_results(junit)
        ok = rc == 0 and res["tests"] > 0 and not res["failed"] and not res["errors"]
        detail = f"{res['passed']} passed, {res['failed']} failed, {res['errors']} errors, {res['skipped']} skipped"
        if rc is None:
            detail = f"timed out after {timeout} s; " + detail
        elif rc != 0 and not res["failed"] and not res["errors"]:
            detail = f"pytest exit {rc}; " + detail
        runs.append(dict(res, run=label, status="PASS" if ok else "FAIL", seconds=secs, rc=rc, detail=detail,
                         log=os.path.relpath(log, ROOT), junit=os.path.relpath(junit, ROOT)))
    status = "PASS" if all(r["status"] == "PASS" for r in runs) else "FAIL"
    total = {k: sum(r[k] for r in runs) for k in ("passed", "failed", "errors", "skipped")}
    detail = ", ".join(f"{v} {k}" for k, v in total.items())
    return dict(name="tests", status=status, seconds=time.monotonic() - t0, detail=detail, runs=runs)


def step_bench() -> Dict:
    report = os.path.join(WORK, "kernels_report.json")
    if os.path.exists(report):
        os.remove(report)
    log = os.path.join(WORK, "bench.log")
    cmd = [sys.executable, "bench/kernels.py", "--device", "cuda", "--json", os.path.join(WORK, "kernels.json"),
           "--report", report]
    rc, secs = run_logged(cmd, log, python_env(), BENCH_TIMEOUT)
    out = dict(name="bench", seconds=secs, log=os.path.relpath(log, ROOT))
    if os.path.exists(report):  # written also when a check failed: the rows that passed
        with open(report) as fh:
            out["kernels"] = json.load(fh)
    if rc != 0 or "kernels" not in out:
        errors = out.get("kernels", {}).get("errors") or [tail(log)]
        return dict(out, status="FAIL", detail="timed out" if rc is None else f"exit {rc}: {'; '.join(errors)[:600]}")
    peak = out["kernels"]["peak"]
    return dict(out, status="PASS", detail=f"peak {peak['gbps']:.0f} GB/s ({peak['source']})")


def git_state() -> Dict:
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                                timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(commit=commit or None, modified=bool(dirty)) if commit else {}


# -- the summary -------------------------------------------------------------------------------------------


def _f(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def summary_markdown(report: Dict) -> str:
    """The markdown tables printed at the end (and pasteable into README)."""
    info = report.get("host", {})
    head = (f"GPU check: {info.get('device', 'no device')} (sm_{info.get('capability', '?').replace('.', '')}), "
            f"torch {info.get('torch')}, CUDA {info.get('torch_cuda')}, nvcc {info.get('nvcc_version')}, "
            f"driver {info.get('driver')}, {report.get('date', '')}")
    lines = [head, "", "| step | status | seconds | detail |", "|---|---|---|---|"]
    for s in report["steps"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s.get('detail', '')} |")
        for r in s.get("runs", []):
            lines.append(f"| &nbsp;&nbsp;pytest {r['run']} | {r['status']} | {r['seconds']:.1f} | {r['detail']} |")
    failures = [f for s in report["steps"] for r in s.get("runs", []) for f in r.get("failures", [])]
    if failures:
        lines += ["", f"Failed ({len(failures)}):"] + [f"- {f}" for f in failures[:40]] + (
            [f"- ... and {len(failures) - 40} more (build/gpu-check/junit-*.xml)"] if len(failures) > 40 else [])
    reads = report.get("agreement_reads", [])
    if reads:
        lines += ["", "Host reads through osp.agreement.read in the steady steps:", "",
                  "| test | reads | steps |", "|---|---|---|"]
        lines += [f"| {r['test'].split('::')[-1]} | {r['agreement_reads']} | {r.get('steady_steps', '')} |"
                  for r in reads]
    kernels = next((s.get("kernels") for s in report["steps"] if s.get("kernels")), None)
    if kernels:
        rows = kernels.get("rows", [])
        fp32 = [r for r in rows if r["dtype"] == "float32"]
        biggest = max((r["n"] for r in fp32), default=None)
        shown = [r for r in rows if (r["dtype"] == "float32" and r["n"] == biggest) or r["dtype"] != "float32"]
        peak = kernels["peak"]
        lines += ["", f"Kernels, block size 4096, 25% critical; peak {_f(peak['gbps'], '.0f')} GB/s "
                      f"({peak['source']}), copy_ of {_f((peak.get('copy_bytes') or 0) / 2 ** 30, 'g')} GiB "
                      f"{_f(peak['copy_gbps'], '.0f')} GB/s:", "",
                  "| op | elements | dtype | GB/s | x copy_ | x peak | x torch |", "|---|---|---|---|---|---|---|"]
        for r in shown:
            lines.append(f"| {r['op']} | {r.get('size', r['n'])} | {r['dtype']} | {r['gbps']:.0f} | "
                         f"{r['x_copy_']:.2f} | {_f(r.get('x_peak'), '.2f')} | {r['x_torch']:.1f} |")
        launch = kernels.get("launch_shape", [])
        if launch:
            lines += ["", f"Launch shape, {launch[0]['n']} fp32 elements:", "",
                      "| op | block size | ms | GB/s | x copy_ | x peak | time / time at 4096 |",
                      "|---|---|---|---|---|---|---|"]
            for r in launch:
                lines.append(f"| {r['op']} | {r['block_size']} | {r['ms']:.2f} | {r['gbps']:.0f} | "
                             f"{r['x_copy_']:.2f} | {_f(r.get('x_peak'), '.2f')} | {r['x_time_vs_bs4096']:.2f} |")
    failed = [s["name"] for s in report["steps"] if s["status"] == "FAIL"]
    lines += ["", f"gpu-check: {'FAIL (' + ', '.join(failed) + ')' if failed else 'PASS'} in "
                  f"{report['seconds']:.0f} s; {report['out']}"]
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--list", action="store_true", help="print the plan and exit 0")
    ap.add_argument("--only", default=",".join(OPTIONAL),
                    help=f"the steps to run among {','.join(OPTIONAL)} (default all; preflight and report "
                         "always run)")
    ap.add_argument("--out", default=RESULTS, help="the results file (default %(default)s)")
    a = ap.parse_args(argv)
    chosen = [s.strip() for s in a.only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in OPTIONAL]
    if unknown:
        ap.error(f"--only: unknown step(s) {unknown}: choose among {','.join(OPTIONAL)}")
    if a.list:
        print(plan_text())
        return 0
    t_start = time.monotonic()
    print(plan_text(), flush=True)
    print("\n== 1/5 preflight", flush=True)
    info, reasons = preflight()
    if reasons:
        print("\ngpu-check cannot run here:")
        for r in reasons:
            print(f"  - {r}")
        print("Nothing was built or run. On a host with one NVIDIA GPU, a CUDA build of torch and nvcc: "
              "make gpu-check", flush=True)
        return 2
    t_pre = time.monotonic() - t_start
    print(f"{info['device']} (sm_{info['capability'].replace('.', '')}, {info['memory_gib']} GiB"
          f"{', ' + str(info['devices']) + ' devices, using cuda:0' if info['devices'] > 1 else ''}), "
          f"torch {info['torch']} (CUDA {info['torch_cuda']}), nvcc {info['nvcc_version']} ({info['nvcc']}), "
          f"driver {info.get('driver')}, python {info['python_version']}", flush=True)
    steps = [dict(name="preflight", status="PASS", seconds=t_pre,
                  detail=f"{info['device']}, torch {info['torch']}, nvcc {info['nvcc_version']}")]
    os.makedirs(WORK, exist_ok=True)
    for i, (name, fn) in enumerate((("build", lambda: step_build(info)), ("tests", step_tests),
                                    ("bench", step_bench)), 2):
        print(f"\n== {i}/5 {name}", flush=True)
        if name not in chosen:
            steps.append(dict(name=name, status="SKIP", seconds=0.0, detail="not in --only"))
            continue
        t0 = time.monotonic()
        try:
            res = fn()
        except Exception as e:  # noqa: BLE001 - a broken step is reported, the next ones still run
            res = dict(name=name, status="FAIL", detail=f"gpu-check itself failed: {e!r}")
        res.setdefault("seconds", time.monotonic() - t0)
        steps.append(res)
        print(f"-- {name}: {res['status']} in {res['seconds']:.1f} s: {res.get('detail', '')}", flush=True)
    print("\n== 5/5 report", flush=True)
    t0 = time.monotonic()
    out = a.out if os.path.isabs(a.out) else os.path.join(ROOT, a.out)
    report = dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), host=info,
                  git=git_state(), out=os.path.relpath(out, ROOT), steps=steps)
    reads = [p for s in steps for r in s.get("runs", []) for p in r.get("properties", []) if "agreement_reads" in p]
    if reads:
        report["agreement_reads"] = reads
    steps.append(dict(name="report", status="PASS", seconds=0.0, detail=report["out"]))
    report["seconds"] = time.monotonic() - t_start
    try:
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w") as fh:
            json.dump(report, fh, indent=1)
    except OSError as e:
        steps[-1].update(status="FAIL", detail=f"cannot write {out}: {e}")
    steps[-1]["seconds"] = time.monotonic() - t0
    print("\n" + summary_markdown(report), flush=True)
    return 0 if all(s["status"] in ("PASS", "SKIP") for s in steps) else 1


if __name__ == "__main__":
    sys.exit(main())
