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
