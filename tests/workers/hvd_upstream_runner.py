"""Horovod 0.28.1's own PyTorch tests (tests/third_party/horovod/test/parallel/test_torch.py, vendored unmodified)
against ``osp.horovod``, under torchrun.

Two modes:

- **rank** (what torchrun starts on every rank; ``--out DIR``): ``import horovod.torch as hvd`` in the test file
  resolves to ``osp.horovod`` (aliases in ``sys.modules`` while the file is imported, then taken away again; a real
  Horovod is never imported, installed or not), the default process group is made here, Gloo with a short timeout
  (``osp.horovod.init()`` reuses it), and ``TorchTests``' methods run one at a time, in the file's order, with
  unittest (``@pytest.mark.skip`` honoured, as under Horovod's pytest), each after seeding torch, numpy and
  random from the test's name and the rank (``seed_for``: outcomes do not hang on what ran before). Each rank writes
  ``DIR/rank<r>.json`` after every test: passed / failed (the exception's first line, and where) / skipped (the
  reason), and the exceptions osp raised during the test (``osp_raised``: a test expecting an error may pass on a
  refusal).

  torch.distributed matches collectives by the order they are issued, so after a test failed on one rank the
  ranks may be out of step. After every test the ranks agree through the launcher's TCP store (a key per rank,
  waited for with a time limit): unless every rank passed, or every rank skipped, the process group (and every
  process set) is destroyed and made again under a new store prefix before the next test. A test that runs past
  ``--test-timeout`` is recorded as timed out and ends the rank (a watchdog thread; ``faulthandler`` behind it).

  The environment is the one ``horovodrun --gloo`` gives each rank: ``HOROVOD_RANK`` / ``HOROVOD_SIZE`` (and the
  local ones) from torchrun's ``RANK`` / ``WORLD_SIZE``. The test file reads them to tell Gloo from MPI (with them
  the re-init tests run, and every test's tearDown runs ``hvd.barrier(); hvd.shutdown()``).

- **drive** (``--drive --out DIR``, or ``drive()`` from Python): one process that starts the ranks with torchrun
  (``launch.torchrun_cmd``, killed as a whole past its time limit), and again, from the next test on, when a launch
  ended early (a rank crashed or timed out: that test is recorded so); then writes ``DIR/results.json``, every
  test's outcome on every rank and its class (``classify``): passed, skipped, refused or failed.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import faulthandler
import gc
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import re
import sys
import threading
import time
import traceback
import types
import unittest
import zlib

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
VENDOR = os.path.join(TESTS, "third_party", "horovod")
TEST_FILE = os.path.join(VENDOR, "test", "parallel", "test_torch.py")
COMMON_FILE = os.path.join(VENDOR, "test", "utils", "common.py")
CLASS = "TorchTests"


def list_tests(path: str = TEST_FILE) -> list:
    """``TorchTests``' test methods in the file's order (read with ast: nothing is imported)."""
    tree = ast.parse(open(path).read(), path)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS)
    return [n.name for n in cls.body if isinstance(n, ast.FunctionDef) and n.name.startswith("test")]


# --- the outcome of a test over the ranks ------------------------------------------------------------------------

# What osp says where it does not do what Horovod does, on purpose (the docstrings of osp.horovod: "Where they depart
# from Horovod"): a refusal. Any other exception is a failure.
REFUSALS = [
    r"^NotImplementedError: osp\.horovod: ",  # a part of Horovod osp.horovod does not provide (reducescatter, ...)
    r"^ValueError: osp(\.horovod)?: .*\b(not supported|not available|not provided)\b",
    r"^ValueError: osp: torch\.optim\.SparseAdam steps sparse gradients only",  # osp averages dense gradients
    # osp.DistributedOptimizer's check_replicas: it does not step replicas that start apart (Horovod averages the
    # gradients of whatever each rank holds)
    r"^RuntimeError: osp: the replicas differ at the first step\(\)",
]
REFUSAL = re.compile("|".join(f"(?:{p})" for p in REFUSALS))


def classify(outcomes: list) -> tuple:
    """One test's outcomes on every rank (``None``: the rank left none) as ``(class, reason)``: ``passed`` (on every
    rank), ``skipped`` (on every rank; the reason), ``refused`` (some rank failed with osp's refusal, ``REFUSALS``,
    or the test passed only because osp refused: it expects an error, and the refusal is one; the message) or
    ``failed`` (the first failing rank's exception, or what happened to the rank)."""
    if any(o is None for o in outcomes):
        return "failed", "no outcome from rank " + ", ".join(str(r) for r, o in enumerate(outcomes) if o is None)
    statuses = {o["status"] for o in outcomes}
    if statuses == {"passed"}:
        for o in outcomes:
            refused = [m for m in o.get("osp_raised", []) if REFUSAL.search(m)]
            if refused:
                return "refused", f"passes only as the error it expects: {refused[0]}"
        return "passed", ""
    if statuses == {"skipped"}:
        return "skipped", outcomes[0]["detail"]
    for o in outcomes:
        if o["status"] == "failed" and REFUSAL.search(o["detail"]):
            return "refused", o["detail"]
    for r, o in enumerate(outcomes):
        if o["status"] not in ("passed", "skipped"):
            return "failed", f"rank {r}: {o['detail']}"
    return "failed", "ranks differ: " + ", ".join(f"rank {r} {o['status']}" for r, o in enumerate(outcomes))


# --- rank mode: horovod -> osp.horovod ----------------------------------------------------------------------------

class _NoRealHorovod(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: ``horovod`` and ``horovod.*`` not in ``sys.modules`` (the aliases) are not found,
    as where Horovod is not installed; a real Horovod is never imported."""

    def find_spec(self, name, path=None, target=None):
        if name == "horovod" or name.startswith("horovod."):
            raise ModuleNotFoundError(f"No module named {name!r} (hvd_upstream_runner: horovod is osp.horovod "
                                      "while the test file is imported, and absent otherwise)", name=name)
        return None


def _in_thread(target, args=(), name=None, daemon=True, silent=False):
    """horovod.runner.util.threads.in_thread, which test/utils/common.py imports (only its ``delay`` uses it)."""
    t = threading.Thread(target=target, args=args, name=name, daemon=daemon)
    t.start()
    return t


def _package(name: str, **attrs) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []  # a package, whose submodules are only the aliases
    mod.__dict__.update(attrs)
    return mod


def import_test_module():
    """Import the vendored test file with ``horovod.torch`` = ``osp.horovod``; afterwards no ``horovod`` module is
    left in ``sys.modules`` (osp's own ``import horovod.torch`` then fails, as without Horovod)."""
    global _REAL_HOROVOD
    import osp.horovod

    _REAL_HOROVOD = _real_horovod_dir()
    sys.meta_path.insert(0, _NoRealHorovod())
    for dep, stand_in in (("mock", "unittest.mock"), ("cloudpickle", "pickle")):  # what common.py imports
        try:
            importlib.import_module(dep)
        except ImportError:
            sys.modules[dep] = importlib.import_module(stand_in)
    threads = _package("horovod.runner.util.threads", in_thread=_in_thread)
    util = _package("horovod.runner.util", threads=threads)
    runner = _package("horovod.runner", util=util)
    aliases = {"horovod": _package("horovod", torch=osp.horovod, runner=runner), "horovod.torch": osp.horovod,
               "horovod.runner": runner, "horovod.runner.util": util, "horovod.runner.util.threads": threads}
    sys.modules.update(aliases)
    try:
        # test_torch.py puts ../utils on sys.path and imports `common`: load that one, whatever else is called so
        spec = importlib.util.spec_from_file_location("common", COMMON_FILE)
        common = importlib.util.module_from_spec(spec)
        sys.modules["common"] = common
        spec.loader.exec_module(common)
        spec = importlib.util.spec_from_file_location("test_torch", TEST_FILE)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["test_torch"] = mod
        spec.loader.exec_module(mod)
    finally:
        for name in aliases:
            sys.modules.pop(name, None)
    assert mod.hvd is osp.horovod, mod.hvd
    return mod


def _real_horovod_dir():
    """Where an installed Horovod would be imported from (located, not imported), or None."""
    spec = importlib.machinery.PathFinder.find_spec("horovod")
    return os.path.dirname(spec.origin) if spec is not None and spec.origin else None


_REAL_HOROVOD = None


def horovod_modules() -> list:
    """Modules named horovod* or loaded from a real Horovod's directory (the aliases are gone after the import of
    the test file): must be none."""
    found = []
    for name, m in list(sys.modules.items()):
        f = getattr(m, "__file__", None) or ""
        if name == "horovod" or name.startswith("horovod.") or (_REAL_HOROVOD and f.startswith(_REAL_HOROVOD + os.sep)):
            found.append(name)
    return found


def _pytest_skip(fn):
    """The reason of a ``@pytest.mark.skip`` (or a true ``skipif``) on ``fn``, which unittest alone ignores."""
    for mark in getattr(fn, "pytestmark", []):
        if mark.name == "skip":
            return mark.kwargs.get("reason", mark.args[0] if mark.args else "pytest.mark.skip")
        if mark.name == "skipif" and mark.args and all(bool(a) for a in mark.args if not isinstance(a, str)):
            return mark.kwargs.get("reason", "pytest.mark.skipif")
    return None


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".strip()


class _Result(unittest.TestResult):
    """Keeps only text (no frames: whatever a failed test made is freed)."""

    def __init__(self):
        super().__init__()
        self.problems: list = []  # (kind, first line, where, traceback tail)
        self.skip_reason = None

    def _problem(self, kind, err):
        exc = err[1]
        tb = traceback.extract_tb(err[2])
        frames = [f for f in tb if f.filename == TEST_FILE]
        where = f"test_torch.py:{frames[-1].lineno} ({frames[-1].name})" if frames else ""
        inner = f"{os.path.relpath(tb[-1].filename, TESTS)}:{tb[-1].lineno}" if tb else ""
        text = "".join(traceback.format_exception(*err))
        self.problems.append({"kind": kind, "detail": _first_line(exc), "where": where, "raised_at": inner,
                              "traceback": text[-3000:]})

    def addError(self, test, err):
        self._problem("error", err)

    def addFailure(self, test, err):
        self._problem("failure", err)

    def addSkip(self, test, reason):
        self.skip_reason = reason

    def addSubTest(self, test, subtest, err):
        if err is not None:
            self._problem("failure" if issubclass(err[0], test.failureException) else "error", err)


def _osp_raises(raised: list):
    """A trace function that notes every exception raised in osp's own code (where it is raised: caught by the test
    or not), as its first line: a test that expects an error may pass on a refusal."""
    import osp

    root = os.path.dirname(osp.__file__) + os.sep

    def local(frame, event, arg):
        if event == "exception" and arg[2] is not None and arg[2].tb_next is None and len(raised) < 20 \
                and isinstance(arg[1], Exception) and not isinstance(arg[1], (StopIteration, StopAsyncIteration)):
            line = _first_line(arg[1])
            if line not in raised:
                raised.append(line)
        return local

    def calls(frame, event, arg):
        return local if event == "call" and frame.f_code.co_filename.startswith(root) else None

    return calls


def run_one(cls, name: str) -> dict:
    reason = _pytest_skip(getattr(cls, name))
    if reason is not None:
        return {"status": "skipped", "detail": f"@pytest.mark.skip: {reason}"}
    res, raised = _Result(), []
    if os.environ.get("HVD_UPSTREAM_TRACE", "1") == "1":
        sys.settrace(_osp_raises(raised))
    try:
        cls(name).run(res)
    finally:
        sys.settrace(None)
    if res.problems:
        out = {"status": "failed", **res.problems[0]}
        if len(res.problems) > 1:
            out["also"] = [p["detail"] + (" (in tearDown)" if "tearDown" in p["traceback"] else "")
                           for p in res.problems[1:]]
    elif res.skip_reason is not None:
        out = {"status": "skipped", "detail": res.skip_reason or "@unittest.skip (no reason given)"}
    else:
        out = {"status": "passed", "detail": ""}
    if raised:
        out["osp_raised"] = raised
    return out


class _Watchdog:
    """A test that runs past its time: its outcome is written as timed out and the rank exits (3)."""

    def __init__(self, on_expiry):
        self.on_expiry, self.name, self.deadline = on_expiry, None, None
        self.lock = threading.Lock()
        threading.Thread(target=self._loop, daemon=True).start()

    def arm(self, name, seconds):
        with self.lock:
            self.name, self.deadline = name, time.monotonic() + seconds

    def disarm(self):
        with self.lock:
            self.name = self.deadline = None

    def _loop(self):
        while True:
            time.sleep(0.5)
            with self.lock:
                expired = self.deadline is not None and time.monotonic() > self.deadline
                name = self.name
            if expired:
                self.on_expiry(name)
                os._exit(3)


def seed_for(name: str, rank: int) -> None:
    """Seed torch, numpy and random before a test, from its name and the rank: what a test draws without seeding
    is then the same from run to run, whatever ran before it (a subset, a launch after a crash), and differs between
    the ranks, as in processes started apart (torch seeds each process at random)."""
    import random

    import numpy as np
    import torch

    seed = (zlib.crc32(name.encode()) + rank) % 2**31
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def rank_main(args) -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    # as horovodrun --gloo: test_torch.py reads HOROVOD_RANK / HOROVOD_SIZE (Gloo rather than MPI)
    os.environ.update(HOROVOD_RANK=str(rank), HOROVOD_SIZE=str(world),
                      HOROVOD_LOCAL_RANK=os.environ.get("LOCAL_RANK", str(rank)),
                      HOROVOD_LOCAL_SIZE=os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    import torch
    import torch.distributed as dist

    import osp.horovod

    torch.set_num_threads(1)
    os.makedirs(args.out, exist_ok=True)
    # this rank's output (Python's and C++'s: a Gloo abort says why here) to its own file
    sys.stdout.flush()
    sys.stderr.flush()
    logfd = os.open(os.path.join(args.out, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(logfd, 1)
    os.dup2(logfd, 2)
    path = os.path.join(args.out, f"rank{rank}.json")
    state = {"rank": rank, "size": world, "torch": torch.__version__, "tests": {}, "current": None,
             "process_groups": 0, "horovod_modules": None,
             "devices": f"torch {torch.__version__}, " + (f"{torch.cuda.device_count()} CUDA device(s)"
                                                          if torch.cuda.is_available() else "CPU only")}

    def save():
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, path)

    names = args.tests.split(",") if args.tests else list_tests()
    save()
    mod = import_test_module()
    state["horovod_modules"] = horovod_modules()
    save()

    base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=args.pg_timeout))
    store = dist.PrefixStore(f"osp-hvd-upstream/{os.environ.get('TORCHELASTIC_RUN_ID', '')}", base)
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"

    def make_group():
        state["process_groups"] += 1
        dist.init_process_group(backend, store=dist.PrefixStore(f"pg{state['process_groups']}", store),
                                rank=rank, world_size=world, timeout=datetime.timedelta(seconds=args.pg_timeout))
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)) % torch.cuda.device_count())

    def remake_group():
        try:
            osp.horovod.shutdown()  # forgets the process sets (the group is ours: not destroyed by it)
        except Exception as e:  # noqa: BLE001 - recorded, the group is made again anyway
            state.setdefault("resync_errors", []).append(f"shutdown: {_first_line(e)}")
        osp.horovod.basics._world.__init__()
        gc.collect()
        if dist.is_initialized():
            dist.destroy_process_group()  # the default group and every other
        make_group()

    def expired(name):
        state["tests"][name] = {"status": "failed", "kind": "timeout",
                                "detail": f"TimeoutError: no result after {args.test_timeout:g} s (runner watchdog)",
                                "traceback": "".join(traceback.format_stack(sys._current_frames()[main_id]))[-3000:]}
        save()

    main_id = threading.get_ident()
    dog = _Watchdog(expired)
    make_group()
    for i, name in enumerate(names):
        state["current"] = name
        save()
        seed_for(name, rank)
        faulthandler.dump_traceback_later(args.test_timeout + 30, exit=True)  # behind the watchdog
        dog.arm(name, args.test_timeout)
        t0 = time.monotonic()
        outcome = run_one(mod.TorchTests, name)
        dog.disarm()
        faulthandler.cancel_dump_traceback_later()
        outcome["seconds"] = round(time.monotonic() - t0, 3)
        # agree: every rank's status, waited for with a time limit
        store.set(f"agree/{i}/{rank}", outcome["status"])
        try:
            store.wait([f"agree/{i}/{r}" for r in range(world)], datetime.timedelta(seconds=args.test_timeout))
            statuses = [store.get(f"agree/{i}/{r}").decode() for r in range(world)]
        except Exception as e:  # noqa: BLE001 - a peer is gone or stuck past its own watchdog
            outcome["agreement"] = _first_line(e)
            state["tests"][name] = outcome
            save()
            return 4
        if not (len(set(statuses)) == 1 and statuses[0] in ("passed", "skipped")):
            outcome["regrouped"] = True
            t1 = time.monotonic()
            remake_group()
            outcome["regroup_seconds"] = round(time.monotonic() - t1, 3)
        state["tests"][name] = outcome
        gc.collect()
        save()
    state["current"] = None
    state["horovod_modules"] = horovod_modules()
    save()
    osp.horovod.shutdown()
    dist.destroy_process_group()
    return 0


