"""The example job end to end: real ranks train the digits CNN and write metrics."""
import json
import subprocess
import sys

import pytest

import launch


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,sync", [("horovod", "osp"), ("torch", "osp"), ("horovod", "hvd"),
                                          ("torch", "ddp")])
def test_train_job_learns_digits(backend, sync, tmp_path):
    out = tmp_path / "m.json"
    proc = launch.run(backend, 2, ["-m", "osp.train", "--sync", sync, "--epochs", "6", "--critical", "auto",
                                   "--backend", backend, "--json", str(out)])
    launch.check(proc)
    res = json.loads(out.read_text())
    assert res["config"]["ranks"] == 2 and len(res["epochs"]) == 6
    assert res["final_test_acc"] > 0.90, res["epochs"]
    assert res["epochs"][-1]["train_loss"] < res["epochs"][0]["train_loss"]
    if sync == "osp":
        st = res["osp_stats"]
        assert st["skipped_steps"] == 0 and 0 < st["mean"]["critical_fraction"] <= 1


def test_train_single_process_and_report(tmp_path):
    out = tmp_path / "bsp.json"
    proc = subprocess.run([sys.executable, "-m", "osp.train", "--sync", "bsp", "--epochs", "2", "--json", str(out)],
                          capture_output=True, text=True, timeout=300)
    launch.check(proc)
    rep = subprocess.run([sys.executable, "-m", "osp.report", str(out)], check=True, capture_output=True,
                         text=True, timeout=60).stdout
    assert "| bsp | 1 |" in rep and "+0.00" in rep


def test_train_rejects_bad_options():
    p = subprocess.run([sys.executable, "-m", "osp.train", "--critical", "most"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--critical must be a number in [0, 1] or 'auto', got 'most'" in p.stderr
