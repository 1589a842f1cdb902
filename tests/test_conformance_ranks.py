"""Oracle 2, generated: the conformance tables on 2 and 3 real ranks, both engines (tests/workers/
conformance_worker.py). A pairwise-covering sample of mode x pattern x optimizer (every pair of values at
least once), with patterns only several ranks can show (a parameter with a gradient on one rank only, a
GradScaler overflow on one rank): replicas bitwise equal after flush() (I1), and equal to plain
torch.optim replaying the averaged recorded gradients (I3), or refused alike on every rank."""
import os

import conformance as C
import pytest

import launch

WORKER = os.path.join(launch.HERE, "workers", "conformance_worker.py")
# the closure modes: their extras depend on timing, and the record cannot see them (tests/test_hsp.py replays them)
MODES = [m for m in sorted(C.MODES) if not m.endswith("closure")]
PATTERNS = ["plain", "accumulate-2", "clip-opt", "clip-torch", "grad-inplace", "branch-one-rank", "unused-param",
            "freeze-unfreeze", "scaler-overflow-one-rank", "lr-scheduler", "param-groups", "zero-grad-keep",
            "flush-mid-run", "state-dict-round-trip"]
OPTIMIZERS = ["sgd-momentum", "sgd-nesterov-wd", "adam", "adamw-amsgrad", "rmsprop", "adagrad", "group-norm-sgd"]
FEATURES = C.FE.AXIS
#: loops that call a collective of their own mid-run (flush(), state_dict()): with uneven data a rank that joined
#: would meet it with a step's collectives, which join() documents as the one thing not to do
MIDRUN_COLLECTIVES = ("flush-mid-run", "state-dict-round-trip")
_PAIRS = C.pairwise([MODES, PATTERNS, OPTIMIZERS, FEATURES], seed=1)
_MOVED = [r for r in _PAIRS if r[3] == "join" and r[1] in MIDRUN_COLLECTIVES]
# such a row runs without join, and join runs with that row's mode and optimizer on the plain loop instead
ROWS = [r for r in _PAIRS if r not in _MOVED] + [r[:3] + ("none",) for r in _MOVED] + \
    [(m, "plain", o, "join") for m, _, o, _ in _MOVED]


# item 9 of the conformance issue (#23): DSync + AdamW + a parameter with a gradient on some steps only;
# under delay="auto" the replicas themselves drifted apart
ITEM_9_RANKS = [("dsync-auto", "branch-one-rank", "adamw"), ("dsync-2", "branch-one-rank", "adamw"),
                ("dsync-2", "branch-sometimes", "adamw-amsgrad")]


def _chunks(rows, n):
    return [rows[i::n] + [r + ("none",) for r in ITEM_9_RANKS] for i in range(n)]


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,nranks,part", [("torch", 2, 0), ("torch", 3, 1), ("horovod", 2, 1),
                                                 ("horovod", 3, 0)])
def test_ranks_equal_the_replay_of_the_averaged_gradients(backend, nranks, part, tmp_path):
    rows = _chunks(ROWS, 2)[part]
    cases = [C.Case(m, p, o, "fp32", "none", f).id for m, p, o, f in rows]
    launcher = "horovod" if backend == "horovod" else "spawn"
    proc = launch.run(launcher, nranks, [WORKER, backend, str(tmp_path)] + cases, timeout=600)
    launch.check(proc)
    results = launch.rank_results(tmp_path, nranks, proc)
    assert sorted(results[0]["checks"]) == sorted(cases)


# the compression column where one rank's oracle cannot reach (conformance.COMPRESSION_ONE_RANK_MODES): the modes
# with provisional updates, on the loops of conformance.COMPRESSION_PATTERNS, float16 on the wire (both engines)
# and bfloat16 (torch.distributed; Horovod refuses it). 2 ranks: the replay sums in rank order, exact for two
COMPRESSED_MODES = [m for m in MODES if m not in C.COMPRESSION_ONE_RANK_MODES]
COMPRESSED_ROWS = C.pairwise([COMPRESSED_MODES, list(C.COMPRESSION_PATTERNS), ["sgd-momentum", "adamw"]], seed=2)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,wires", [("torch", ("fp16", "bf16")), ("horovod", ("fp16",))])
def test_compressed_ranks_equal_the_replay_of_the_compressed_average(backend, wires, tmp_path):
    cases = ["|".join(r + ("fp32", w)) for r in COMPRESSED_ROWS for w in wires]
    launcher = "horovod" if backend == "horovod" else "spawn"
    proc = launch.run(launcher, 2, [WORKER, backend, str(tmp_path)] + cases, timeout=600)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    assert sorted(results[0]["checks"]) == sorted(cases)


def test_the_sample_covers_every_pair():
    """Every pair of values of two tables, but join with a loop that calls a collective mid-run."""
    tables = (MODES, PATTERNS, OPTIMIZERS, FEATURES)
    for i in range(4):
        for j in range(i + 1, 4):
            want = {(a, b) for a in tables[i] for b in tables[j]}
            if (i, j) == (1, 3):
                want -= {(p, "join") for p in MIDRUN_COLLECTIVES}
            assert {(r[i], r[j]) for r in ROWS} == want


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["torch", "horovod"])
def test_an_average_that_overflows_is_never_applied(backend, tmp_path):
    """Each rank's float16 gradient finite, their sum not: skipped or refused alike on every rank."""
    launcher = "horovod" if backend == "horovod" else "spawn"
    proc = launch.run(launcher, 2, [os.path.join(launch.HERE, "workers", "overflow_worker.py"), backend,
                                    str(tmp_path)], timeout=300)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    assert len(results[0]["checks"]) == 12
