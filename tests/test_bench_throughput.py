"""The throughput bench's bookkeeping for stragglers: a contender's name maps to the osp mode it runs
(``hsp-<mode>``: HSP composed with it), and the composed ceiling is the formula benchmarks.md states."""
import argparse
import os
import sys

import pytest

import launch

ROOT = os.path.dirname(launch.HERE)
sys.path.insert(0, ROOT)
import osp  # noqa: E402
from bench import time_to_accuracy as tta  # noqa: E402
from bench import train_throughput as tp  # noqa: E402

A = argparse.Namespace(max_extra=3, block_size=4096)


def test_contender_names_map_to_modes():
    hsp = tp.osp_sync("hsp-osp-auto", A)
    assert isinstance(hsp, osp.HSP) and hsp.max_extra == 3
    assert isinstance(hsp.sync, osp.OSP) and hsp.sync.critical == "auto"
    d = tp.osp_sync("hsp-dsync-2", A).sync
    assert isinstance(d, osp.DSync) and d.delay == 2
    assert isinstance(tp.osp_sync("hsp-bsp", A).sync, osp.BSP)
    assert tp.osp_sync("osp-0.25", A).critical == 0.25
    assert tta.split_contender("hsp-osp-auto")[0] == ["--sync", "hsp", "--hsp-sync", "osp", "--critical", "auto"]
    slow = argparse.Namespace(straggler=2.0, ranks=3, max_extra=4)
    assert tta.straggler_argv(slow) == ["--max-extra", "4", "--straggler", "2:2"]
    assert tta.straggler_argv(argparse.Namespace(straggler=1.0)) == []


@pytest.mark.parametrize("k,max_extra,compute_s,allreduce_s,want", [
    # 2 ranks, rank 1 2x slower: rank 0 computes 2 micro-batches in its one; compute is the bound
    (2.0, 3, 0.1, 0.15, 3 * 64 / 0.2),
    # 4x slower but max_extra=2 caps rank 0 at 3 micro-batches; the allreduce (0.5 s) is the bound
    (4.0, 2, 0.1, 0.5, 4 * 64 / 0.5),
    # balanced: 2 micro-batches over max(compute, allreduce)
    (1.0, 3, 0.1, 0.15, 2 * 64 / 0.15),
])
def test_the_composed_ceiling(k, max_extra, compute_s, allreduce_s, want):
    row = {"straggler": k, "ranks": 2, "batch": 64, "max_extra": max_extra}
    assert tp.ceiling(row, compute_s, allreduce_s) == pytest.approx(want)


def test_the_straggler_table_names_the_slow_rank_and_the_best_alone():
    rows = [{"contender": c, "model": "mlp", "batch": 64, "rate": "1gbit", "ranks": 2, "straggler": 2.0,
             "step_s": s, "samples_per_s": sps, "arrivals": arr, "slow_rank_warnings": warn,
             "bytes": 4e6, "compute_alone_s": 0.1}
            for c, s, sps, arr, warn in [
                ("compute", 0.1, 640.0, None, []), ("allreduce", 0.15, 0.0, None, []),
                ("hsp-bsp", 0.3, 400.0, {"slow_rank": None}, []),
                ("osp-auto", 0.25, 500.0, {"slow_rank": 1, "slower": 2.1}, ["rank 1 ..."]),
                ("hsp-osp-auto", 0.2, 700.0, {"slow_rank": 1, "slower": 1.9}, [])]]
    tp.add_bounds(rows)
    text = tp.straggler_table(rows)
    line = next(x for x in text.splitlines() if "| hsp-osp-auto |" in x)
    assert "| 1.40 |" in line and "rank 1 (1.9x)" in line and "warned" not in line  # 700 / max(400, 500)
    assert "rank 1 (2.1x), warned" in next(x for x in text.splitlines() if "| osp-auto |" in x)
    assert rows[-1]["ceiling_sps"] == pytest.approx(3 * 64 / 0.2)


def _row(contender, sps, rate="1gbit", **kw):
    return {"contender": contender, "model": "mlp", "batch": 64, "rate": rate, "ranks": 2, "straggler": 1.0,
            "step_s": 128 / sps, "samples_per_s": sps, "bytes": 4e6, "compute_alone_s": 0.1, **kw}


