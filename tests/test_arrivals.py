"""The slow rank, named (osp.arrivals): the rule on given arrivals, and every mode's record on real ranks
(tests/workers/arrivals_worker.py; HSP and its compositions in tests/workers/hsp_worker.py)."""
import os
import warnings

import pytest

import launch
from osp.arrivals import Arrivals

WORKER = os.path.join(launch.HERE, "workers", "arrivals_worker.py")
MODES = ("bsp", "osp", "osp-auto", "dsync", "hsp-osp")


def feed(a, rows):
    for row in rows:
        a.record(row)
        a.next_step()


def test_a_persistently_slower_rank_is_named_and_warned_once_on_rank_0():
    a = Arrivals(rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed(a, [[0.0, 0.0, 0.0]] + [[100.0, 110.0, 180.0]] * (Arrivals.MIN_STEPS - 1))
        assert a.slow_rank() is None and not caught  # too few steps yet (the first, with a zero, not counted)
        feed(a, [[100.0, 110.0, 180.0]] * 10)
    st = a.stats()
    assert st["slow_rank"] == 2 and abs(st["slower"] - 180 / 105) < 1e-9 and st["steps"] == 14
    assert st["lag_ms"] == [0.0, 10.0, 80.0] and st["arrival_ms"] == [100.0, 110.0, 180.0]
    assert len(caught) == 1 and "rank 2 is 1.7x slower" in str(caught[0].message)
    other = Arrivals(rank=1)  # the same figures on another rank: named in stats, not warned
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed(other, [[100.0, 110.0, 180.0]] * 10)
    assert other.stats()["slow_rank"] == 2 and not caught


def test_balanced_or_briefly_slow_ranks_are_not_named():
    a = Arrivals(rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed(a, [[100.0, 140.0]] * 30)  # 1.4x: within the factor
        assert a.stats()["slow_rank"] is None
        feed(a, [[100.0, 400.0]] * 2 + [[100.0, 100.0]] * 30)  # a brief spell, out of the window since
    assert a.slow_rank() is None and not caught


def test_the_lag_is_behind_the_earliest_rank_not_rank_0():
    """Rank 1 arrives first here: each rank's lag is from it (rank 0's is not zero, nobody's is negative)."""
    a = Arrivals(rank=0)
    feed(a, [[150.0, 100.0, 120.0], [130.0, 110.0, 90.0]])
    assert a.stats()["lag_ms"] == [(50.0 + 40.0) / 2, (0.0 + 20.0) / 2, (20.0 + 0.0) / 2]


def test_exactly_factor_times_slower_is_not_named():
    """The rule is "more than FACTOR times": a rank exactly 1.5x slower is not named, a little more is."""
    a = Arrivals(rank=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        feed(a, [[100.0, 100.0 * Arrivals.FACTOR]] * 10)
        assert a.slow_rank() is None and a.stats()["slow_rank"] is None and not caught
        feed(a, [[100.0, 151.0]] * Arrivals.WINDOW)
    assert a.slow_rank() == (1, 1.51) and len(caught) == 1


def test_the_first_record_of_a_step_counts_and_a_new_world_starts_over():
    a = Arrivals(rank=0)
    a.record([100.0, 300.0])
    a.record([100.0, 100.0])  # a second record of the same step (e.g. a mode's second read): ignored
    a.next_step()
    assert a.stats()["arrival_ms"] == [100.0, 300.0]
    feed(a, [[50.0, 50.0, 50.0]])
    assert a.stats()["steps"] == 1 and a.stats()["arrival_ms"] == [50.0, 50.0, 50.0]


@pytest.mark.multiproc
def test_every_mode_names_the_slow_rank():
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        proc = launch.run("spawn", 2, [WORKER, "torch", tmp], timeout=240)
        launch.check(proc)
        for r in launch.rank_results(tmp, 2, proc):
            assert sorted(r["checks"]) == sorted(f"{m}/{c}" for m in MODES for c in (
                "slow_rank_named", "warned_once_on_rank_0", "balanced_names_none"))
