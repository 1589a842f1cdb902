"""Oracle 3: OSP's provisional step (what the next forward computes with) against pure PyTorch on 2 real
ranks: critical blocks from the average, deferred ones from the rank's own gradient, clipped by the norm
of that provisional gradient, the critical blocks the top ones by score in each bucket, the scores those of
the latest landed averages (tests/workers/provisional_worker.py)."""
import os

import pytest

import launch

CASES = ["osp-0.25/sgd", "osp-0.25/sgd/clip", "osp-0.5/adamw", "osp-0.1/adamw/clip"]


@pytest.mark.multiproc
def test_provisional_step_equals_the_pure_pytorch_reference(tmp_path):
    proc = launch.run("spawn", 2, [os.path.join(launch.HERE, "workers", "provisional_worker.py"), str(tmp_path)],
                      timeout=300)
    launch.check(proc)
    for r in launch.rank_results(tmp_path, 2, proc):
        assert sorted(r["checks"]) == sorted(CASES)