# --- drive mode ---------------------------------------------------------------------------------------------------

def drive(out: str, names=None, nproc: int = 2, timeout: float = 900, test_timeout: float = 60,
          pg_timeout: float = 10, env=None, log=print) -> dict:
    """Run ``names`` (default: every test of the file) on ``nproc`` ranks under torchrun; launch again after a
    launch that ended before its last test (from the test after the one it ended in). Returns (and writes to
    ``out/results.json``) every test's outcome per rank and its class. ``env``: added to the ranks' environment
    (``CUDA_VISIBLE_DEVICES=""`` for the CPU-only run). ``pg_timeout`` bounds a collective that a peer never
    joins (the test file's longest wait is a 5 s sleep before a barrier)."""
    sys.path.insert(0, TESTS)
    import launch

    all_names = list_tests()
    names = list(names or all_names)
    unknown = sorted(set(names) - set(all_names))
    if unknown:
        raise ValueError(f"not tests of {CLASS}: {unknown}")
    os.makedirs(out, exist_ok=True)
    per_rank: list = [dict() for _ in range(nproc)]
    launches: list = []
    horovod_seen: set = set()
    devices = None
    pending = list(names)
    t_start = time.monotonic()
    deadline = t_start + timeout
    while pending:
        left = deadline - time.monotonic()
        if left < 15:
            for r in range(nproc):
                for n in pending:
                    per_rank[r].setdefault(n, {"status": "failed", "kind": "not run",
                                               "detail": "NotRun: the driver's time limit was reached first"})
            break
        d = os.path.join(out, f"launch{len(launches)}")
        os.makedirs(d, exist_ok=True)
        argv = [os.path.abspath(__file__), "--out", d, "--tests", ",".join(pending), "--test-timeout",
                str(test_timeout), "--pg-timeout", str(pg_timeout)]
        t0 = time.monotonic()
        try:
            proc = launch.run_cmd(launch.torchrun_cmd(nproc, argv), timeout=left, env=env)
            rc, text = proc.returncode, proc.stdout + "\n--- stderr\n" + proc.stderr
        except AssertionError as e:  # the whole launch ran out of time: killed
            rc, text = "killed", str(e)
        with open(os.path.join(d, "torchrun.log"), "w") as f:
            f.write(text)
        ranks = []
        for r in range(nproc):
            try:
                ranks.append(json.load(open(os.path.join(d, f"rank{r}.json"))))
            except (OSError, ValueError):
                ranks.append({"tests": {}, "current": None, "horovod_modules": None})
        for r, st in enumerate(ranks):
            devices = st.get("devices", devices)
            per_rank[r].update(st["tests"])
            horovod_seen.update(st.get("horovod_modules") or [])
        ran = sum(n in st["tests"] for st in ranks for n in pending)
        launches.append({"tests": len(pending), "outcomes": ran, "rc": rc,
                         "seconds": round(time.monotonic() - t0, 1)})
        stop = next((n for n in pending if not all(n in st["tests"] for st in ranks)), None)
        log(f"launch {len(launches) - 1}: {len(pending)} tests, exit {rc}, {launches[-1]['seconds']} s"
            + (f", ended in {stop}" if stop else ""))
        if stop is None:
            break
        if ran == 0 and all(st["current"] is None for st in ranks):
            raise RuntimeError(f"the runner ran no test (exit {rc}):\n{text[-6000:]}")
        for r, st in enumerate(ranks):
            if stop not in st["tests"]:
                where = "in this test" if st["current"] == stop else f"before it (at {st['current']})"
                why = _why_exited(d, r, text)
                log_path = f"{os.path.relpath(d, out)}/rank{r}.log"
                per_rank[r][stop] = {"status": "failed", "kind": "crashed",
                                     "detail": f"RankExited: {why}, {where} (log: {log_path})"}
        pending = pending[pending.index(stop) + 1:]
    results = {"nproc": nproc, "order": names, "seconds": round(time.monotonic() - t_start, 1),
               "launches": launches, "horovod_modules": sorted(horovod_seen), "devices": devices, "tests": {}}
    for n in names:
        outs = [per_rank[r].get(n) for r in range(nproc)]
        cls, reason = classify(outs)
        results["tests"][n] = {"class": cls, "reason": reason, "ranks": outs}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    return results


