"""Rank program for oracle 2 (tests/test_conformance_ranks.py): the conformance tables on real ranks.

Usage: conformance_worker.py BACKEND OUTDIR CASE [CASE ...]
(CASE: mode|pattern|optimizer|dtype[|compression[|feature]], feature: tests/features.py)

Each case runs its loop (tests/conformance.py) on every rank, each rank on its own data, recording the
gradient every rank hands to ``step()``. After ``flush()``: the replicas must be bitwise equal (I1), and
equal, within the documented bound, plain ``torch.optim`` replaying the averaged recorded gradients with
the documented semantics (I3): a parameter without a gradient on any rank is left alone, one missing on
some ranks counts as zeros there; ``opt.clip_grad_norm_`` clips the average; under BSP ``.grad`` already
holds the average at ``step()``; a GradScaler's overflow on one rank skips the step everywhere. The feature
axis: ``op=Sum`` needs nothing more (each gradient is recorded as it arrives in ``.grad``, already multiplied
by the number of ranks, so the average of the records is the sum); ``join`` gives rank r r steps less data (it
joins; the replay counts its missing gradients as zeros, under HSP as no micro-batch); ``broadcast_parameters``
starts every rank from other weights; ``on_synced`` must see bitwise the same parameters on every rank at every
call. Results go to OUTDIR/rank<R>.json as named checks, one per case.
"""
import os
import sys

import ranks
import torch

import osp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conformance as C  # noqa: E402

backend, outdir, cases = sys.argv[1], sys.argv[2], sys.argv[3:]
comm = ranks.start(backend)
rank, size = comm.rank, comm.size


def recorder(log):
    def record(env):
        log.append({"grads": [None if p.grad is None else p.grad.detach().double().clone()
                              for p in env.model.parameters()],
                    "scale": env.scaler.get_scale() if env.scaler else None,
                    # .grad already held the average at step() (BSP, and OSP while BSP has its steps)
                    "averaged": bool(env.opt.mode.grad_is_average)})
    return record


def average(got, dtype, compression):
    """The recorded gradients' average (None where no rank had one, zeros where some had none), as the wire
    of ``compression`` forms it (``conformance.wire_average``)."""
    if all(g is None for g in got):
        return None
    return C.wire_average(got, dtype, osp.compression.wire_dtype(osp.compression.resolve(compression), dtype))


def replay(case, logs):
    """Plain torch.optim on the averaged recorded gradients (of the ranks that had data at each step: a rank that
    joined counts as zeros, under HSP as no micro-batch at all)."""
    ref = C.Env(case, wrapped=False)
    hsp = C.MODES[case.mode].family == "hsp"
    ref.scaler = None  # the recorded scales are applied instead (under DSync a scaler hears of an overflow late)
    params = list(ref.model.parameters())
    for t in range(ref.steps):
        if C.PATTERNS[case.pattern].body is C._freeze:  # the same requires_grad changes as the loop
            C.freeze_schedule(ref.model, t)
        ref.opt.zero_grad()
        active = [log for log in logs if t < len(log)]
        for i, p in enumerate(params):
            got = [log[t]["grads"][i] if t < len(log) else None for log in (active if hsp else logs)]
            if active[0][t]["averaged"]:  # .grad already held the average (clipped by the user) at step()
                p.grad = None if got[0] is None else got[0].to(p.dtype)
            else:
                p.grad = average(got, p.dtype, case.compression)
        scale = active[0][t]["scale"]
        if scale is not None:  # unscaled by the scale that step ran under; an overflow anywhere skips it
            grads = [p.grad for p in params if p.grad is not None]
            for g in grads:
                g.div_(scale)
            if not all(bool(g.isfinite().all()) for g in grads):
                if ref.sched is not None:
                    ref.sched.step()
                continue
        if case.pattern == "clip-opt" and not active[0][t]["averaged"]:  # (else it clipped the average itself)
            torch.nn.utils.clip_grad_norm_(ref.model.parameters(), 0.05)
        ref.opt.step()
        if ref.sched is not None:
            ref.sched.step()
    return ref


def run(case):
    log = []
    err = None
    feature = C.FE.FEATURES[case.feature]
    try:
        env = C.Env(case, wrapped=True, backend=backend, rank=rank)  # a refusal can come at construction
        env.record = recorder(log)
        for t in range(env.steps - (rank if feature.uneven else 0)):
            env.pattern.body(env, t)
        if feature.end is not None:
            feature.end(env)
        env.flush()
    except Exception as e:  # noqa: BLE001 - every rank must fail alike
        err = f"{type(e).__name__}: {e}"
    errs = comm.allgather_object(err)
    want = C.refusal(case.mode, case.pattern, case.feature)
    if any(errs):
        import re
        same = len(set(errs)) == 1
        return same and want is not None and re.search(want, errs[0]) is not None, f"errors {errs}"
    if want is not None:
        return False, f"expected a refusal ({want!r})"
    mine = [p.detach().clone() for p in env.model.parameters()]
    everyone = comm.allgather_object(mine)
    if not all(torch.equal(a, b) for other in everyone for a, b in zip(other, mine)):
        return False, "replicas differ (I1)"
    # the optimizer state too: every tensor of each parameter's state, by name (a state missing on some rank,
    # or differing, makes the next steps diverge silently)
    state = {n: {k: v.detach().clone() for k, v in env.opt.state[p].items() if torch.is_tensor(v)}
             if p in env.opt.state else {} for n, p in env.model.named_parameters()}
    for other in comm.allgather_object(state):
        for n, st in state.items():
            theirs = other.get(n, {})
            if set(theirs) != set(st) or not all(torch.equal(st[k], theirs[k]) for k in st):
                return False, (f"optimizer state of {n} differs between the ranks (I1): "
                               f"{sorted(st)} here, {sorted(theirs)} there")
    logs = comm.allgather_object(log)
    ref = replay(case, logs)
    for i, (a, b) in enumerate(zip(mine, ref.model.parameters())):
        eq, close = C.compare(a, b.detach(), env.steps)
        if not close:
            name = [n for n, _ in env.model.named_parameters()][i]
            return False, (f"parameter {i} ({name}): max abs diff {(a.double() - b.double()).abs().max().item():.3g} "
                           "against the replay of the averaged gradients (I3)")
    if env.scaler is not None and len(set(comm.allgather_object(env.scaler.get_scale()))) != 1:
        return False, "the ranks' loss scales differ"
    synced = comm.allgather_object(env.synced)
    if any(len(s) != len(env.synced) or not all(torch.equal(a, b) for a, b in zip(s, env.synced)) for s in synced):
        return False, f"on_synced saw different parameters on the ranks ({[len(s) for s in synced]} calls)"
    return True, ""


for cid in cases:
    case = C.Case.parse(cid)
    ok, detail = run(case)
    ranks.check(cid, ok, detail)
ranks.save(outdir)
ranks.shutdown(backend)
