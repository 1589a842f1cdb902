"""Start real ranks in separate processes under a real launcher, with a hard time limit."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Sequence

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's bench/ (one wait for a job's ranks: bench.netem)
from bench.netem.netem import wait_all  # noqa: E402

PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HIDE_HOROVOD = os.environ.get("OSP_HIDE_HOROVOD") == "1"  # every rank too finds no Horovod (tests/nohorovod)


def _env(extra=None):
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONPATH"] = HERE + os.pathsep + env.get("PYTHONPATH", "")
    if HIDE_HOROVOD:
        env["PYTHONPATH"] = os.path.join(HERE, "nohorovod") + os.pathsep + env["PYTHONPATH"]
    env.update(extra or {})
    return env


def need_horovod() -> None:
    """Skip the calling test where Horovod is not installed (or hidden: OSP_HIDE_HOROVOD=1), saying so."""
    import pytest

    if HIDE_HOROVOD:
        pytest.skip("needs the Horovod engine; Horovod is hidden (OSP_HIDE_HOROVOD=1)")
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"needs the Horovod engine, which is not installed ({e})")


def horovodrun_cmd(np_: int, argv: Sequence[str]) -> list:
    need_horovod()
    exe = shutil.which("horovodrun", path=os.path.dirname(PY)) or shutil.which("horovodrun")
    if exe is None:
        raise RuntimeError("horovodrun not found: run `make install`")
    return [exe, "--gloo", "-np", str(np_), "-H", f"localhost:{np_}", "--start-timeout", "60",
            PY, *argv]


def torchrun_cmd(np_: int, argv: Sequence[str]) -> list:
    # --standalone: the agent's store binds a free port itself (a port picked in advance could be
    # taken by another process in between)
    return [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(np_), *argv]


def mpirun_cmd(np_: int, argv: Sequence[str]) -> list:
    return ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(np_), "-x", "PYTHONPATH",
            "-x", "OMP_NUM_THREADS", "-x", "MASTER_ADDR", "-x", "MASTER_PORT", PY, *argv]


def spawn(np_: int, argv: Sequence[str], timeout: float, env) -> subprocess.CompletedProcess:
    """Start ``np_`` ranks of ``argv`` directly (no launcher agent: much faster than torchrun). They
    meet in a torch.distributed file store named by OSP_TEST_STORE and find their rank in RANK and
    WORLD_SIZE. A time limit kills them all; the result reads like a launcher's."""
    tmp = tempfile.mkdtemp(prefix="osp-spawn-")
    procs, outs = [], []
    try:
        for r in range(np_):
            out = open(os.path.join(tmp, f"rank{r}.log"), "w+")
            outs.append(out)
            e = _env({**env, "OSP_TEST_STORE": os.path.join(tmp, "store"), "RANK": str(r),
                      "WORLD_SIZE": str(np_), "LOCAL_RANK": str(r)})
            procs.append(subprocess.Popen([PY, *argv], env=e, stdout=out, stderr=subprocess.STDOUT,
                                          start_new_session=True))
        codes, timed_out = wait_all(procs, timeout)
        if timed_out:
            raise subprocess.TimeoutExpired([PY, *argv], timeout, _logs(outs))
        text = _logs(outs)
        return subprocess.CompletedProcess([PY, *argv], next((c for c in codes if c), 0), text, text)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        for f in outs:
            f.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _logs(files) -> str:
    text = []
    for r, f in enumerate(files):
        f.flush()
        f.seek(0)
        text.append(f"[rank {r}]\n{f.read()}")
    return "\n".join(text)


def run(launcher: str, np_: int, argv: Sequence[str], timeout: float = 240, env=None):
    """Run ``argv`` (a python script and its args) on ``np_`` ranks; returns CompletedProcess.
    ``launcher``: "horovod" (horovodrun --gloo), "torch" (torchrun), "mpirun", or "spawn" (the ranks
    started directly, meeting in a file store; see ``spawn``)."""
    extra = dict(env or {})
    if launcher == "spawn":
        return spawn(np_, argv, timeout, extra)
    if launcher == "horovod":
        cmd = horovodrun_cmd(np_, argv)
    elif launcher == "torch":
        cmd = torchrun_cmd(np_, argv)
    elif launcher == "mpirun":
        if shutil.which("mpirun") is None:
            import pytest

            pytest.skip("mpirun is not installed (OSP_WITHOUT_HOROVOD=1 make install leaves OpenMPI out)")
        extra.setdefault("MASTER_ADDR", "127.0.0.1")
        extra.setdefault("MASTER_PORT", str(free_port()))
        cmd = mpirun_cmd(np_, argv)
    else:
        raise ValueError(launcher)
    return subprocess.run(cmd, env=_env(extra), capture_output=True, text=True, timeout=timeout)