def _why_exited(d: str, rank: int, launcher_log: str) -> str:
    """A rank that left no outcome: its signal or exit code (torchrun's report) and the C++ reason it printed."""
    m = re.search(rf"rank\s*:\s*{rank} \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)[^\n]*?(\((SIG\w+)\))?\n",
                  launcher_log)
    code = (m.group(3) or f"exit code {m.group(1)}") if m else "exited"
    try:
        text = open(os.path.join(d, f"rank{rank}.log"), errors="replace").read()
    except OSError:
        text = ""
    what = re.findall(r"what\(\):\s*(.*)", text)
    if what:
        reason = re.sub(r"\[enforce fail at [^\]]*\]\s*", "", what[-1]).strip()
        return f"{code} ({reason})"
    return code


def summary(results: dict) -> str:
    counts: dict = {}
    for t in results["tests"].values():
        counts[t["class"]] = counts.get(t["class"], 0) + 1
    return (f"{len(results['tests'])} tests on {results['nproc']} ranks in {results['seconds']} s "
            f"({len(results['launches'])} launch(es)): "
            + ", ".join(f"{counts.get(k, 0)} {k}" for k in ("passed", "skipped", "refused", "failed")))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="where each rank (or the driver) writes its JSON")
    p.add_argument("--drive", action="store_true", help="start the ranks under torchrun (one process)")
    p.add_argument("--tests", default="", help="comma-separated test names (default: all, in the file's order)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--timeout", type=float, default=900, help="drive: the whole run's limit (s)")
    p.add_argument("--test-timeout", type=float, default=60, help="one test's limit on a rank (s)")
    p.add_argument("--pg-timeout", type=float, default=10, help="the process group's collective timeout (s)")
    args = p.parse_args(argv)
    if args.drive:
        res = drive(args.out, args.tests.split(",") if args.tests else None, args.nproc, args.timeout,
                    args.test_timeout, args.pg_timeout)
        print(summary(res))
        return 0
    return rank_main(args)


if __name__ == "__main__":
    sys.exit(main())
