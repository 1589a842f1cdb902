"""A rank that runs out of data calls ``opt.join()`` and shadows the others' steps until every rank has
(tests/workers/join_worker.py): a clean finish at the same step on every rank, replicas bitwise equal,
the trajectory a replay's; never a hang until the timeout."""
import os

import pytest

import launch

WORKER = os.path.join(launch.HERE, "workers", "join_worker.py")
MODES = "bsp,osp-0.5,dsync-2,hsp"


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,backend,nranks", [("spawn", "torch", 3), ("horovod", "horovod", 2)])
def test_uneven_data_joins_cleanly(launcher, backend, nranks, tmp_path):
    proc = launch.run(launcher, nranks, [WORKER, backend, str(tmp_path), MODES], timeout=240)
    launch.check(proc)
    results = launch.rank_results(tmp_path, nranks, proc)
    names = {n for r in results for n in r["checks"]}
    assert len(names) == 4 * 4 - 1 + 4 * 2, sorted(names)
