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


@pytest.mark.multiproc
@pytest.mark.parametrize("sync,flags", [("osp", ["--compression", "fp16"]),
                                        ("osp", ["--compression", "none", "--stage2-compression", "bf16"]),
                                        ("ddp", ["--compression", "fp16"])])
def test_train_with_compression(sync, flags, tmp_path):
    """--compression (osp's, or DDP's own fp16 hook) and OSP's --stage2-compression: the job learns, and osp's
    replicas end bitwise equal."""
    out = tmp_path / "m.json"
    proc = launch.run("spawn", 2, ["-m", "osp.train", "--sync", sync, "--critical", "0.25", "--epochs", "6",
                                   *flags, "--backend", "torch", "--json", str(out)])
    launch.check(proc)
    res = json.loads(out.read_text())
    assert res["config"]["compression"] == flags[1] and res["final_test_acc"] > 0.90, res["epochs"]
    if sync == "osp":
        assert len(set(res["replica_digests"])) == 1


@pytest.mark.multiproc
def test_train_hsp_with_a_straggler(tmp_path):
    """--sync hsp --straggler 1:3: the fast rank feeds extra micro-batches from its own shard, so epochs
    take fewer steps than the data holds micro-batches per rank, and the job still learns."""
    out = tmp_path / "m.json"
    proc = launch.run("spawn", 2, ["-m", "osp.train", "--sync", "hsp", "--straggler", "1:3", "--epochs", "10",
                                   "--backend", "torch", "--json", str(out)])
    launch.check(proc)
    res = json.loads(out.read_text())
    sleeps = res["config"]["straggler_sleep_s"]
    assert sleeps[0] == 0 and sleeps[1] > 0, sleeps
    per_rank = res["osp_stats"]["hsp"]["passes_per_rank"]
    assert res["osp_stats"]["hsp"]["extras"] > 0 and per_rank[0] > per_rank[1], res["osp_stats"]
    full = 1257 // (32 * 2)  # steps of an epoch without extras
    assert all(e["steps"] < full for e in res["epochs"]), [e["steps"] for e in res["epochs"]]
    assert res["final_test_acc"] > 0.88, res["epochs"]  # fewer (larger) steps an epoch than BSP: 10 epochs


@pytest.mark.multiproc
def test_train_mlp_evaluated_every_k_epochs(tmp_path):
    """--model mlp --eval-every 3: a record only at epochs 3, 6 and the last (7), each counting the steps
    and samples since the previous one; OSP's averages stay in flight across the skipped epochs' ends,
    and the replicas end bitwise equal."""
    out = tmp_path / "m.json"
    proc = launch.run("spawn", 2, ["-m", "osp.train", "--sync", "osp", "--critical", "0.25", "--model", "mlp",
                                   "--width", "4", "--epochs", "7", "--eval-every", "3", "--batch-size", "64",
                                   "--lr", "0.1", "--backend", "torch", "--json", str(out)])
    launch.check(proc)
    res = json.loads(out.read_text())
    width = 64 * 4
    assert res["config"]["params"] == (64 + 1) * width + (width + 1) * width + (width + 1) * 10
    steps = 1257 // (64 * 2)  # an epoch's steps on 2 ranks
    assert [e["epoch"] for e in res["epochs"]] == [3, 6, 7]
    assert [e["steps"] for e in res["epochs"]] == [3 * steps, 3 * steps, steps]
    assert [e["samples"] for e in res["epochs"]] == [3 * steps * 128, 6 * steps * 128, 7 * steps * 128]
    assert len(set(res["replica_digests"])) == 1
    assert res["final_test_acc"] > 0.9, res["epochs"]


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
    p = subprocess.run([sys.executable, "-m", "osp.train", "--sync", "hsp", "--straggler", "2:2"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--straggler 2:2: RANK must be in [0, 0] and FACTOR >= 1" in p.stderr


@pytest.mark.parametrize("argv,message", [
    (["--fault", "1:5"], "--fault 1:5: RANK must be in [0, 0] and STEP >= 1"),
    (["--fault", "0:x"], "--fault must be RANK:STEP (e.g. 1:10), got '0:x'"),
    (["--elastic", "--sync", "hsp"], "--elastic runs --sync bsp, osp or dsync (osp.elastic.State), got --sync hsp"),
    (["--elastic"], "--elastic needs horovodrun (Horovod Elastic); under torchrun use --checkpoint-dir"),
    (["--checkpoint-every", "0"], "--checkpoint-every must be an integer >= 1, got 0"),
    (["--eval-every", "0"], "--eval-every must be an integer >= 1, got 0"),
])
def test_train_rejects_bad_fault_and_restart_options(argv, message):
    p = subprocess.run([sys.executable, "-m", "osp.train", "--epochs", "1", *argv], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]
