"""Rank program for the HSP tests: a straggler, the extra micro-batches the fast rank computes, and
the update replayed from a record of every micro-batch of every rank.

Usage: hsp_worker.py BACKEND OUTDIR [SYNC]

SYNC is what HSP composes with: ``bsp`` (default), ``osp`` (OSP(critical=0.25) on small blocks),
``osp-auto`` or ``dsync`` (DSync(delay=2)). The last rank is the straggler: each of its micro-batches takes
SLOW seconds (a sleep before backward), the others' take FAST. The model is a small MLP on scikit-learn's
digits. Checks, as named results in OUTDIR/rank<R>.json:
- I1: replicas bitwise equal after every step (BSP), and wherever the composed mode says they are
  (``on_synced``: OSP's corrections, DSync's exact updates) and after ``flush()``;
- I3: the parameters equal plain torch.optim (SGD with momentum, clipping on some steps) applied to the
  mean of every micro-batch gradient of every rank, replayed from the record;
- I4: a checkpoint taken mid-run and loaded into a new model and optimizer continues that trajectory;
- the fast rank computes extras (counted, never more than max_extra), and no rank waits much longer
  than one of the fast rank's micro-batches;
- a closure that runs no backward, zeroes the gradients or raises: a clear error on every rank, and
  training goes on afterwards.
"""
import hashlib
import io
import statistics
import sys
import time
import warnings

import ranks
import torch
import torch.nn.functional as F

import osp
from osp.arrivals import Arrivals

backend, outdir = sys.argv[1], sys.argv[2]
SYNC = sys.argv[3] if len(sys.argv) > 3 else "bsp"
comm = ranks.start(backend)
rank, size = comm.rank, comm.size
SLOW_RANK = size - 1
results, check, expect_error = ranks.results, ranks.check, ranks.expect_error
FAST, SLOW = 0.03, 0.15  # seconds per micro-batch on the fast ranks and on the last one (the straggler)
MB = 16  # samples per micro-batch


def digits():
    from sklearn.datasets import load_digits

    d = load_digits()
    return torch.tensor(d.data, dtype=torch.float32) / 16.0, torch.tensor(d.target)


X, Y = digits()


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.Tanh(), torch.nn.Linear(32, 10))


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=1e-3)


def composed():
    return {"bsp": osp.BSP(), "osp": osp.OSP(critical=0.25, block_size=64),
            "osp-auto": osp.OSP(critical="auto", block_size=64, warmup=1), "dsync": osp.DSync(delay=2)}[SYNC]


SYNCED = []  # digests at every point the optimizer says the replicas are equal (on_synced)


def wrap(model, max_extra=4, **kw):
    return osp.DistributedOptimizer(sgd(model.parameters()), model.named_parameters(),
                                    sync=osp.HSP(max_extra=max_extra, sync=composed()), backend=backend, timeout=60,
                                    on_synced=lambda o: SYNCED.append(digest(model)), **kw)


def indices(step, r, j):
    """The samples of rank ``r``'s ``j``-th micro-batch at ``step``."""
    return torch.randint(0, len(Y), (MB,), generator=torch.Generator().manual_seed(100003 * step + 101 * r + j))


def loss_of(model, step, r, j):
    idx = indices(step, r, j)
    return F.cross_entropy(model(X[idx]), Y[idx])


def digest(model):
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    return hashlib.sha1(flat.numpy().tobytes()).hexdigest()


CLIP = {2, 5}  # steps clipped with opt.clip_grad_norm_(MAX_NORM)
MAX_NORM = 0.5


def hsp_step(model, opt, step, delay, record=None):
    """One step as a user writes it: the first micro-batch, then opt.step(extra). Returns how many
    micro-batches this rank computed; ``record`` (a list) receives each micro-batch's gradient, computed
    where this rank's parameters are (OSP's and DSync's provisional points included)."""
    opt.zero_grad()

    def micro_batch(j):
        time.sleep(delay)
        loss = loss_of(model, step, rank, j)
        if record is not None:
            record.append([g.clone() for g in torch.autograd.grad(loss, list(model.parameters()), retain_graph=True)])
        loss.backward()
        return loss
    micro_batch(0)
    n = [1]

    def extra():
        loss = micro_batch(n[0])
        n[0] += 1
        return loss
    if step in CLIP:
        opt.clip_grad_norm_(MAX_NORM)
    opt.step(extra)
    return n[0]


