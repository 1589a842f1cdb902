"""Rank program for the training-loop tests: everyday patterns on real ranks, against a reference.

Usage: loops_worker.py MODE BACKEND OUTDIR   (MODE: bsp, osp, dsync or hsp)

The reference is plain ``torch.optim`` on the rank-averaged gradient, simulated in one process: every
rank's gradient is recomputed from every rank's data at the shared weights. With a loss that is linear
in the weights the gradient does not depend on them, so that reference is exact for every mode (OSP and
DSync evaluate gradients at provisional weights). Results go to OUTDIR/rank<R>.json as named checks.
"""
import sys
import warnings

import ranks
import torch

import osp

mode, backend, outdir = sys.argv[1], sys.argv[2], sys.argv[3]
comm = ranks.start(backend)
rank, size = comm.rank, comm.size
results, check, expect_error = ranks.results, ranks.check, ranks.expect_error
STEPS = 6


def sync():
    return {"bsp": osp.BSP(bucket_mb=0.0005), "osp": osp.OSP(critical=0.3, block_size=16),
            "dsync": osp.DSync(delay=2, bucket_mb=0.0005), "hsp": osp.HSP(max_extra=2)}[mode]


def wrap(opt, model, **kw):
    return osp.DistributedOptimizer(opt, model.named_parameters(), sync=sync(), backend=backend, timeout=60, **kw)


def linear_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Linear(6, 3))


def coeffs(model, step, r):
    """Rank ``r``'s loss at ``step``: sum of coefficient * weight, so the gradient is the coefficients."""
    g = torch.Generator().manual_seed(7919 * step + 31 * r + 1)
    return [torch.randn(p.shape, generator=g) * (1 + 3 * (i == 0)) for i, p in enumerate(model.parameters())]


def linear_loss(model, step, r=None):
    return sum((p * c).sum() for p, c in zip(model.parameters(), coeffs(model, step, rank if r is None else r)))


def averaged(model, step, ranks=None):
    """The rank-averaged gradient of the linear loss (``ranks``: who contributes; others count as zeros)."""
    ranks = range(size) if ranks is None else ranks
    per = [coeffs(model, step, r) for r in ranks]
    return [sum(c[i] for c in per) / size for i in range(len(per[0]))]


def train_linear(model, opt, steps, after_step=None):
    """The plain loop on the linear loss; ``after_step(model, opt, step)`` runs after each step()."""
    for step in range(steps):
        opt.zero_grad()
        linear_loss(model, step).backward()
        opt.step()
        if after_step is not None:
            after_step(model, opt, step)


def equal_everywhere(model):
    mine = torch.cat([p.detach().flatten() for p in model.parameters()])
    return all(torch.equal(mine, o) for o in comm.allgather_object(mine))


def close(model, ref, tol=1e-5):
    a = torch.cat([p.detach().flatten() for p in model.parameters()])
    b = torch.cat([p.detach().flatten() for p in ref.parameters()])
    return torch.allclose(a, b, rtol=tol, atol=tol), float((a - b).abs().max())


def reference_run(make_opt, steps, before_step=None, skip=()):
    """Plain torch.optim on the averaged linear gradient; ``before_step(ref, step)`` edits the gradient
    (e.g. clips it); steps in ``skip`` are not taken."""
    ref = linear_model()
    ropt = make_opt(ref.parameters())
    for step in range(steps):
        if step in skip:
            continue
        for p, g in zip(ref.parameters(), averaged(ref, step)):
            p.grad = g.clone()
        if before_step is not None:
            before_step(ref, step)
        ropt.step()
    return ref


SGD = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=1e-2)  # noqa: E731
ADAM = lambda ps: torch.optim.Adam(ps, lr=1e-2)  # noqa: E731