def test_auto_is_compared_with_the_best_fixed_mode_of_its_group():
    """auto_vs_best_fixed: OSP auto's samples/s over the best fixed osp mode that ran (without error) in the
    same group, named in best_fixed; chosen_critical: the share its budget ran at the end."""
    budget = {"phase": "auto", "fraction": 0.31}
    rows = [_row("osp-bsp", 400.0), _row("osp-0.25", 500.0), _row("osp-0.5", 450.0),
            {**_row("osp-0.1", 1e9), "error": "exit codes [1, 1]: boom"},  # failed: not a candidate
            _row("osp-auto", 550.0, budget=budget), _row("fsdp", 300.0), _row("ddp", 350.0),
            # another group (rate none): its faster fixed mode must not count for 1gbit's auto
            _row("osp-0.1", 900.0, rate="none"),
            _row("osp-auto", 600.0, rate="none", budget={"phase": "warmup", "fraction": 1.0}),
            _row("osp-auto", 700.0, rate="10gbit")]  # no fixed mode ran beside it
    tp.add_bounds(rows)
    auto = rows[4]
    assert auto["best_fixed"] == "osp-0.25" and auto["auto_vs_best_fixed"] == pytest.approx(550 / 500)
    assert auto["chosen_critical"] == 0.31
    other = rows[8]
    assert other["best_fixed"] == "osp-0.1" and other["auto_vs_best_fixed"] == pytest.approx(600 / 900)
    assert other["chosen_critical"] is None  # still in its warm-up when the run ended
    assert "best_fixed" not in rows[9] and "auto_vs_best_fixed" not in rows[9]
    assert all("auto_vs_best_fixed" not in r for r in rows if r["contender"] != "osp-auto")
    assert rows[5]["x_ddp"] == pytest.approx(300 / 350)  # fsdp rows get the same ratios as every contender
    text = tp.table(rows)
    head = text.splitlines()[0]
    assert "| auto vs best fixed | auto's share |" in head
    ncols = head.count("|")
    for line in text.splitlines()[2:len(rows) + 2]:
        assert line.count("|") == ncols, line  # failed rows too
    line = next(x for x in text.splitlines() if "| osp-auto |" in x and "| 1gbit |" in x)
    assert line.endswith("| 1.10 (osp-0.25) | 0.31 |")
    assert next(x for x in text.splitlines() if "| osp-auto |" in x and "| none |" in x).endswith(
        "| 0.67 (osp-0.1) | measuring |")
    assert next(x for x in text.splitlines() if "| fsdp |" in x).endswith("| - | - |")


def test_fsdp_is_a_contender():
    assert "fsdp" in tp.CONTENDERS and {"fsdp", "fsdp+fp16"} <= set(tp.COMPRESSION_CONTENDERS)
    assert tp.engine("fsdp", "horovod") == tp.engine("fsdp+fp16", "torch") == "torch"
    assert set(tp.FIXED_OSP) <= set(tp.CONTENDERS)


class _FailingNetEm:
    """NetEm's interface, no namespaces: its run writes what a failed worker's rank 0 leaves (its error)."""

    def __init__(self, ranks, rate=None, switch=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run(self, backend, argv, timeout, env, log_prefix):
        out = argv[argv.index("--out") + 1]
        with open(out, "w") as fh:
            fh.write('{"error": "FSDP2 (fully_shard) on CPU/Gloo, gpt: RuntimeError: no"}')
        return [1, 1]


def test_a_workers_own_error_is_the_rows_error(tmp_path):
    a = argparse.Namespace(width=64, steps=2, warmup=1, block_size=4096, osp_backend="torch", jitter=0.0,
                           timing="median", max_extra=4, switch=None, run_timeout=30)
    r = tp.run_contender(_FailingNetEm, "none", 2, "fsdp+fp16", a, str(tmp_path), "gpt", 8)
    assert r["error"] == "exit codes [1, 1]: FSDP2 (fully_shard) on CPU/Gloo, gpt: RuntimeError: no"
    assert (r["contender"], r["model"], r["rate"]) == ("fsdp+fp16", "gpt", "none")


@pytest.mark.parametrize("model,unit", [("mlp", "Linear"), ("resnet18", "BasicBlock"), ("gpt", "Block")])
def test_fsdp_shards_each_layer_or_block(model, unit, one_rank):
    """osp.train.fully_shard_model: a unit per layer of the MLP and per block of ResNet-18 and the GPT, then the
    root; the model still trains (one rank)."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    from bench.models import build
    from osp.train import fully_shard_model

    net, make_batch, loss_fn = build(model, 64)
    fully_shard_model(net, "fp16")
    sharded = [type(m).__name__ for m in net.modules() if isinstance(m, FSDPModule)]
    counts = {"mlp": 3, "resnet18": 8, "gpt": 4}
    assert isinstance(net, FSDPModule) and sharded.count("FSDP" + unit) == counts[model], sharded
    assert len(sharded) == counts[model] + 1
    opt = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    x, y = make_batch(2, torch.Generator().manual_seed(0))
    loss_fn(net(x), y).backward()
    opt.step()
    with pytest.raises(ValueError, match="FSDP reduces in float32"):
        fully_shard_model(build("mlp", 8)[0], "powersgd")


@pytest.mark.multiproc
def test_the_fsdp_worker_reports_a_row_like_ddps(tmp_path):
    """The bench's worker on 2 real ranks (no network namespaces): fsdp+fp16 trains and writes the fields every
    contender's row has, which add_bounds then turns into ratios and shares."""
    out = tmp_path / "row.json"
    proc = launch.run("spawn", 2, [os.path.join(ROOT, "bench", "train_throughput.py"), "--worker", "--contender",
                                   "fsdp+fp16", "--model", "mlp", "--width", "64", "--batch", "8", "--steps", "2",
                                   "--warmup", "1", "--out", str(out)],
                      timeout=120, env={"MASTER_PORT": str(launch.free_port())})
    launch.check(proc)
    import json

    r = json.loads(out.read_text())
    assert r["contender"] == "fsdp+fp16" and r["ranks"] == 2 and r["params"] == 1024 * 64 + 64 * 64 + 64 * 1000 + 64 \
        + 64 + 1000
    for k in ("step_s", "samples_per_s", "compute_alone_s", "bytes", "micro_batches_per_step"):
        assert r[k] > 0, k
    r["rate"] = "none"
    tp.add_bounds([r])
    assert r["share_of_bound"] > 0 and r["bound_from"] == "estimate"
