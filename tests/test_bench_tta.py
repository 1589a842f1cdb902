"""The time-to-accuracy bench's bookkeeping: compressed contenders map to osp.train's flags, and each
speedup is a baseline's time to the target over the contender's, from the runs' own epoch records."""
import argparse
import os
import sys

import pytest
import torch

import launch

ROOT = os.path.dirname(launch.HERE)
sys.path.insert(0, ROOT)
from bench import time_to_accuracy as tta  # noqa: E402
from osp.train import make_optimizer  # noqa: E402


def run(times_accs):
    """An osp.train result whose epochs end at the given (wall_s, test_acc)."""
    eps = [{"wall_s": t, "test_acc": acc} for t, acc in times_accs]
    return {"epochs": eps, "final_test_acc": eps[-1]["test_acc"], "train_s": eps[-1]["wall_s"], "samples_per_s": 1.0}


def test_compressed_contenders_map_to_osp_train_flags():
    assert tta.split_contender("osp-auto+fp16") == (["--sync", "osp", "--critical", "auto", "--compression", "fp16"],
                                                    "torch")
    assert tta.split_contender("hvd+fp16")[1] == "horovod"
    assert tta.split_contender("ddp")[0] == ["--sync", "ddp"]
    for bad in ("ddp+int8", "nope", "+fp16"):
        with pytest.raises(ValueError, match="unknown contender"):
            tta.split_contender(bad)
    a = argparse.Namespace(contenders="compression", versus=None)
    contenders, bases = tta.pick(a)
    assert contenders[0] == "bsp" and "ddp+powersgd" in contenders and bases == ("bsp", "ddp+fp16")
    with pytest.raises(ValueError, match="not among the contenders"):
        tta.pick(argparse.Namespace(contenders="bsp,osp-auto", versus="ddp+fp16"))


def test_speedups_are_the_baselines_time_over_the_contenders():
    # BSP ends at 0.9 on both seeds: the target; ddp+fp16 reaches it at 8 and 12 s, osp at 4 and 6 s
    runs = {"bsp/0": run([(5, 0.5), (10, 0.9)]), "bsp/1": run([(5, 0.5), (10, 0.9)]),
            "ddp+fp16/0": run([(4, 0.6), (8, 0.95)]), "ddp+fp16/1": run([(6, 0.7), (12, 0.9)]),
            "osp-auto+fp16/0": run([(4, 0.92)]), "osp-auto+fp16/1": run([(3, 0.8), (6, 0.91)]),
            "ddp+powersgd/0": run([(4, 0.5), (8, 0.6)]), "ddp+powersgd/1": {"error": "rank 1 timed out"}}
    cs = ["bsp", "ddp+fp16", "osp-auto+fp16", "ddp+powersgd"]
    s = tta.summarize(runs, cs, [0, 1], bases=("bsp", "ddp+fp16"))
    assert s["target"] == pytest.approx(0.9)
    per = s["contenders"]
    assert per["osp-auto+fp16"]["speedup_vs_bsp"] == pytest.approx(20 / 10)
    assert per["osp-auto+fp16"]["speedup_vs_ddp+fp16"] == pytest.approx(20 / 10)
    assert per["ddp+fp16"]["speedup_vs_bsp"] == pytest.approx(20 / 20)
    assert per["ddp+powersgd"]["reached"] == 0 and per["ddp+powersgd"]["speedup_vs_bsp"] is None
    row = next(x for x in s["rows"] if x["contender"] == "osp-auto+fp16" and x["seed"] == 1)
    assert row["speedup_vs_ddp+fp16"] == pytest.approx(12 / 6) and row["speedup_vs_bsp"] == pytest.approx(10 / 6)
    a = argparse.Namespace(ranks=2, rate="1gbit", model="mlp", width=32, channels=16, lr=0.1, batch_size=256,
                           epochs=2, eval_every=1, seeds="0,1")
    text = tta.tables(s, a, ("bsp", "ddp+fp16"))
    assert "speedup vs ddp+fp16" in text and "failed: rank 1 timed out" in text and "2.00x" in text


def test_powersgd_is_ddps_alone():
    """osp.train --compression powersgd names DDP's hook: under an osp mode or Horovod it is refused,
    saying what it is, before any rank connects."""
    model = torch.nn.Linear(2, 2)
    for sync in ("osp", "bsp", "hvd"):
        args = argparse.Namespace(sync=sync, compression="powersgd", optimizer="sgd", lr=0.1, weight_decay=0.0)
        with pytest.raises(ValueError, match="DDP's PowerSGD hook .*got --sync " + sync):
            make_optimizer(args, model, None, "torch")


def test_fsdp_contenders_map_to_osp_train_flags():
    assert "fsdp" in tta.CONTENDERS and "fsdp+fp16" in tta.PRESETS["compression"]
    assert tta.split_contender("fsdp") == (["--sync", "fsdp"], "torch")
    assert tta.split_contender("fsdp+fp16") == (["--sync", "fsdp", "--compression", "fp16"], "torch")
    for bad in ("fsdp+powersgd", "osp-auto+powersgd"):  # PowerSGD is DDP's hook alone
        with pytest.raises(ValueError, match="unknown contender .*ddp\\+powersgd only"):
            tta.split_contender(bad)


@pytest.mark.parametrize("flags,message", [
    (["--link", "1gbit"], "--sync fsdp: no --link"),
    (["--checkpoint-dir", "ck"], "no --checkpoint-dir"),
    (["--backend", "horovod"], "--sync fsdp needs torch.distributed"),
])
def test_osp_train_refuses_what_fsdp_cannot_do(flags, message, capsys):
    """Before any rank connects: no emulated link (FSDP's collectives are not emulated), no checkpoints
    (rank 0 would save its shards alone), no Horovod engine."""
    from osp import train

    with pytest.raises(SystemExit) as e:
        train.main(["--sync", "fsdp", *flags])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.multiproc
def test_an_fsdp_contender_trains_as_the_bench_runs_it(tmp_path):
    """The bench's own command line for fsdp+fp16 (train_argv), on 2 real ranks without namespaces: osp.train
    --sync fsdp learns, and the replicas (each rank's shards gathered) end bitwise equal."""
    import json

    out = str(tmp_path / "fsdp.json")
    a = argparse.Namespace(epochs=2, batch_size=64, lr=0.1, model="mlp", eval_every=1, width=2, channels=16,
                           straggler=1.0)
    argv = tta.train_argv("fsdp+fp16", 0, a, out)
    proc = launch.run("spawn", 2, argv[1:], timeout=120, env={"MASTER_PORT": str(launch.free_port())})
    launch.check(proc)
    r = json.loads(open(out).read())
    assert (r["config"]["sync"], r["config"]["compression"], r["config"]["ranks"]) == ("fsdp", "fp16", 2)
    assert len(r["epochs"]) == 2 and r["final_test_acc"] > 0.5, r["epochs"]
    assert len(set(r["replica_digests"])) == 1
