"""A process that used osp exits 0 when its script returns: no abort at interpreter exit.

torch 2.13's Gloo worker threads can drop the last reference to a finished collective's tensors
while the interpreter finalizes; taking the GIL then ends the thread by a forced unwind through a
noexcept destructor, and the process dies of SIGABRT ("terminate called without an active
exception") after its work was done. osp's exit hook (osp/teardown.py) completes osp's in-flight
collectives and tears the process group down while the interpreter is still whole.

The script under test (workers/exit_script.py) is a user's: OSP and BSP steps, then either flush()
or OSP's stage 2 left in flight (alternate runs), then the final loss averaged with the engine's own
allreduce, and it returns without destroy_process_group() or hvd.shutdown(). Two launches run at a
time, which loads the 2 cores the way the failure needs (before osp's exit hook, about 1 launch in
10 under torchrun died of SIGABRT this way). ``OSP_EXIT_RUNS`` sets how many
launches per launcher: 10 in ``make test`` (a 1-in-10 failure shows in about 2 runs of 3; 20 took 3.6 of
the suite's minutes), 200 in ``make stress-exit``.
"""
import json
import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

import launch

SCRIPT = os.path.join(launch.HERE, "workers", "exit_script.py")
RUNS = int(os.environ.get("OSP_EXIT_RUNS", "10"))


def _one(launcher, ending, extra_env=None):
    argv = [SCRIPT, launcher, ending]
    cmd = launch.torchrun_cmd(2, argv) if launcher == "torch" else launch.horovodrun_cmd(2, argv)
    try:
        return subprocess.run(cmd, env=launch._env(extra_env), capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        return subprocess.CompletedProcess(cmd, "timeout", e.stdout or "", e.stderr or "")


def run_many(launcher, runs, extra_env=None):
    with ThreadPoolExecutor(2) as ex:
        procs = list(ex.map(lambda i: _one(launcher, ("flush", "inflight")[i % 2], extra_env), range(runs)))
    return [p for p in procs if p.returncode != 0]


@pytest.mark.multiproc
@pytest.mark.jobs
@pytest.mark.parametrize("launcher", ["torch", "horovod"])
def test_script_that_returns_exits_zero(launcher):
    failed = run_many(launcher, RUNS)
    print(f"\nexit stress: {launcher}: {RUNS - len(failed)} of {RUNS} runs exited 0")
    assert not failed, (
        f"{len(failed)} of {RUNS} runs under {launcher} did not exit 0; first: exit {failed[0].returncode}\n"
        f"--- stdout\n{failed[0].stdout[-3000:]}\n--- stderr\n{failed[0].stderr[-4000:]}")


def _probe(mode):
    proc = subprocess.run([launch.PY, os.path.join(launch.HERE, "workers", "exit_probe.py"), mode],
                          env=launch._env(), capture_output=True, text=True, timeout=120)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("PROBE ")]
    assert len(lines) == 1, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc, json.loads(lines[0][len("PROBE "):])


@pytest.mark.parametrize("mode", ["return", "destroyed"])
def test_exit_hook_completes_collectives_and_joins_gloo_threads(mode):
    """What the hook does, deterministically: an un-waited collective is completed, the process group
    destroyed (by the script or by the hook), and Gloo's threads joined, before the interpreter
    finalizes."""
    proc, probe = _probe(mode)
    assert proc.returncode == 0, proc.stderr
    assert probe["inflight"] == 0 and not probe["initialized"], probe
    engine = [n for n in probe["names"] if n.startswith(("gloo", "pt_gloo"))]
    assert not engine, f"engine threads left running at exit: {probe}"


def test_exit_hook_opt_out_and_failing_script_leave_the_engine_alone():
    proc, probe = _probe("optout")
    assert proc.returncode == 0 and probe["initialized"] and probe["inflight"] == 1, probe
    assert "pt_gloo_runloop" in probe["names"], probe
    proc, probe = _probe("raise")
    assert proc.returncode == 1 and "the script fails" in proc.stderr
    assert probe["initialized"] and probe["inflight"] == 1, probe
