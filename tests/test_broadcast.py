"""osp.broadcast_optimizer_state and osp.elastic's sync send the state tensors in place, on each rank's
own device (tests/workers/bcast_worker.py), not pickled onto root's device through the host."""
import os

import pytest
import torch

import launch

WORKER = os.path.join(launch.HERE, "workers", "bcast_worker.py")


@pytest.mark.multiproc
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: a CUDA rank's state on its own device needs a GPU"))])
def test_state_broadcast_in_place_on_each_ranks_device(device, tmp_path):
    proc = launch.run("spawn", 2, [WORKER, "torch", str(tmp_path), device], timeout=180)
    launch.check(proc)
    launch.rank_results(tmp_path, 2, proc)


HSP_WORKER = os.path.join(launch.HERE, "workers", "bcast_hsp_worker.py")


@pytest.mark.multiproc
def test_broadcast_buffers_skips_hsp_extras(tmp_path):
    """``osp.broadcast_buffers``'s hook does not broadcast in HSP's extra micro-batches, which run on the fast
    rank alone (tests/workers/bcast_hsp_worker.py): no hang, replicas and buffers bitwise equal."""
    proc = launch.run("spawn", 2, [HSP_WORKER, "torch", str(tmp_path)], timeout=120)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    want = {"params_equal_every_step", "fast_rank_ran_extras", "buffers_equal_after_a_regular_forward", "quick"}
    assert all(set(r["checks"]) == want for r in results), [sorted(r["checks"]) for r in results]