def run_cmd(cmd, timeout: float, env=None) -> subprocess.CompletedProcess:
    """Run a launcher command in a session of its own; past ``timeout`` kill the whole session (the
    launcher and every rank it started), so nothing is left to load the machine."""
    p = subprocess.Popen(cmd, env=_env(env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        raise AssertionError(f"timed out after {timeout} s: {cmd}\n{out[-3000:]}\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def check(proc) -> None:
    assert proc.returncode == 0, (
        f"ranks failed (exit {proc.returncode})\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n"
        f"{proc.stderr[-6000:]}")


def rank_results(outdir, nranks: int, proc) -> list:
    """The named checks each rank wrote to ``outdir`` (tests/workers/ranks.py), asserted complete and
    passed: every rank reported, none recorded an error, none has a failed check."""
    import glob
    import json

    results = [json.loads(open(f).read()) for f in sorted(glob.glob(os.path.join(str(outdir), "rank*.json")))]
    assert len(results) == nranks, f"{len(results)} of {nranks} ranks reported\n{proc.stdout[-3000:]}"
    for r in results:
        assert_passed(r)
    return results


def assert_passed(result: dict) -> None:
    """One rank's named checks: no error recorded, no check failed."""
    assert not result["errors"], result["errors"]
    failed = {k: v["detail"] for k, v in result["checks"].items() if not v["ok"]}
    assert not failed, f"rank {result['rank']}: {failed}"


class ElasticJob:
    """``horovodrun --gloo`` elastic, its hosts read by a discovery script from a file the test rewrites
    (``set_hosts``); the output is read as it comes (``wait_for``), and a hard time limit kills it all."""

    def __init__(self, tmp, hosts, argv, np_: int, min_np: int, max_np: int, timeout: float, extra=()):
        self.tmp = str(tmp)
        self.hosts_file = os.path.join(self.tmp, "hosts")
        self.set_hosts(hosts)
        script = os.path.join(self.tmp, "discover.sh")
        with open(script, "w") as f:
            f.write(f"#!/bin/sh\ncat {self.hosts_file}\n")
        os.chmod(script, 0o755)
        need_horovod()
        exe = shutil.which("horovodrun", path=os.path.dirname(PY)) or shutil.which("horovodrun")
        cmd = [exe, "--gloo", "-np", str(np_), "--min-np", str(min_np), "--max-np", str(max_np),
               "--host-discovery-script", script, "--start-timeout", "60",
               # a rank that fails again at every restart (a bug) ends the job instead of looping
               "--reset-limit", "4", *extra, PY, *argv]
        self.deadline = time.monotonic() + timeout
        self.lines: list = []
        self.proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        import threading

        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)

    def set_hosts(self, hosts) -> None:
        tmp = self.hosts_file + ".new"
        with open(tmp, "w") as f:
            f.write("".join(f"{h}:1\n" for h in hosts))
        os.replace(tmp, self.hosts_file)

    def wait_for(self, text: str, after: int = 0) -> int:
        """Wait until an output line (from line ``after`` on) contains ``text``; its index. Fails at once
        when a rank reports different replicas (``--verify-replicas``), or when the job has ended."""
        failed = False
        while time.monotonic() < self.deadline and not failed:
            for i in range(after, len(self.lines)):
                if text in self.lines[i]:
                    return i
                failed |= "--verify-replicas: the replicas differ" in self.lines[i]
            if self.proc.poll() is not None and not self._reader.is_alive():
                break
            time.sleep(0.05)
        self.kill()
        raise AssertionError(f"never printed {text!r}\n{self.output()[-6000:]}")

    def finish(self) -> subprocess.CompletedProcess:
        try:
            rc = self.proc.wait(timeout=max(0.1, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"elastic job timed out\n{self.output()[-6000:]}") from None
        self._reader.join(10)
        out = self.output()
        return subprocess.CompletedProcess(self.proc.args, rc, out, out)

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def output(self) -> str:
        return "".join(self.lines)
