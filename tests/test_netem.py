"""The network emulation used by the throughput benchmark: links really are shaped, everything is
cleaned up, and missing privileges or tools give a clear error."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import launch

ROOT = os.path.dirname(launch.HERE)
sys.path.insert(0, ROOT)
from bench.netem.netem import NetEm, parse_rate  # noqa: E402

CAN_RUN = os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc")


def namespaces():
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def allreduce_seconds(rate, tmp_path, n=1_250_000):
    out = tmp_path / f"ar-{rate}.json"
    with NetEm(2, rate=rate, tag=f"t{os.getpid() % 1000}") as net:
        names = list(net.ns) + [net.hub]
        assert all(x in namespaces() for x in names)
        codes = net.run("torch", [sys.executable, os.path.join(launch.HERE, "workers", "allreduce_time.py"),
                                  str(n), str(out)], timeout=120, env={"PYTHONPATH": ROOT + "/python"})
    assert not any(x in namespaces() for x in names), "namespaces left behind"
    assert codes == [0, 0]
    res = json.loads(out.read_text())
    assert res["value"] == 2.0 and res["size"] == 2
    return res["seconds"]


@pytest.mark.multiproc
@pytest.mark.skipif(not CAN_RUN, reason="needs root with ip and tc (network namespaces)")
def test_shaped_link_limits_the_rate(tmp_path):
    # 5 MB allreduce on 2 ranks: each rank sends 5 MB; at 50 Mbit/s that takes at least 0.8 s
    shaped = allreduce_seconds("50mbit", tmp_path)
    free = allreduce_seconds(None, tmp_path)
    assert 0.7 < shaped < 5.0, shaped
    assert free < shaped / 4, (free, shaped)


def test_clear_errors(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(PermissionError, match="netem: needs root"):
        NetEm(2).__enter__()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(shutil, "which", lambda tool: None)
    with pytest.raises(FileNotFoundError, match="`ip` not found"):
        NetEm(2).__enter__()
    with pytest.raises(ValueError, match="rate must look like"):
        parse_rate("fast")
    assert parse_rate("1gbit") == 10**9 and parse_rate("100mbit") == 10**8
    with pytest.raises(ValueError, match="nranks must be >= 1"):
        NetEm(0)


def auto_run(rate, batch, tmp_path):
    """OSP(auto) for 16 steps on 2 ranks (a 3.2M-parameter MLP), with the throughput bench's own worker;
    returns the critical share of every step and what the budget measured."""
    out = tmp_path / f"auto-{rate}.json"
    argv = [sys.executable, os.path.join(ROOT, "bench", "train_throughput.py"), "--worker", "--contender",
            "osp-auto", "--out", str(out), "--model", "mlp", "--width", "1024", "--batch", str(batch), "--steps",
            "6", "--warmup", "10"]
    with NetEm(2, rate=rate, tag=f"t{os.getpid() % 1000}") as net:
        codes = net.run("torch", argv, timeout=300, env={"PYTHONPATH": ROOT + "/python:" + ROOT})
    assert codes == [0, 0]
    res = json.loads(out.read_text())
    return res["criticals"], res["budget"]


@pytest.mark.multiproc
@pytest.mark.skipif(not CAN_RUN, reason="needs root with ip and tc (network namespaces)")
def test_auto_defers_behind_a_slow_link_and_not_on_a_fast_one(tmp_path):
    """Real ranks, real links. Behind 1 Gbit/s the 12.5 MB allreduce (0.1 s) is twice the compute (batch
    256): after its warm-up and two measured BSP steps 'auto' defers (by the fifth step) and keeps one share,
    or moves one grid step at most. On loopback, with a larger batch (the allreduce about a fifth of backward),
    it stays on BSP's code, or tries one share, finds it slower by its measured steps and comes back for good."""
    from osp import stepmodel

    slow, budget = auto_run("1gbit", 256, tmp_path)
    start = next((t for t, c in enumerate(slow) if c < 1.0), None)
    assert slow[:2] == [1.0] * 2 and start is not None and start <= 4, (slow, budget)
    grid = stepmodel.shares(0.05)
    ran = sorted({min(grid, key=lambda g: abs(g - c)) for c in slow[start:]}, reverse=True)
    assert all(c < 1.0 for c in slow[start:]) and len(ran) <= 2, (slow, budget)
    assert len(ran) < 2 or grid.index(ran[1]) - grid.index(ran[0]) == 1, (slow, budget)
    fast, budget = auto_run(None, 1024, tmp_path)
    changes = [t for t in range(1, len(fast)) if fast[t] != fast[t - 1]]
    assert fast[-1] == 1.0 and len(changes) in (0, 2), (fast, budget)
    if changes:  # one trial, measured slower: back to BSP, and every deferring share vetoed
        assert budget["decisions"][-1]["why"].startswith("back:") and budget["vetoed"], (fast, budget)
