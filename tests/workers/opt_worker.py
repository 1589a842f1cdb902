"""Rank program for the optimizer tests: real ranks, real collectives, results as JSON per rank.

Usage: opt_worker.py SCENARIO[:CASE[,CASE...]] BACKEND OUTDIR  (e.g. invariants:adam, configs:auto, dsync:1,2,3;
invariants and configs without a case run all of theirs)
Scenarios: invariants, configs, badinput, mismatch, peer_dies, peer_stalls, horovod_match,
dsync:DELAY, dsync_badinput.
"""
import copy
import hashlib
import os
import sys
import traceback
import warnings

import ranks
import torch

import osp

scenario, backend, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
comm = ranks.start(backend)
rank, size = comm.rank, comm.size
results, check, expect_error = ranks.results, ranks.check, ranks.expect_error
BS = 64
STEPS = 8


def make_model(seed=0, extra=False):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 30), torch.nn.Tanh(),
              torch.nn.Linear(30, 5)]
    if extra:
        layers.append(torch.nn.Linear(5, 5))
    return torch.nn.Sequential(*layers)


def batch(step, r=None, seed=0):
    g = torch.Generator().manual_seed(1000 * seed + 100 * (rank if r is None else r) + step)
    return torch.randn(16, 12, generator=g), torch.randint(0, 5, (16,), generator=g)


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "sgd_momentum_wd_nesterov": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True,
                                                           weight_decay=1e-3),
    "sgd_dampening_maximize": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.8, dampening=0.3,
                                                         maximize=True),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam_amsgrad_wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True, weight_decay=1e-2),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
    "adagrad": lambda ps: torch.optim.Adagrad(ps, lr=0.1),
}