# -- 1: clipping by the norm of the averaged gradient ------------------------------------------------
def clipping():
    max_norm = 1.5
    model = linear_model()
    opt = wrap(SGD(model.parameters()), model)
    grad_is_avg = True
    for step in range(STEPS):
        opt.zero_grad()
        linear_loss(model, step).backward()
        if mode == "bsp":  # .grad holds the average when backward returns, as with DDP
            grad_is_avg &= all(torch.allclose(p.grad, g, atol=1e-6) for p, g in zip(model.parameters(),
                                                                                    averaged(model, step)))
            if step % 2:  # Horovod's pattern, on every other step
                opt.synchronize()
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
                with opt.skip_synchronize():
                    opt.step()
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        else:
            opt.clip_grad_norm_(max_norm)
        opt.step()
    opt.flush()
    if mode == "bsp":
        check("clip/grad_is_average_after_backward", grad_is_avg)
    ref = reference_run(SGD, STEPS, lambda r, s: torch.nn.utils.clip_grad_norm_(r.parameters(), max_norm))
    ok, diff = close(model, ref)
    check("clip/equals_clip_of_average", ok, f"max abs diff {diff:.3g}")
    check("clip/replicas_equal", equal_everywhere(model))
    # clipping .grad directly: under OSP/HSP that clips each rank's own gradient: warned once; under DSync,
    # whose averages started in backward, refused on every rank when that step's average lands
    model = linear_model()
    opt = wrap(SGD(model.parameters()), model)

    def direct_clips():
        for step in range(3):
            opt.zero_grad()
            linear_loss(model, step).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)  # each rank's own, under OSP/DSync
            opt.step()
        opt.flush()
    if mode == "dsync":
        expect_error("clip/direct_clip_refused_under_dsync", RuntimeError, "changed in place or replaced", direct_clips)
        return
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        direct_clips()
    n = sum("clip_grad_norm_(max_norm) instead" in str(x.message) for x in w)
    check("clip/direct_clip_warned_once", n == (0 if mode == "bsp" else 1), f"{n} warnings")


# -- 3: GradScaler, with an overflow on one rank only -----------------------------------------------
def scaler(unscale_first):
    name = "scaler_unscale_clip" if unscale_first else "scaler"
    make = ADAM if unscale_first else SGD  # Adam: its update numbers must skip the overflow step too
    model = linear_model()
    opt = wrap(make(model.parameters()), model)
    sc = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    overflow_step = 2
    scales = []
    for step in range(STEPS):
        opt.zero_grad()
        loss = linear_loss(model, step)
        if step == overflow_step and rank == size - 1:
            loss = loss * float("inf")
        sc.scale(loss).backward()
        if unscale_first:
            sc.unscale_(opt)
            opt.clip_grad_norm_(100.0)
        sc.step(opt)
        sc.update()
        scales.append(float(sc.get_scale()))
        if step == overflow_step + 1:
            opt.flush()  # and go on from the exact state
    opt.flush()
    # every mode skips the step everywhere; DSync learns of it when the step's average lands, so its
    # scaler backs off delay steps later
    ref = reference_run(make, STEPS, (lambda r, s: torch.nn.utils.clip_grad_norm_(r.parameters(), 100.0))
                        if unscale_first else None, skip={overflow_step})
    ok, diff = close(model, ref)
    check(f"{name}/skips_the_overflow_step_everywhere", ok, f"max abs diff {diff:.3g}")
    check(f"{name}/replicas_equal", equal_everywhere(model))
    all_scales = comm.allgather_object(scales)
    check(f"{name}/scales_equal", all(s == all_scales[0] for s in all_scales), all_scales)
    s = all_scales[0]
    check(f"{name}/scale_backed_off", any(b < a for a, b in zip(s, s[1:])), s)


# -- 4: freezing and unfreezing after wrapping -------------------------------------------------------