def straggler_run():
    resume_at = Arrivals.WINDOW + Arrivals.HOLD + 2  # the slow rank is named after HOLD full windows
    steps = resume_at + 4
    delay = SLOW if rank == SLOW_RANK else FAST
    model = mlp()
    opt = wrap(model, max_extra=6)
    counts, digests, recorded, grads = [], [], [], []
    SYNCED.clear()
    caught = warnings.catch_warnings(record=True)
    warned = caught.__enter__()
    warnings.simplefilter("always")
    for step in range(steps):
        if step == resume_at:  # I4: checkpoint, then continue in a new model and optimizer
            opt.flush()
            # the slow rank, named: by every rank's stats, warned once on rank 0
            caught.__exit__(None, None, None)
            arrivals = opt.stats()["arrivals"]
            check("slow_rank_in_stats", arrivals["slow_rank"] == SLOW_RANK and arrivals["slower"] > 1.5
                  and arrivals["lag_ms"][SLOW_RANK] > 500 * (SLOW - FAST), arrivals)
            named = [str(w.message) for w in warned if "slower than the median" in str(w.message)]
            check("slow_rank_warned_once_on_rank_0", len(named) == (1 if rank == 0 else 0)
                  and all(f"rank {SLOW_RANK} is " in m for m in named), named)
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, buf)
            buf.seek(0)
            ck = torch.load(buf, weights_only=True)
            model = mlp()
            model.load_state_dict(ck["model"])
            opt = wrap(model, max_extra=6)
            opt.load_state_dict(ck["opt"])
        grads.append([])
        counts.append(hsp_step(model, opt, step, delay, grads[-1]))
        if SYNC == "bsp":  # the composed modes move provisionally between their exact points
            digests.append(digest(model))
        recorded.append(opt.stats()["history"][-1])
    opt.flush()
    digests += SYNCED + [digest(model)]
    everyone = comm.allgather_object({"counts": counts, "digests": digests, "recorded": recorded, "grads": grads})
    check("I1_replicas_equal_every_step", all(e["digests"] == everyone[0]["digests"] for e in everyone)
          and len(digests) >= steps - 2, [len(e["digests"]) for e in everyone])
    check("stats_count_every_micro_batch",
          all(rec["micro_batches"] == [e["counts"][s] for e in everyone] for s, rec in enumerate(recorded)),
          [rec["micro_batches"] for rec in recorded])
    # I3 and I4: plain torch.optim on the mean of every recorded micro-batch gradient of every rank, from the start
    ref = mlp()
    ropt = sgd(ref.parameters())
    for step in range(steps):
        grads = [g for e in everyone for g in e["grads"][step]]
        for k, p in enumerate(ref.parameters()):
            p.grad = sum(g[k] for g in grads) / len(grads)
        if step in CLIP:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM)
        ropt.step()
    a = torch.cat([p.detach().flatten() for p in model.parameters()])
    b = torch.cat([p.detach().flatten() for p in ref.parameters()])
    check("I3_I4_equals_torch_optim_on_the_mean_of_all_micro_batches", torch.allclose(a, b, rtol=1e-5, atol=1e-6),
          f"max abs diff {float((a - b).abs().max()):.3g}")
    extras = [rec["extras"] for rec in recorded]
    waits = [rec["wait_s"] for rec in recorded]
    if rank != SLOW_RANK:  # a fast rank computes instead of waiting: about SLOW / FAST - 1 extras a step
        check("fast_rank_computes_extras", sum(extras) >= 2 * steps and max(extras) <= 6, extras)
    else:
        check("straggler_computes_none", sum(extras) <= 1, extras)
    # no rank waits for the other much longer than one of the fast rank's micro-batches
    check("wait_at_most_about_one_micro_batch", statistics.median(waits) <= FAST + 0.05,
          [round(w, 3) for w in waits])
    # max_extra caps the extras
    model = mlp()
    opt = wrap(model, max_extra=1)
    extras = []
    for step in range(3):
        hsp_step(model, opt, step, delay)
        extras.append(opt.stats()["history"][-1]["extras"])
    opt.flush()
    if rank != SLOW_RANK:
        check("max_extra_caps_the_extras", extras == [1, 1, 1], extras)
    check("max_extra_replicas_equal", len(set(comm.allgather_object(digest(model)))) == 1)


def bad_closures():
    model = mlp()
    opt = wrap(model)

    def good():
        loss = loss_of(model, 0, rank, 1)
        loss.backward()
        return loss

    def attempt(closure_fn):
        """Rank 1 is late, so rank 0 calls ``closure_fn`` as an extra. Rank 1's closure is a good one:
        the last rank to arrive may still start an extra while "ready" propagates (a slow collective on a
        busy machine), and what is checked is that rank 0's failure reaches it."""
        def run():
            opt.zero_grad()
            if rank == SLOW_RANK:
                time.sleep(0.3)
            loss_of(model, 0, rank, 0).backward()
            opt.step(closure_fn if rank == 0 else good)
        return run

    def no_backward():
        return loss_of(model, 0, rank, 1)  # forgot .backward()

    def zeroes():
        opt.zero_grad()
        loss = loss_of(model, 0, rank, 1)
        loss.backward()
        return loss

    def raises():
        raise ValueError("data loader broke")

    before = digest(model)
    cases = [("no_backward", RuntimeError, "returned without a backward pass", no_backward),
             ("zero_grad_inside", RuntimeError, r"zero_grad\(\) inside the closure", zeroes),
             ("closure_raises", ValueError, "data loader broke", raises)]
    for name, exc, pattern, fn in cases:
        if rank == 0:
            expect_error(f"bad/{name}", exc, pattern, attempt(fn))
        else:
            expect_error(f"bad/{name}", RuntimeError, r"closure passed to step\(\) failed on rank\(s\) \[0\]",
                         attempt(fn))
    check("bad/no_update_applied", digest(model) == before)
    # training goes on: a plain step, then replicas equal
    hsp_step(model, opt, 1, 0.0)
    opt.flush()
    check("bad/training_goes_on", len(set(comm.allgather_object(digest(model)))) == 1 and digest(model) != before)
    # local, identical on every rank
    for name, value in (("negative", -1), ("float", 1.5), ("bool", True)):
        expect_error(f"bad/max_extra_{name}", ValueError, r"HSP\(max_extra\) must be an integer >= 0",
                     lambda v=value: osp.HSP(max_extra=v))
    for name, value in (("hsp", osp.HSP()), ("string", "osp")):
        expect_error(f"bad/sync_{name}", ValueError, r"HSP\(sync\) must be osp.BSP\(\), osp.OSP\(...\) or osp.DSync",
                     lambda v=value: osp.HSP(sync=v))


ranks.run_all([straggler_run, bad_closures])
ranks.save(outdir)
ranks.shutdown(backend)