def digest(model, opt):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    inner = opt.optimizer if isinstance(opt, osp.DistributedOptimizer) else opt
    for p in model.parameters():
        for k, v in sorted(inner.state.get(p, {}).items()):
            if torch.is_tensor(v):
                h.update(k.encode())
                h.update(v.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def train_step(model, opt, step, seed=0, record=None):
    x, y = batch(step, seed=seed)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    if record is not None:
        record.append([p.grad.detach().clone() for p in model.parameters()])
    opt.step()


def flat_params(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def scheduler(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))


def check_resume(name, fresh, step_fn, continues=True):
    """I4: flush, checkpoint, resume in fresh objects (``fresh(seed) -> (model, opt)``), continue:
    bitwise the same. ``continues=False``: only the resume point is compared."""
    model, opt = fresh()
    for step in range(4):
        step_fn(model, opt, step)
    opt.flush()
    ck = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
    for step in range(4, 8):
        step_fn(model, opt, step)
    opt.flush()
    resumed, ropt = fresh(seed=99)
    resumed.load_state_dict(ck["model"])
    ropt.load_state_dict(ck["opt"])
    if not continues:
        same = str(ropt.state_dict()) == str(ck["opt"]) and torch.equal(
            flat_params(resumed), torch.cat([v.flatten() for v in ck["model"].values()]))
        check(name, same, "state after load differs from the checkpoint")
        return
    for step in range(4, 8):
        step_fn(resumed, ropt, step)
    ropt.flush()
    check(name, digest(model, opt) == digest(resumed, ropt),
          f"max abs diff {float((flat_params(model) - flat_params(resumed)).abs().max()):.3g}")


def check_replay(name, model, make_opt, grads):
    """I3: ``model`` equals torch.optim (under the same LR schedule) stepping with the average over
    ranks of the gradients every rank recorded."""
    all_grads = comm.allgather_object(grads)
    replay = make_model()
    ropt = make_opt(replay.parameters())
    rsched = scheduler(ropt)
    for step in range(STEPS):
        for i, p in enumerate(replay.parameters()):
            p.grad = torch.stack([all_grads[r][step][i] for r in range(size)]).mean(0)
        ropt.step()
        rsched.step()
    a, b = flat_params(model), flat_params(replay)
    check(name, torch.allclose(a, b, rtol=1e-5, atol=1e-6), f"max abs diff {float((a - b).abs().max()):.3g}")


def invariants(only=None):
    for oname, make_opt in OPTIMIZERS.items():
        if only is not None and oname != only:
            continue
        # I1 and I3: replicas equal at every correction point; the trajectory equals plain averaged
        # updates of the gradients that were actually computed
        model = make_model()
        opt = osp.DistributedOptimizer(make_opt(model.parameters()), model.named_parameters(),
                                       sync=osp.OSP(critical=0.3, block_size=BS, min_critical=0.0),
                                       backend=backend)
        sched = scheduler(opt)
        digests = []
        opt.on_synced = lambda o, d=digests, m=model: d.append(comm.allgather_object(digest(m, o)))
        grads = []
        for step in range(STEPS):
            train_step(model, opt, step, record=grads)
            sched.step()
        opt.flush()
        check(f"I1/{oname}", len(digests) == STEPS + 1 and all(len(set(d)) == 1 for d in digests),
              f"{sum(len(set(d)) > 1 for d in digests)} of {len(digests)} sync points differ")
        st = opt.stats()
        # the first step has no scores yet: fully critical; then 30% (+ rounding) critical
        first, rest = st["history"][0], st["history"][1:]
        check(f"stats/{oname}", st["steps"] == STEPS and first["critical_fraction"] == 1.0
              and first["bytes_stage2"] == 0 and all(
                  0.3 <= h["critical_fraction"] < 0.45 and h["bytes_stage2"] > 0 for h in rest), st["history"])
        check_replay(f"I3/{oname}", model, make_opt, grads)

        # I2: critical=1.0 is BSP, bitwise (2 ranks: sum order cannot differ)
        m1, m2 = make_model(), make_model()
        o1 = osp.DistributedOptimizer(make_opt(m1.parameters()), m1.named_parameters(),
                                      sync=osp.OSP(critical=1.0, block_size=BS), backend=backend)
        o2 = osp.DistributedOptimizer(make_opt(m2.parameters()), m2.named_parameters(),
                                      sync=osp.BSP(bucket_mb=0.002), backend=backend)
        for step in range(STEPS):
            train_step(m1, o1, step)
            train_step(m2, o2, step)
        a, b = flat_params(m1), flat_params(m2)
        if size == 2:
            check(f"I2/{oname}", torch.equal(a, b), f"max abs diff {float((a - b).abs().max()):.3g}")
        else:
            check(f"I2/{oname}", torch.allclose(a, b, rtol=1e-5, atol=1e-6),
                  f"max abs diff {float((a - b).abs().max()):.3g}")

        def fresh(seed=0, make_opt=make_opt):
            m = make_model(seed)
            return m, osp.DistributedOptimizer(make_opt(m.parameters()), m.named_parameters(),
                                               sync=osp.OSP(critical=0.3, block_size=BS), backend=backend)

        check_resume(f"I4/{oname}", fresh, train_step)


def two_groups(model, make):
    """Several param groups with different hyper-parameters (weights vs biases)."""
    w = [p for n, p in model.named_parameters() if n.endswith("weight")]
    b = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return make([{"params": w}, {"params": b, "lr": 0.02, "weight_decay": 0.0}])


# name: (model dtype, optimizer over the model, OSP options); I1-I4 are checked for each one
CONFIGS = {
    "metric_l1": (torch.float32, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                  dict(critical=0.3, metric="l1")),
    "metric_max": (torch.float32, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                   dict(critical=0.3, metric="max")),
    "metric_relative": (torch.float32, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                        dict(critical=0.3, metric="relative")),
    "metric_relative_generic": (torch.float32, lambda m: torch.optim.RMSprop(m.parameters(), lr=1e-2),
                                dict(critical=0.3, metric="relative")),
    "auto": (torch.float32, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
             dict(critical="auto", warmup=1, min_critical=0.0)),
    "fp16_auto": (torch.float16, lambda m: torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9),
                  dict(critical="auto", warmup=1, min_critical=0.0)),
    "bf16_relative": (torch.bfloat16, lambda m: torch.optim.Adam(m.parameters(), lr=1e-2),
                      dict(critical=0.3, metric="relative")),
    "groups_sgd": (torch.float32, lambda m: two_groups(m, lambda g: torch.optim.SGD(
        g, lr=0.05, momentum=0.9, weight_decay=1e-3)), dict(critical=0.3, metric="relative")),
    "groups_adamw": (torch.float32, lambda m: two_groups(m, lambda g: torch.optim.AdamW(g, lr=1e-2)),
                     dict(critical=0.3)),
    "groups_rmsprop": (torch.float32, lambda m: two_groups(m, lambda g: torch.optim.RMSprop(g, lr=1e-2)),
                       dict(critical=0.3, metric="l1")),
}