def freezing(name, make_opt, frozen):
    """The first layer's weight is frozen (requires_grad False, grad None) during the steps ``frozen``."""
    def loop(model, opt, plain):
        first = model[0].weight
        seen = {}
        for step in range(STEPS):
            first.requires_grad_(step not in frozen)
            opt.zero_grad(set_to_none=True)
            if plain:  # the reference: averaged gradients, None where frozen
                for p, g in zip(model.parameters(), averaged(model, step)):
                    p.grad = None if not p.requires_grad else g.clone()
            else:
                linear_loss(model, step).backward()
            opt.step()
            if not plain:
                opt.flush()  # exact parameters to compare
            seen[step] = first.detach().clone()
        return seen

    model = linear_model()
    opt = wrap(make_opt(model.parameters()), model)
    seen = loop(model, opt, plain=False)
    opt.flush()
    ref = linear_model()
    loop(ref, make_opt(ref.parameters()), plain=True)
    before = linear_model()[0].weight.detach()
    still = all(torch.equal(seen[s], seen[s - 1] if s else before) for s in frozen)
    check(f"{name}/frozen_layer_does_not_move", still)
    ok, diff = close(model, ref)
    check(f"{name}/equals_torch_optim", ok, f"max abs diff {diff:.3g}")
    check(f"{name}/replicas_equal", equal_everywhere(model))


def two_backwards():
    """Two backward passes on disjoint parameters before one step, backward_passes_per_step=1: BSP has
    averaged when the first returns, so the second raises on every rank; OSP and DSync average in step()."""
    def run():
        model = linear_model()
        opt = wrap(SGD(model.parameters()), model)
        for step in range(3):
            opt.zero_grad()
            cs = coeffs(model, step, rank)
            ps = list(model.parameters())
            sum((p * c).sum() for p, c in zip(ps[:2], cs[:2])).backward()
            sum((p * c).sum() for p, c in zip(ps[2:], cs[2:])).backward()
            opt.step()
        opt.flush()
        return model
    if mode == "bsp":
        expect_error("two_backwards/raises_after_averaging", RuntimeError,
                     "after this step's gradients were averaged", run)
        return
    model = run()
    ok, diff = close(model, reference_run(SGD, 3))
    check("two_backwards/equals_torch_optim", ok, f"max abs diff {diff:.3g}")


