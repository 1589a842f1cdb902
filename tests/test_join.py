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


AMP_WORKER = os.path.join(launch.HERE, "workers", "join_amp_worker.py")
AMP_MODES = ["bsp", "osp-0.5", "dsync-2", "hsp"]


@pytest.mark.multiproc
def test_join_keeps_grad_scalers_in_step(tmp_path):
    """A joined rank's shadow steps go through its GradScaler as the others' steps do, and every scaler ends join()
    with the last joiner's state: the replicas stay bitwise equal while the scale moves on; a rank that never
    stepped through a scaler raises the same error on every rank (tests/workers/join_amp_worker.py)."""
    proc = launch.run("spawn", 2, [AMP_WORKER, "torch", str(tmp_path), ",".join(AMP_MODES + ["no-batch"])],
                      timeout=180)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    want = {f"{m}/{c}" for m in AMP_MODES for c in ("scaler_equal_after_join", "replicas_equal_after_join",
                                                      "replicas_equal_while_joined", "scale_moved_after_join",
                                                      "scaler_equal_after_training_on",
                                                      "replicas_equal_after_training_on")}
    want |= {"no_batch/same_error_on_every_rank", "no_batch/replicas_equal"}
    assert all(set(r["checks"]) == want for r in results), [sorted(r["checks"]) for r in results]


DSYNC_WORKER = os.path.join(launch.HERE, "workers", "join_dsync_worker.py")
DSYNC_MODES = ["dsync-auto", "dsync-2", "hsp-dsync-auto", "hsp-dsync-2"]


@pytest.mark.multiproc
def test_join_under_dsync_leaves_at_the_same_step(tmp_path):
    """DSync reads each step's record ``delay`` steps late, and with ``delay="auto"`` each rank has its own
    delay: join() still returns on every rank at the same step (tests/workers/join_dsync_worker.py)."""
    proc = launch.run("spawn", 2, [DSYNC_WORKER, "torch", str(tmp_path), ",".join(DSYNC_MODES)], timeout=180)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    want = {f"{m}/{c}" for m in DSYNC_MODES for c in ("same_steps", "replicas_equal", "equals_replay", "trains_after")}
    want.add("dsync-auto/read_at_different_steps")
    assert all(set(r["checks"]) == want for r in results), [sorted(r["checks"]) for r in results]