def configs(only=None):
    """I1-I4 for every metric, critical='auto', fp16 and bf16 parameters, and several param groups with
    different hyper-parameters (the generic correction path too)."""
    for cname, (dtype, make_opt, kw) in CONFIGS.items():
        if only is not None and cname != only:
            continue
        if backend == "horovod" and dtype == torch.bfloat16:
            m = make_model().to(dtype)
            expect_error(f"bf16_refused/{cname}", ValueError, "bfloat16, which Horovod cannot allreduce",
                         lambda m=m, make_opt=make_opt: osp.DistributedOptimizer(
                             make_opt(m), m.named_parameters(), backend=backend))
            continue
        def fresh(seed=0, dtype=dtype, make_opt=make_opt, kw=kw):
            m = make_model(seed).to(dtype)
            return m, osp.DistributedOptimizer(make_opt(m), m.named_parameters(),
                                               sync=osp.OSP(block_size=BS, **kw), backend=backend)

        def step_on(model, opt, step, record=None, dtype=dtype):
            x, y = batch(step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x.to(dtype)).float(), y).backward()
            if record is not None:
                record.append([p.grad.detach().clone() for p in model.parameters()])
            opt.step()

        model, opt = fresh()
        digests, grads = [], []
        opt.on_synced = lambda o, d=digests, m=model: d.append(comm.allgather_object(digest(m, o)))
        auto = kw["critical"] == "auto"
        if auto:
            # resumed at a share of 0.5: deferring from the first step on, until the step model, fed on this fast
            # link, may send it back to BSP's code (each handover must keep I1, I3 and I4)
            opt.mode.load_state_dict({"budget": {"version": 2, "steps": 4, "fraction": 0.5, "phase": "auto",
                                                 "decisions": []}, "size": size, "scores": None})
        for step in range(STEPS):
            if cname == "fp16_auto" and step == STEPS - 2:
                # a fast link: 40 GB/s per rank must survive the side channel's fp32 sum across ranks
                opt.mode.meter.sample_rate = 4e10
            step_on(model, opt, step, record=grads)
        opt.flush()
        check(f"I1/{cname}", len(digests) == STEPS + 1 and all(len(set(d)) == 1 for d in digests),
              f"{sum(len(set(d)) > 1 for d in digests)} of {len(digests)} sync points differ")
        hist = opt.stats()["history"]
        if auto:
            b = opt.mode.split.budget
            check(f"deferred/{cname}", all(h["bytes_stage2"] > 0 and h["critical_fraction"] < 1.0 for h in hist[1:3])
                  and b.phase == "auto" and b.steps == 4 + STEPS
                  and (cname != "fp16_auto" or any(abs(r[-1] / 4e10 - 1) < 1e-6 for r in b._rates.values() if r)),
                  (hist, b.stats()))
        else:
            check(f"deferred/{cname}", all(h["bytes_stage2"] > 0 for h in hist[2:]), hist)
        all_grads = comm.allgather_object(grads)
        replay = make_model().to(dtype)
        ropt = make_opt(replay)
        for step in range(STEPS):
            for i, p in enumerate(replay.parameters()):
                p.grad = torch.stack([all_grads[r][step][i] for r in range(size)]).float().mean(0).to(dtype)
            ropt.step()
        a, b = flat_params(model).float(), flat_params(replay).float()
        tol = dict(rtol=1e-5, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
        check(f"I3/{cname}", torch.allclose(a, b, **tol), f"max abs diff {float((a - b).abs().max()):.3g}")

        # 'auto' sizes each split from measured times, which a second run measures anew: there the
        # resume point is exact (same parameters, state, scores and budget) and the path after it
        # follows that run's own measurements
        check_resume(f"I4/{cname}", fresh, step_on, continues=kw["critical"] != "auto")


DSYNC_OPTIMIZERS = ("sgd_momentum_wd_nesterov", "adam", "adamw", "rmsprop")


def dsync(delay):
    """DSync(delay): I1 where the exact updates land and after flush(), I3 against torch.optim replaying
    the averaged recorded gradients (under an LR schedule), I4 resume; DSync(1) is OSP(critical=0)."""
    delay = int(delay)
    for oname in DSYNC_OPTIMIZERS:
        make_opt = OPTIMIZERS[oname]
        model = make_model()
        digests, grads = [], []
        opt = osp.DistributedOptimizer(
            make_opt(model.parameters()), model.named_parameters(), sync=osp.DSync(delay=delay),
            backend=backend, on_synced=lambda o, d=digests, m=model: d.append(comm.allgather_object(digest(m, o))))
        sched = scheduler(opt)
        for step in range(STEPS):
            train_step(model, opt, step, record=grads)
            sched.step()
        opt.flush()
        # the first step (nothing in flight yet), exact updates landing at steps delay..STEPS-1, the rest in flush()
        check(f"I1/{oname}/delay{delay}", len(digests) == STEPS - delay + 2 and all(len(set(d)) == 1 for d in digests),
              f"{len(digests)} sync points, {sum(len(set(d)) > 1 for d in digests)} differ")
        st = opt.stats()
        check(f"stats/{oname}/delay{delay}", st["delay"] == delay and st["steps"] == STEPS and (
            delay == 1 or sum(h["replayed"] for h in st["history"]) == (STEPS - delay) * (delay - 1)),
            st["history"])
        check_replay(f"I3/{oname}/delay{delay}", model, make_opt, grads)

        def fresh(seed=0, make_opt=make_opt):
            m = make_model(seed)
            return m, osp.DistributedOptimizer(make_opt(m.parameters()), m.named_parameters(),
                                               sync=osp.DSync(delay=delay), backend=backend)

        check_resume(f"I4/{oname}/delay{delay}", fresh, train_step)

        if delay == 1:  # the same algorithm as OSP deferring every block
            m1, m2 = make_model(), make_model()
            o1 = osp.DistributedOptimizer(make_opt(m1.parameters()), m1.named_parameters(),
                                          sync=osp.DSync(delay=1), backend=backend)
            o2 = osp.DistributedOptimizer(make_opt(m2.parameters()), m2.named_parameters(),
                                          sync=osp.OSP(critical=0.0, block_size=BS), backend=backend)
            for step in range(STEPS):
                train_step(m1, o1, step)
                train_step(m2, o2, step)
            o1.flush()
            o2.flush()
            a, b = flat_params(m1), flat_params(m2)
            if size == 2:  # 2 ranks: the sum's order cannot differ, whatever the buffer boundaries
                check(f"dsync1_is_osp0/{oname}", digest(m1, o1) == digest(m2, o2),
                      f"max abs diff {float((a - b).abs().max()):.3g}")
            else:
                check(f"dsync1_is_osp0/{oname}", torch.allclose(a, b, rtol=1e-5, atol=1e-6),
                      f"max abs diff {float((a - b).abs().max()):.3g}")


def nonfinite_backward(sync):
    """One exact step, then a backward whose gradient is infinite on the last rank only (inside
    backward: BSP and DSync start averaging there). Returns the model, its optimizer and the parameters
    before that backward; the caller steps."""
    model = make_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), sync=sync, backend=backend)
    train_step(model, opt, 0)
    opt.flush()
    before = flat_params(model).clone()
    x, y = batch(1)
    opt.zero_grad()
    loss = torch.nn.functional.cross_entropy(model(x), y)
    if rank == size - 1:
        loss = loss * float("inf")
    loss.backward()
    return model, opt, before