# -- 6: several optimizers per process: the textbook GAN loop ---------------------------------------
def gan():
    torch.manual_seed(0)
    netD = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    netG = torch.nn.Sequential(torch.nn.Linear(3, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    import copy
    refD, refG = copy.deepcopy(netD), copy.deepcopy(netG)
    optD = osp.DistributedOptimizer(torch.optim.Adam(netD.parameters(), lr=1e-2), netD.named_parameters(),
                                    sync=sync(), backend=backend, backward_passes_per_step=2, timeout=60)
    optG = osp.DistributedOptimizer(torch.optim.Adam(netG.parameters(), lr=1e-2), netG.named_parameters(),
                                    sync=sync(), backend=backend, timeout=60)
    bce = torch.nn.BCEWithLogitsLoss()

    def data(step, r):
        g = torch.Generator().manual_seed(100 * step + r)
        return torch.randn(8, 4, generator=g) + 1.0, torch.randn(8, 3, generator=g)

    def d_grads(D, G, step, r):
        real, z = data(step, r)
        D.zero_grad()
        bce(D(real), torch.ones(8, 1)).backward()
        bce(D(G(z).detach()), torch.zeros(8, 1)).backward()
        return [p.grad.clone() for p in D.parameters()]

    def g_grads(D, G, step, r):
        _, z = data(step, r)
        G.zero_grad()
        bce(D(G(z)), torch.ones(8, 1)).backward()
        return [p.grad.clone() for p in G.parameters()]

    rD, rG = torch.optim.Adam(refD.parameters(), lr=1e-2), torch.optim.Adam(refG.parameters(), lr=1e-2)
    for step in range(STEPS):
        # osp, as the DCGAN example writes it
        real, z = data(step, rank)
        netD.zero_grad()
        bce(netD(real), torch.ones(8, 1)).backward()
        fake = netG(z)
        bce(netD(fake.detach()), torch.zeros(8, 1)).backward()
        optD.step()
        netG.zero_grad()
        bce(netD(fake), torch.ones(8, 1)).backward()  # fills D's gradients too
        optG.step()
        # the reference: BSP simulated in one process
        gs = [d_grads(refD, refG, step, r) for r in range(size)]
        for i, p in enumerate(refD.parameters()):
            p.grad = sum(g[i] for g in gs) / size
        rD.step()
        gs = [g_grads(refD, refG, step, r) for r in range(size)]
        for i, p in enumerate(refG.parameters()):
            p.grad = sum(g[i] for g in gs) / size
        rG.step()
    optD.flush()
    optG.flush()
    check("gan/replicas_equal", equal_everywhere(netD) and equal_everywhere(netG))
    if mode in ("bsp", "hsp"):
        okD, dD = close(netD, refD, 1e-4)
        okG, dG = close(netG, refG, 1e-4)
        check("gan/equals_bsp_reference", okD and okG, f"max abs diff D {dD:.3g} G {dG:.3g}")


def two_optimizers():
    """One model, one backward, two optimizers (body and head): both average during the same backward,
    so their collectives are in flight together (Horovod matches them by name)."""
    def split(m):
        return [p for n, p in m.named_parameters() if n.startswith("0.")], \
               [p for n, p in m.named_parameters() if n.startswith("1.")]

    model = linear_model()
    body, head = split(model)
    named = dict(model.named_parameters())
    opts = [osp.DistributedOptimizer(make(ps), [(n, p) for n, p in named.items() if any(p is q for q in ps)],
                                     sync=sync(), backend=backend, timeout=60)
            for make, ps in ((SGD, body), (lambda ps: torch.optim.Adam(ps, lr=1e-2), head))]
    for step in range(STEPS):
        for o in opts:
            o.zero_grad()
        linear_loss(model, step).backward()
        for o in opts:
            o.step()
    for o in opts:
        o.flush()
    ref = linear_model()
    rbody, rhead = split(ref)
    ropts = [SGD(rbody), torch.optim.Adam(rhead, lr=1e-2)]
    for step in range(STEPS):
        for p, g in zip(ref.parameters(), averaged(ref, step)):
            p.grad = g.clone()
        for o in ropts:
            o.step()
    ok, diff = close(model, ref)
    check("two_opts/equals_torch_optim", ok, f"max abs diff {diff:.3g}")
    check("two_opts/replicas_equal", equal_everywhere(model))


# -- 5: in-place edits of parameters between steps --------------------------------------------------
def edits():
    c = 0.05
    model = linear_model()
    opt = wrap(SGD(model.parameters()), model)
    clamped = []

    def clamp_after_flush(model, opt, step):
        if mode != "bsp":
            opt.flush()  # the supported pattern: exact parameters, then the edit is kept
        for p in model.parameters():
            p.data.clamp_(-c, c)
        clamped.append(all(bool((p.detach().abs() <= torch.tensor(c)).all()) for p in model.parameters()))
    train_linear(model, opt, STEPS, clamp_after_flush)
    opt.flush()
    ref = linear_model()
    ropt = SGD(ref.parameters())
    for step in range(STEPS):
        for p, g in zip(ref.parameters(), averaged(ref, step)):
            p.grad = g.clone()
        ropt.step()
        for p in ref.parameters():
            p.data.clamp_(-c, c)
    ok, diff = close(model, ref)
    check("edit/clamp_after_flush_kept_exactly", ok and all(clamped), f"max abs diff {diff:.3g}")
    check("edit/replicas_equal", equal_everywhere(model))
    if mode in ("bsp", "hsp"):  # nothing pending between steps: edits are kept as they are
        return

    # without flush: refused loudly, on every rank
    def clamp_data(model, opt, step):
        for p in model.parameters():
            p.data.clamp_(-c, c)

    def clamp_inplace(model, opt, step):
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-c, c)
    for name, edit in (("data", clamp_data), ("inplace", clamp_inplace)):
        model = linear_model()
        opt = wrap(SGD(model.parameters()), model)
        expect_error(f"edit/unflushed_refused_{name}", RuntimeError, "parameters were changed between steps",
                     lambda model=model, opt=opt, edit=edit: train_linear(model, opt, STEPS, edit))
    # model.load_state_dict between steps without flush: refused too
    model = linear_model()
    opt = wrap(SGD(model.parameters()), model)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    expect_error("edit/load_state_dict_unflushed_refused", RuntimeError, "parameters were changed between steps",
                 lambda: train_linear(model, opt, 4, lambda m, o, s: m.load_state_dict(saved)))
    # an edit before flush(): the flush's corrections would overwrite it, so flush raises
    model = linear_model()
    opt = wrap(SGD(model.parameters()), model)

    def edit_then_flush():
        train_linear(model, opt, 3)
        clamp_data(model, opt, 3)
        opt.flush()
    expect_error("edit/before_flush_refused", RuntimeError, "parameters were changed between steps", edit_then_flush)


# -- 7: buffers (BatchNorm statistics) ---------------------------------------------------------------
def buffers():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=sync(), backend=backend, timeout=60)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 6, generator=g) * (1 + rank), torch.randint(0, 3, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.flush()
    model.eval()
    x = torch.randn(32, 6, generator=torch.Generator().manual_seed(5))
    before = comm.allgather_object(model(x).detach())
    check("buffers/differ_without_sync", not all(torch.equal(before[0], b) for b in before))
    osp.sync_buffers(model, backend=backend)
    after = comm.allgather_object(model(x).detach())
    check("buffers/eval_equal_after_sync", all(torch.equal(after[0], a) for a in after))


# -- 4: changes to the model after wrapping: a clear error naming the parameter ----------------------
def after_wrap():
    def stepped(model, opt, dtype=torch.float32):
        opt.zero_grad()
        x = torch.randn(4, 8, dtype=dtype)
        model(x).sum().backward()
        opt.step()

    for how in ("double", "half"):
        model = linear_model()
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
        stepped(model, opt)
        opt.flush()
        model.to(torch.float64) if how == "double" else model.half()
        dtype = torch.float64 if how == "double" else torch.float16
        expect_error(f"after_wrap/{how}", RuntimeError,
                     r"parameter '0.weight' no longer lives where the optimizer was wrapped",
                     lambda model=model, opt=opt, dtype=dtype: stepped(model, opt, dtype))
    model = linear_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    stepped(model, opt)
    opt.flush()
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    expect_error("after_wrap/assign", RuntimeError, r"load_state_dict\(\.\.\., assign=True\)",
                 lambda: stepped(model, opt))
    model = linear_model()
    model[0].weight.requires_grad_(False)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model)
    stepped(model, opt)
    model[0].weight.requires_grad_(True)
    expect_error("after_wrap/unfrozen", RuntimeError,
                 r"parameter '0.weight' has a gradient, but it had requires_grad=False",
                 lambda: stepped(model, opt))
    opt.flush()
    if mode == "dsync":  # each rank picks its own delay: overflows would land at different steps
        m = linear_model()
        o = osp.DistributedOptimizer(SGD(m.parameters()), m.named_parameters(), sync=osp.DSync(delay="auto"),
                                     backend=backend, timeout=60)
        sc = torch.amp.GradScaler("cpu")

        def scaled_step():
            o.zero_grad()
            sc.scale(linear_loss(m, 0)).backward()
            sc.step(o)
        expect_error("after_wrap/auto_delay_refuses_scaler", ValueError,
                     r"DSync\(delay='auto'\) cannot take a GradScaler", scaled_step)
    head = torch.nn.Linear(3, 2)
    expect_error("after_wrap/add_param_group", RuntimeError, r"add_param_group\(\) after wrapping is not supported",
                 lambda: opt.add_param_group({"params": list(head.parameters())}))


SCENARIOS = [clipping, lambda: scaler(False), lambda: scaler(True),
             lambda: freezing("freeze", SGD, {2, 3}), lambda: freezing("freeze_first_adam", ADAM, {0, 1, 4}),
             lambda: freezing("freeze_first_sgd", SGD, {0, 1}),
             gan, two_optimizers, two_backwards, edits, buffers, after_wrap]
ranks.run_all(SCENARIOS)
ranks.save(outdir)
ranks.shutdown(backend)
