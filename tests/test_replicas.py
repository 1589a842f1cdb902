"""Replicas checked at runtime (``DistributedOptimizer(check_replicas=N)``, python/osp/replicas.py): ranks that
start apart raise at the first step, a planted divergence is named within one check interval, a balanced run
passes every check (tests/workers/replicas_worker.py)."""
import os

import conformance as C
import pytest
import torch

import launch
import osp
from osp.replicas import tensor_digest

WORKER = os.path.join(launch.HERE, "workers", "replicas_worker.py")


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,backend,modes", [("spawn", "torch", "bsp,osp-0.25,dsync-2,hsp,hsp-osp"),
                                                    ("horovod", "horovod", "bsp,osp-0.25")])
def test_replicas_checked_at_runtime(launcher, backend, modes, tmp_path):
    proc = launch.run(launcher, 2, [WORKER, backend, str(tmp_path), modes], timeout=240)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    names = {n for r in results for n in r["checks"]}
    assert len(names) == 7 * len(modes.split(",")), sorted(names)


@pytest.mark.multiproc
def test_a_parameter_one_rank_reaches_from_the_first_step(tmp_path):
    """Every mode, 2 ranks: a branch only rank 1 takes, from step 0. DSync starts the bucket rank 0's backward
    missed only at step(); a replica check at the step's start met rank 1's bucket there (Gloo aborted the
    process: "240 vs 16"). Replicas and optimizer state must end bitwise equal."""
    proc = launch.run("spawn", 2, [os.path.join(launch.HERE, "workers", "branch_worker.py"), "torch", str(tmp_path)],
                      timeout=240)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    assert len(results[0]["checks"]) == 2 * len([m for m in C.MODES if not m.endswith("closure")])


def test_digest_sees_one_ulp_anywhere():
    t = torch.randn(1001)
    d = tensor_digest(t)
    assert torch.equal(tensor_digest(t.clone()), d)
    for i in (0, 500, 1000):
        u = t.clone()
        u[i] = torch.nextafter(u[i], torch.tensor(float("inf")))
        assert not torch.equal(tensor_digest(u), d)
    for dtype in (torch.float16, torch.bfloat16, torch.float64):
        h = t.to(dtype)
        u = h.clone()
        u[7] = torch.nextafter(u[7], torch.tensor(float("inf"), dtype=dtype))
        assert not torch.equal(tensor_digest(u), tensor_digest(h))
    # the split of the sum does not matter: a view's pieces add up to the whole (modulo 2**32)
    parts = sum(int(tensor_digest(t[k:k + 100])) for k in range(0, 1001, 100))
    assert (parts - int(d)) % 2 ** 32 == 0


def test_check_replicas_validated(one_rank):
    m = torch.nn.Linear(2, 2)
    for bad in (-1, 1.5, True, "often"):
        with pytest.raises(ValueError, match="check_replicas must be an integer >= 0"):
            osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                     check_replicas=bad)
    with pytest.raises(ValueError, match="broadcast_parameters must be True or False"):
        osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                 broadcast_parameters=1)