def dsync_badinput():
    """Bad DSync options: a ValueError naming what was expected and what was got, on every rank."""
    for name, kw, pattern in [
            ("zero", dict(delay=0), r"DSync\(delay\) must be an integer >= 1 or 'auto', got 0"),
            ("negative", dict(delay=-2), r"got -2"),
            ("float", dict(delay=1.5), r"got 1.5"),
            ("bool", dict(delay=True), r"got True"),
            ("string", dict(delay="fast"), r"got 'fast'"),
            ("max_below", dict(delay=3, max_delay=2), r"DSync\(max_delay\) must be >= delay=3, got 2")]:
        expect_error(f"dsync_bad/{name}", ValueError, pattern, lambda kw=kw: osp.DSync(**kw))
    model = make_model()
    expect_error("dsync_bad/ranks_disagree", ValueError, "disagree on the options", lambda: osp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        sync=osp.DSync(delay=2 if rank == 0 else 3), backend=backend))
    # non-finite gradient on one rank: that step is skipped on every rank when its average lands
    model, opt, before = nonfinite_backward(osp.DSync(delay=2))
    opt.step()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        opt.flush()
    check("dsync_nonfinite_skipped", torch.equal(flat_params(model), before)
          and opt.stats()["skipped_steps"] == 1 and any("skipped" in str(x.message) for x in w),
          opt.stats()["skipped_steps"])
    for step in range(2, 6):
        train_step(model, opt, step)
    opt.flush()
    check("dsync_nonfinite_recovers", bool(torch.isfinite(flat_params(model)).all())
          and not torch.equal(flat_params(model), before)
          and len(set(comm.allgather_object(digest(model, opt)))) == 1)


