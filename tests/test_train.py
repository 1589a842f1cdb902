"""The example job end to end: real ranks train the digits CNN and write metrics."""
import json
import subprocess
import sys

import pytest
import torch

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
    assert p.returncode == 2 and "argument --critical: must be a number in [0, 1] or 'auto', got 'most'" in p.stderr
    p = subprocess.run([sys.executable, "-m", "osp.train", "--sync", "hsp", "--straggler", "2:2"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "--straggler 2:2: RANK must be in [0, 0] and FACTOR >= 1" in p.stderr


@pytest.mark.parametrize("argv,message", [
    (["--fault", "1:5"], "--fault 1:5: RANK must be in [0, 0] and STEP >= 1"),
    (["--fault", "0:x"], "--fault must be RANK:STEP (e.g. 1:10), got '0:x'"),
    (["--elastic", "--sync", "hsp"], "--elastic runs --sync bsp, osp or dsync (osp.elastic.State), got --sync hsp"),
    (["--elastic"], "--elastic needs horovodrun (Horovod Elastic); under torchrun use --checkpoint-dir"),
    (["--checkpoint-every", "0"], "argument --checkpoint-every: must be an integer >= 1, got '0'"),
    (["--eval-every", "0"], "argument --eval-every: must be an integer >= 1, got '0'"),
])
def test_train_rejects_bad_fault_and_restart_options(argv, message):
    p = subprocess.run([sys.executable, "-m", "osp.train", "--epochs", "1", *argv], capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]


def train(argv, timeout=300):
    """One process of osp.train (no launcher)."""
    return subprocess.run([sys.executable, "-m", "osp.train", *argv], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("argv,message", [
    (["--critical", "1.5"], "argument --critical: must be a number in [0, 1] or 'auto', got '1.5'"),
    (["--critical", "nan"], "argument --critical: must be a number in [0, 1] or 'auto', got 'nan'"),
    (["--delay", "0"], "argument --delay: must be an integer >= 1 or 'auto', got '0'"),
    (["--min-critical", "2"], "argument --min-critical: must be a number in [0, 1], got '2'"),
    (["--max-delay", "0"], "argument --max-delay: must be an integer >= 1, got '0'"),
    (["--max-extra", "-1"], "argument --max-extra: must be an integer >= 0, got '-1'"),
    (["--epochs", "0"], "argument --epochs: must be an integer >= 1, got '0'"),
    (["--lr", "-0.1"], "argument --lr: must be a number >= 0, got '-0.1'"),
    (["--metric", "l3"], "argument --metric: invalid choice: 'l3'"),
    (["--link", "1Gbps"], "argument --link: got '1Gbps': write a link rate in bits per second with 'bit'"),
    (["--link", "1gbit,soon"], "argument --link: latency must be a number >= 0 with a unit"),
    (["--latency", "200us"], "--latency goes with --link RATE"),
    (["--link", "1gbit", "--latency", "soon"], "argument --latency: latency must be a number >= 0 with a unit"),
    (["--sync", "ddp", "--backend", "torch", "--link", "1gbit", "--compression", "powersgd"],
     "--link with --compression powersgd: the emulation cannot tell how many bytes PowerSGD sends"),
])
def test_bad_values_are_one_line_and_exit_2(argv, message):
    """Validated by argparse before any engine starts: exit code 2 and one line on stderr, no traceback."""
    p = train(argv, timeout=120)
    assert p.returncode == 2 and message in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr, p.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch sees a GPU")
def test_device_cuda_without_cuda_says_so_up_front():
    p = train(["--device", "cuda", "--epochs", "1"], timeout=120)
    if torch.version.cuda is None:
        expected = f"--device cuda: this torch has no CUDA (torch {torch.__version__}); use --device cpu"
    else:
        expected = f"--device cuda: torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU"
    assert p.returncode == 2 and expected in p.stderr, p.stderr[-2000:]
    assert len(p.stderr.strip().splitlines()) == 1 and "NCCL" not in p.stderr, p.stderr


def test_help_gives_every_flag_a_help_and_its_default():
    from osp.train import build_parser

    ap = build_parser()
    missing = [a.option_strings for a in ap._actions if not a.help]
    assert not missing, missing
    text = " ".join(ap.format_help().split())
    text = text[text.index(" options: "):]
    for flag, default in (("--critical", "auto"), ("--min-critical", "0.05"), ("--delay", "2"), ("--sync", "osp"),
                          ("--block-size", "512"), ("--epochs", "15"), ("--backend", "auto")):
        after = text[text.index(f" {flag} "):]
        assert f"(default: {default})" in after[:600], (flag, after[:600])
    assert ap.get_default("critical") == "auto"  # as osp.OSP()'s


@pytest.mark.parametrize("sync,shown,hidden,decided", [
    ("bsp", "sync=bsp ranks=1", ["critical=", "delay="], []),
    ("dsync", "sync=dsync delay=2 ranks=1", ["critical="], ["DSync: delay 2 (fixed)"]),
    ("osp", "sync=osp critical=auto min_critical=0.05 block_size=512 metric=l2 ranks=1", ["delay="],
     ["OSP auto: critical share "]),
    ("hvd", None, [], []),
])
def test_header_shows_the_modes_options_and_the_end_what_it_decided(sync, shown, hidden, decided, tmp_path):
    """One rank: the header names only the chosen mode's options; the end says what the mode decided (OSP auto:
    the share and why) and, with one rank, nothing about arrivals."""
    if sync == "hvd":  # the contenders' headers carry no osp option either
        from osp.train import build_parser, mode_words

        for name, words in (("hvd", "sync=hvd (horovod.torch.DistributedOptimizer)"),
                            ("ddp", "sync=ddp (DistributedDataParallel)")):
            assert mode_words(build_parser().parse_args(["--sync", name])) == words
        return
    out = tmp_path / "m.json"
    p = train(["--sync", sync, "--epochs", "1", "--json", str(out)])
    launch.check(p)
    header = next(ln for ln in p.stdout.splitlines() if ln.startswith("osp.train: sync="))
    assert shown in header and not any(h in header for h in hidden), header
    assert "backend=torch (no launcher: one process)" in header, header
    for line in decided:
        assert f"osp.train: {line}" in p.stdout, p.stdout
    assert "arrivals" not in p.stdout and "slow rank" not in p.stdout, p.stdout
    res = json.loads(out.read_text())
    assert [ln for ln in res["decisions"] if any(d in ln for d in decided)] or not decided, res["decisions"]


@pytest.mark.multiproc
def test_train_behind_an_emulated_link_names_it(tmp_path):
    """--link: the output says what the link is (emulated, user space, not a real network; where the real-link
    figures are), every collective books it, the job still learns, and OSP auto's decision and the slow-rank
    verdict are printed."""
    out = tmp_path / "m.json"
    proc = launch.run("spawn", 2, ["-m", "osp.train", "--sync", "osp", "--epochs", "2", "--link", "100mbit,1ms",
                                   "--backend", "torch", "--json", str(out)],
                      env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(launch.free_port())})
    launch.check(proc)
    text = proc.stdout
    assert "osp.train: emulated link: 100 Mbit/s, 1000 us per collective (user space; not a real network)" in text
    assert "docs/benchmarks.md" in text and "osp.train: OSP auto: critical share" in text, text
    assert "no slow rank" in text or "slow rank" in text, text
    res = json.loads(out.read_text())
    assert res["config"]["link"] == "100mbit,1ms"
    steps = res["steps"]
    lk = res["link"]
    # every step books at least its gradient's collectives and the agreement record, each >= 1 ms
    assert lk["collectives"] >= 2 * steps and lk["link_s"] >= lk["collectives"] * 1e-3, (lk, steps)
    assert lk["held_s"] > 0, lk
    assert res["epochs"][-1]["train_loss"] < res["epochs"][0]["train_loss"], res["epochs"]


@pytest.mark.parametrize("env,backend", [
    ({"HOROVOD_RANK": "0", "HOROVOD_HOSTNAME": "localhost"}, "horovod"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "torch"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib"}, "horovod"),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_MCA_pml": "ob1", "OMPI_MCA_btl": "^openib", "MASTER_ADDR": "h"}, "horovod"),
    ({"OMPI_COMM_WORLD_RANK": "0", "MASTER_ADDR": "127.0.0.1"}, "torch"),
    ({"PMI_RANK": "0", "PMI_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "torch"),
    ({}, "single"),
])
def test_backend_detection(env, backend):
    from osp.launcher import detect_backend

    assert detect_backend(env)[0] == backend


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_backend_auto_under_mpi_is_horovod(launcher, tmp_path):
    """horovodrun without --gloo runs mpirun, which sets no HOROVOD_* variable: --backend auto still picks Horovod
    (and says why); so does plain mpirun where no MASTER_ADDR is given for torch.distributed."""
    launch.need_horovod()
    import horovod.torch as hvd

    if not hvd.mpi_built():
        pytest.skip("this Horovod has no MPI")
    out = tmp_path / "m.json"
    train_argv = [launch.PY, "-m", "osp.train", "--sync", "bsp", "--epochs", "1", "--no-progress", "--json", str(out)]
    if launcher == "horovodrun":
        exe = launch.shutil.which("horovodrun", path=launch.os.path.dirname(launch.PY)) or "horovodrun"
        cmd = [exe, "-np", "2", "-H", "localhost:2", "--start-timeout", "60", *train_argv]
    else:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "PYTHONPATH", "-x",
               "OMP_NUM_THREADS", *train_argv]
    env = launch._env()
    for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "HOROVOD_RANK"):  # none of torch's rendezvous
        env.pop(k, None)
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        stdout, stderr = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        launch.os.killpg(p.pid, 9)
        stdout, stderr = p.communicate()
    launch.check(subprocess.CompletedProcess(cmd, p.returncode, stdout, stderr))
    res = json.loads(out.read_text())
    assert res["config"]["ranks"] == 2 and res["config"]["backend"] == "horovod", res["config"]
    why = "horovodrun over MPI" if launcher == "horovodrun" else "no MASTER_ADDR for torch.distributed"
    assert why in res["config"]["backend_why"], res["config"]


@pytest.mark.parametrize("env,refused", [
    ({"WORLD_SIZE": "2", "RANK": "0"}, "WORLD_SIZE=2"),  # torchrun's
    ({"HOROVOD_SIZE": "3", "HOROVOD_RANK": "0"}, "HOROVOD_SIZE=3"),  # horovodrun --gloo's
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE=2"),  # mpirun's
    ({"WORLD_SIZE": "1", "RANK": "0"}, None),
    ({"WORLD_SIZE": "2", "HOROVOD_ELASTIC": "1"}, None),  # Horovod Elastic: the world changes as hosts do
    ({}, None),
])
def test_a_launchers_ranks_on_an_engine_of_one_are_refused(one_rank, env, refused):
    """A launcher started N > 1 ranks, and the engine (a real one-rank Gloo group here) came up with one: each
    process would train alone and exit 0 (issue 57: torchrun with --backend horovod). The launcher's own count
    is named."""
    from osp.comm import TorchComm
    from osp.launcher import check_launched

    if refused is None:
        check_launched(TorchComm(), env)
        return
    with pytest.raises(RuntimeError, match=f"the launcher started .* ranks \\({refused}\\) but the torch engine "
                                           "came up with 1"):
        check_launched(TorchComm(), env)


@pytest.mark.multiproc
def test_torchrun_with_the_horovod_backend_is_refused_not_split(tmp_path):
    """torchrun --nproc-per-node 2 -m osp.train --backend horovod: each process's hvd.init() comes up alone. Before,
    two one-rank trainings ran and the job exited 0; now every rank refuses, naming torchrun's count."""
    launch.need_horovod()
    proc = launch.run_cmd(launch.torchrun_cmd(2, ["-m", "osp.train", "--backend", "horovod", "--sync", "bsp",
                                                  "--epochs", "1", "--no-progress"]), timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    out = proc.stdout + proc.stderr
    assert "the launcher started 2 ranks (WORLD_SIZE=2) but the horovod engine came up with 1" in out, out[-3000:]
    assert "ranks=1" not in out, out[-3000:]  # no training started


def fake_run(sync, rates, critical="auto", share=None, acc=0.95, ranks=2, link=None):
    """osp.train results of one configuration, one per samples/s in ``rates`` (steady part: steps 11-30)."""
    runs = []
    for rate in rates:
        eps = [{"epoch": 5, "steps": 10, "wall_s": 1.0, "samples": 5120, "test_acc": acc - 0.1},
               {"epoch": 15, "steps": 20, "wall_s": 1.0 + 10240 / rate, "samples": 15360, "test_acc": acc}]
        r = {"config": {"sync": sync, "critical": critical, "delay": "2", "ranks": ranks, "compression": "none",
                        "link": link}, "epochs": eps, "final_test_acc": acc, "samples_per_s": rate * 0.9}
        if sync == "osp":
            r["osp_stats"] = {"mean": {"critical_fraction": 0.5, "stage1_s": 0.01, "stage2_wait_s": 0.0,
                                       "compute_s": 0.1},
                              "budget": {"phase": "auto", "fraction": share}}
        runs.append(r)
    return runs


def test_report_ratios_come_with_their_spread():
    from osp.report import notes, table

    results = fake_run("bsp", [1000, 1100, 900]) + fake_run("osp", [1500, 1400, 1600], share=0.1) \
        + fake_run("ddp", [800, 850, 900])
    text = table(results) + "\n" + "\n".join(notes(results))
    row = next(ln for ln in text.splitlines() if ln.startswith("| osp critical=auto"))
    assert "| 1500 (1400-1600) | 1.50 (1.27-1.78) | 1.76 (1.56-2.00) | 0.10 |" in row, row
    assert "one run" not in text and "speedup" not in text and "not OSP's doing" not in text, text


def test_report_of_single_runs_says_the_ratio_has_no_spread():
    from osp.report import notes, table

    results = fake_run("bsp", [1000]) + fake_run("osp", [1200], share=0.2)
    text = table(results) + "\n" + "\n".join(notes(results))
    row = next(ln for ln in text.splitlines() if ln.startswith("| osp critical=auto"))
    assert "1.20 (one run: no spread)" in row, row
    assert "not a measured speedup" in text and "speedup |" not in text, text


def test_report_flags_a_gain_where_osp_deferred_nothing():
    from osp.report import notes

    results = fake_run("bsp", [1000, 1010]) + fake_run("osp", [1100, 1120], share=1.0)
    flagged = [ln for ln in notes(results) if "not OSP's doing" in ln]
    assert flagged and "critical share 1.00: it deferred almost nothing" in flagged[0], notes(results)
