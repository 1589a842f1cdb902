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
    returns the worker's result: the critical share of every step (``criticals``), what the budget measured and
    decided (``budget``), the compute alone and the gradient's bytes."""
    out = tmp_path / f"auto-{rate}.json"
    argv = [sys.executable, os.path.join(ROOT, "bench", "train_throughput.py"), "--worker", "--contender",
            "osp-auto", "--out", str(out), "--model", "mlp", "--width", "1024", "--batch", str(batch), "--steps",
            "6", "--warmup", "10"]
    with NetEm(2, rate=rate, tag=f"t{os.getpid() % 1000}") as net:
        codes = net.run("torch", argv, timeout=300, env={"PYTHONPATH": ROOT + "/python:" + ROOT})
    assert codes == [0, 0]
    return json.loads(out.read_text())


def assert_auto_kept_only_what_it_measured_faster(budget):
    """What ``auto`` guarantees on any machine, by its own measurements (not which share is fastest here: on a
    slower or busier host that is a coin toss where two shares are level): every trial it concluded stayed only
    where the new share was measured faster than the one it left and went back where it was not, and the run
    ends on the share its log last moved to."""
    share, trial = 1.0, None
    assert budget["phase"] == "auto" and budget["decisions"], budget
    for d in budget["decisions"]:
        assert d["from"] == share, (d, budget)
        t = d["trial"]
        if t is not None:  # the verdict on the trial under way
            assert trial == (t["old"], t["new"]) and d["from"] == t["new"], (d, trial, budget)
            assert t["kept"] == (t["new_s"] < t["old_s"]), (d, budget)
            assert (d["kind"], d["to"]) == (("kept", t["new"]) if t["kept"] else ("change", t["old"])), (d, budget)
            trial = None
        elif d["kind"] == "change":  # a decision: a trial starts
            trial = (d["from"], d["to"])
        share = d["to"]
    assert budget["fraction"] == share, budget


@pytest.mark.multiproc
@pytest.mark.skipif(not CAN_RUN, reason="needs root with ip and tc (network namespaces)")
def test_auto_defers_behind_a_slow_link_and_keeps_only_what_it_measured_faster(tmp_path):
    """Real ranks, real links. On loopback (batch 1024: the allreduce about a fifth of backward) whether a share is
    faster than BSP is the host's to say: auto ends where its own measurements put it, any trial kept only where
    measured faster. Then behind a link whose allreduce takes as long as this host's compute, measured on loopback
    (where deferring gains most, on a fast host and a slow one alike): after its warm-up and two measured BSP steps
    'auto' defers (by the fifth step) and ends deferring."""
    fast = auto_run(None, 1024, tmp_path)
    assert fast["criticals"][:2] == [1.0] * 2, fast
    if fast["budget"]["decisions"]:
        assert_auto_kept_only_what_it_measured_faster(fast["budget"])
    else:  # the model never predicted a gain above its margin: BSP's code throughout
        assert set(fast["criticals"]) == {1.0} and fast["budget"]["fraction"] == 1.0, fast
    rate = f"{8 * fast['bytes'] / fast['compute_alone_s'] / 1e3:.0f}kbit"  # 2 ranks' ring: 8 x bytes / rate
    slow = auto_run(rate, 1024, tmp_path)
    criticals, budget = slow["criticals"], slow["budget"]
    start = next((t for t, c in enumerate(criticals) if c < 1.0), None)
    assert criticals[:2] == [1.0] * 2 and start is not None and start <= 4, (rate, slow)
    assert_auto_kept_only_what_it_measured_faster(budget)
    last = budget["decisions"][-1]["why"]  # ends deferring, or measuring BSP again after a shift of the link
    assert budget["fraction"] < 1.0 or last.startswith("measure BSP again"), (rate, slow)