def badinput():
    # sparse gradients: a clear error on every rank
    torch.manual_seed(0)  # equal replicas (else the first step's replica check raises first)
    emb = torch.nn.Embedding(10, 4, sparse=True)
    opt = osp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), emb.named_parameters(),
                                   backend=backend)
    emb(torch.tensor([1, 2])).sum().backward()
    expect_error("sparse", ValueError, "sparse gradient", opt.step)

    # ranks that pick different critical blocks (e.g. scores computed differently on different GPU
    # generations) raise on every rank instead of averaging different blocks
    model = make_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.OSP(critical=0.3, block_size=BS), backend=backend)
    for step in range(2):
        train_step(model, opt, step)
    opt.flush()
    if rank == size - 1:
        # this rank's idea of the important blocks differs
        opt.mode.split.scores = opt.mode.split.scores.flip(0).contiguous()
    expect_error("mask_mismatch", RuntimeError, "ranks chose different critical blocks",
                 lambda: train_step(model, opt, 2))

    # step() twice without a backward
    model = make_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.OSP(critical=0.5, block_size=BS), backend=backend)
    train_step(model, opt, 0)
    expect_error("step_twice", RuntimeError, "without a backward", opt.step)
    opt.flush()

    for mode in ("bsp", "osp"):
        sync = osp.BSP() if mode == "bsp" else osp.OSP(critical=0.5, block_size=BS)
        # a gradient missing on some ranks counts as zeros on all (as in Horovod)
        model = make_model()
        head = torch.nn.Linear(12, 5)
        params = list(model.parameters()) + list(head.parameters())
        named = list(model.named_parameters()) + [("head." + n, p) for n, p in head.named_parameters()]
        opt = osp.DistributedOptimizer(torch.optim.SGD(params, lr=1.0), named, sync=sync, backend=backend)
        before = head.weight.detach().clone()
        x, y = batch(0)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        if rank == 0:
            loss = loss + head(x).pow(2).mean()
        # rank 0's own gradient (under BSP .grad holds the average once backward returns)
        g0 = torch.autograd.grad(loss, head.weight, retain_graph=True)[0] if rank == 0 else None
        opt.zero_grad()
        loss.backward()
        opt.step()
        opt.flush()
        g0 = comm.broadcast_object(g0, 0)
        expect = before - g0 / size
        check(f"missing_grad/{mode}", torch.allclose(head.weight.detach(), expect, rtol=1e-6, atol=1e-7),
              float((head.weight.detach() - expect).abs().max()))
        check(f"missing_grad_equal/{mode}", len(set(comm.allgather_object(digest(model, opt)))) == 1)

        # non-finite gradient on one rank: the step is skipped on every rank
        model, opt, before = nonfinite_backward(sync)
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            opt.step()
        opt.flush()
        check(f"nonfinite_skipped/{mode}", torch.equal(flat_params(model), before)
              and opt.stats()["skipped_steps"] == 1 and any("skipped" in str(x.message) for x in w),
              opt.stats()["skipped_steps"])
        train_step(model, opt, 2)
        opt.flush()
        check(f"nonfinite_recovers/{mode}", bool(torch.isfinite(flat_params(model)).all())
              and not torch.equal(flat_params(model), before)
              and len(set(comm.allgather_object(digest(model, opt)))) == 1)


def mismatch():
    model = make_model(extra=(rank == size - 1))
    expect_error("mismatch_count", ValueError, "ranks disagree on the parameters", lambda: osp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), backend=backend))
    torch.manual_seed(0)
    lin = torch.nn.Linear(12, 40 if rank == 0 else 41)
    expect_error("mismatch_shape", ValueError, r"shape \[4[01], 12\]", lambda: osp.DistributedOptimizer(
        torch.optim.SGD(lin.parameters(), lr=0.1), lin.named_parameters(), backend=backend))
    model = make_model()
    expect_error("mismatch_options", ValueError, "disagree on the options", lambda: osp.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
        sync=osp.OSP(critical=0.25 if rank == 0 else 0.5), backend=backend))
    # the job goes on after the errors: a real step still works
    model = make_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.OSP(critical=0.5, block_size=BS), backend=backend)
    train_step(model, opt, 0)
    opt.flush()
    check("after_mismatch", len(set(comm.allgather_object(digest(model, opt)))) == 1)


def peer_fails(stall: bool):
    """The last rank dies (exits) or stalls at step 3: the others raise within a bounded time."""
    import time
    name = "peer_stall_detected" if stall else "peer_death_detected"
    model = make_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.OSP(critical=0.5, block_size=BS), backend=backend,
                                   timeout=5 if stall else 15)
    t0 = time.monotonic()
    try:
        for step in range(1000):
            if rank == size - 1 and step == 3:
                if stall:
                    time.sleep(12)  # alive but stuck; comes back later and leaves
                os._exit(0)  # leaves silently, so the launcher does not tear the job down
            train_step(model, opt, step)
        check(name, False, "training went on without the peer")
    except Exception as e:  # a dead peer: the engine's error; a stalled one: osp's TimeoutError
        results["elapsed"] = time.monotonic() - t0
        check(name, not stall or (isinstance(e, TimeoutError) and results["elapsed"] < 10),
              f"{type(e).__name__} after {results['elapsed']:.1f}s: {e}")


def horovod_match():
    """BSP against horovod.torch.DistributedOptimizer: same model, data and seed."""
    import horovod.torch as hvd
    for oname in ("sgd_momentum_wd_nesterov", "adam"):
        m1, m2 = make_model(), make_model()
        o1 = osp.DistributedOptimizer(OPTIMIZERS[oname](m1.parameters()), m1.named_parameters(),
                                      sync=osp.BSP(), backend="horovod")
        o2 = hvd.DistributedOptimizer(OPTIMIZERS[oname](m2.parameters()), named_parameters=m2.named_parameters())
        for step in range(STEPS):
            train_step(m1, o1, step)
            train_step(m2, o2, step)
        a, b = flat_params(m1), flat_params(m2)
        check(f"bsp_vs_horovod/{oname}", torch.allclose(a, b, rtol=1e-5, atol=1e-6),
              f"max abs diff {float((a - b).abs().max()):.3g}")


SCENARIOS = {"invariants": invariants, "configs": configs, "badinput": badinput, "mismatch": mismatch,
             "peer_dies": lambda: peer_fails(stall=False), "peer_stalls": lambda: peer_fails(stall=True),
             "horovod_match": horovod_match, "dsync": dsync, "dsync_badinput": dsync_badinput}
name, _, args = scenario.partition(":")  # e.g. dsync:2, or dsync:1,2,3 (each in turn, in one launch)
for arg in args.split(",") if args else [None]:
    try:
        SCENARIOS[name](*([arg] if arg else []))
    except Exception:  # the ranks may be out of step now: no further case
        results["errors"][f"uncaught/{name}:{arg}"] = traceback.format_exc()
        break
ranks.save(outdir)
sys.stdout.flush()
if scenario.startswith("peer_"):
    # the job is broken, as a user's would be: leave with the error (osp's exit hook stays out of it)
    raise RuntimeError(f"rank {rank}: training failed: {results['checks']}")
ranks.shutdown(backend)
