"""The distributed optimizer on real ranks (separate processes, real launchers and collectives):
invariants I1-I4 of docs/design.md, BSP against Horovod's optimizer, and every bad input it lists."""
import glob
import json
import math
import os
import time

import pytest
import torch

import launch
import osp

WORKER = os.path.join(launch.HERE, "workers", "opt_worker.py")


def run_scenario(scenario, backend, nranks, tmp_path, launcher=None, expect_ok=True, timeout=300):
    if backend == "horovod":
        launch.need_horovod()  # under mpirun too
    out = tmp_path / f"{scenario.replace(':', '-')}-{backend}-{nranks}"
    out.mkdir()
    t0 = time.monotonic()
    proc = launch.run(launcher or backend, nranks, [WORKER, scenario, backend, str(out)], timeout=timeout)
    elapsed = time.monotonic() - t0
    if expect_ok:
        launch.check(proc)
    results = [json.loads(open(f).read()) for f in sorted(glob.glob(str(out / "rank*.json")))]
    return results, proc, elapsed


def assert_checks(results, nranks, expected_names=None, nchecks=None):
    assert len(results) == nranks, f"{len(results)} of {nranks} ranks reported"
    for r in results:
        launch.assert_passed(r)
        if nchecks is not None:
            assert len(r["checks"]) == nchecks, sorted(r["checks"])
        for name in expected_names or ():
            assert name in r["checks"], f"check {name} did not run"


# One launch per engine and rank count, every case in turn: starting the ranks is most of a case's time
# (3 Horovod ranks: about 9 s, against about 1 s for one optimizer's checks), and each check's name carries
# its case. torch.distributed ranks are spawned directly (a file store, no launcher agent): much faster
# than torchrun, which other tests cover.
ENGINES = {("horovod", 2): "horovod", ("torch", 2): "spawn", ("horovod", 3): "horovod", ("torch", 3): "spawn"}
OPTIMIZERS = ["sgd", "sgd_momentum_wd_nesterov", "sgd_dampening_maximize", "adam", "adam_amsgrad_wd", "adamw",
              "rmsprop", "adagrad"]
CONFIGS = ["metric_l1", "metric_max", "metric_relative", "metric_relative_generic", "auto", "fp16_auto",
           "bf16_relative", "groups_sgd", "groups_adamw", "groups_rmsprop"]


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,nranks", list(ENGINES), ids=lambda v: str(v))
def test_invariants(backend, nranks, tmp_path):
    """I1 replicas bitwise equal at every correction point; I2 critical=1.0 is BSP; I3 trajectory
    equals averaged updates replayed from the recorded local gradients; I4 flush/checkpoint/resume
    continues bitwise; the stats record the split. For SGD (3 variants), Adam, Adam+amsgrad, AdamW,
    RMSprop and Adagrad."""
    results, _, _ = run_scenario(f"invariants:{','.join(OPTIMIZERS)}", backend, nranks, tmp_path,
                                 ENGINES[backend, nranks])
    names = [f"{c}/{o}" for o in OPTIMIZERS for c in ("I1", "I2", "I3", "I4", "stats")]
    assert_checks(results, nranks, nchecks=len(names), expected_names=names)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,nranks", [("horovod", 2), ("torch", 2), ("torch", 3)], ids=lambda v: str(v))
def test_invariants_across_configs(backend, nranks, tmp_path):
    """I1-I4 for the l1, max and relative metrics (fused and generic corrections), critical='auto',
    fp16 and bf16 parameters, and several param groups with different hyper-parameters. 'relative'
    once made replicas diverge (deferred blocks scored on provisional weights); fp16 'auto' once
    overflowed its measurements to inf. 'auto' is shown a slow network, so it tries deferring."""
    results, _, _ = run_scenario(f"configs:{','.join(CONFIGS)}", backend, nranks, tmp_path, ENGINES[backend, nranks])
    names = []
    for cname in CONFIGS:
        if backend == "horovod" and cname.startswith("bf16"):  # no bfloat16 collectives: a clear error
            names += [f"bf16_refused/{cname}"]
        else:
            names += [f"{i}/{cname}" for i in ("I1", "I3", "I4", "deferred")]
    assert_checks(results, nranks, nchecks=len(names), expected_names=names)


@pytest.mark.multiproc
def test_bsp_matches_horovod_optimizer(tmp_path):
    results, _, _ = run_scenario("horovod_match", "horovod", 2, tmp_path)
    assert_checks(results, 2, nchecks=2)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,nranks", [("horovod", 2), ("torch", 2), ("torch", 3)])
def test_dsync_invariants(backend, nranks, tmp_path):
    """DSync(delay): replicas bitwise equal where exact updates land and after flush (I1), the
    trajectory equals torch.optim replaying the averaged recorded gradients (I3), resume is bitwise
    (I4), for SGD (momentum, nesterov, weight decay), Adam, AdamW and RMSprop (generic path);
    DSync(delay=1) is OSP(critical=0.0), bitwise on 2 ranks."""
    results, _, _ = run_scenario("dsync:1,2,3", backend, nranks, tmp_path, ENGINES[backend, nranks])
    opts = ["sgd_momentum_wd_nesterov", "adam", "adamw", "rmsprop"]
    names = [f"{c}/{o}/delay{d}" for d in (1, 2, 3) for o in opts for c in ("I1", "I3", "I4", "stats")]
    names += [f"dsync1_is_osp0/{o}" for o in opts]
    assert_checks(results, nranks, nchecks=len(names), expected_names=names)


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,nranks", [("horovod", 2), ("torch", 3)])
def test_dsync_bad_input(backend, nranks, tmp_path):
    results, _, _ = run_scenario("dsync_badinput", backend, nranks, tmp_path, ENGINES[backend, nranks])
    assert_checks(results, nranks, nchecks=9, expected_names=["dsync_bad/bool", "dsync_nonfinite_skipped"])


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["horovod", "torch"])
def test_bad_input_on_ranks(backend, tmp_path):
    """Sparse gradients, step() without backward, a gradient missing on some ranks (zeros, as in
    Horovod), non-finite gradients on one rank (step skipped on all, then training recovers), ranks
    that chose different critical blocks (raise on every rank)."""
    results, _, _ = run_scenario("badinput", backend, 2, tmp_path)
    assert_checks(results, 2, nchecks=11, expected_names=["sparse", "step_twice", "nonfinite_skipped/osp",
                                                          "missing_grad/bsp", "mask_mismatch"])


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,launcher", [("horovod", "horovod"), ("torch", "torch"),
                                              ("horovod", "mpirun"), ("torch", "mpirun")])
def test_ranks_that_disagree_fail_everywhere(backend, launcher, tmp_path):
    """Different parameter sets, shapes or options across ranks: the same clear error on every rank,
    no hang; also launched by mpirun (Horovod's MPI controller; torch.distributed from MPI's env)."""
    results, _, _ = run_scenario("mismatch", backend, 2, tmp_path, launcher=launcher)
    assert_checks(results, 2, nchecks=4)
    assert "rank 1 has" in results[0]["checks"]["mismatch_shape"]["detail"]


@pytest.mark.multiproc
@pytest.mark.parametrize("backend", ["horovod", "torch"])
def test_peer_that_dies_raises_in_bounded_time(backend, tmp_path):
    results, proc, elapsed = run_scenario("peer_dies", backend, 2, tmp_path, expect_ok=False, timeout=120)
    survivors = [r for r in results if r["rank"] == 0]
    assert survivors, f"rank 0 reported nothing\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    assert survivors[0]["checks"]["peer_death_detected"]["ok"], survivors[0]
    assert survivors[0]["elapsed"] < 30
    assert proc.returncode != 0 and elapsed < 120


@pytest.mark.multiproc
def test_peer_that_stalls_times_out(tmp_path):
    results, proc, _ = run_scenario("peer_stalls", "torch", 2, tmp_path, expect_ok=False, timeout=120)
    r0 = [r for r in results if r["rank"] == 0]
    assert r0 and r0[0]["checks"]["peer_stall_detected"]["ok"], (r0, proc.stderr[-3000:])


# -- in-process: option validation needs no ranks --------------------------------------------------

@pytest.mark.parametrize("kwargs,pattern", [
    (dict(critical=1.5), r"critical\) must be a number in \[0, 1\] or 'auto', got 1.5"),
    (dict(critical=-0.1), r"critical\) must be"),
    (dict(critical="fast"), r"got 'fast'"),
    (dict(critical=True), r"got True"),
    (dict(min_critical=2), r"min_critical\) must be a number in \[0, 1\], got 2"),
    (dict(metric="l3"), r"metric\) must be one of .*got 'l3'"),
    (dict(block_size=0), r"block_size\) must be an integer in \[1, 2\*\*30\], got 0"),
    (dict(block_size=2.5), r"got 2.5"),
    (dict(warmup=-1), r"warmup\) must be a non-negative integer, got -1"),
])
def test_invalid_osp_options(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        osp.OSP(**kwargs)


def test_invalid_wrapper_options():
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="expected a torch.optim.Optimizer to wrap, got Linear"):
        osp.DistributedOptimizer(model)
    with pytest.raises(TypeError, match="sync must be osp.BSP"):
        osp.DistributedOptimizer(opt, sync="osp")
    with pytest.raises(ValueError, match="backward_passes_per_step must be an integer >= 1, got 0"):
        osp.DistributedOptimizer(opt, backward_passes_per_step=0)
    with pytest.raises(ValueError, match="timeout must be a positive number"):
        osp.DistributedOptimizer(opt, timeout=0)
    with pytest.raises(ValueError, match="bucket_mb"):
        osp.BSP(bucket_mb=0)
    with pytest.raises(ValueError, match="unknown backend 'nccl2'"):
        osp.DistributedOptimizer(opt, backend="nccl2")
    with pytest.raises(RuntimeError, match="found neither an initialized Horovod"):
        osp.DistributedOptimizer(opt)


# -- one rank in this process: OSP must then be exactly the wrapped optimizer ----------------------

@pytest.mark.parametrize("metric", ["l2", "l1", "max", "relative"])
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                                      lambda ps: torch.optim.RMSprop(ps, lr=0.01)], ids=["sgd", "rmsprop"])
def test_one_rank_osp_is_the_plain_optimizer(one_rank, metric, make_opt):
    """With one rank every average is the local gradient, so after flush() OSP (any metric, with
    deferred blocks corrected exactly) must give the plain optimizer's parameters bitwise."""
    torch.manual_seed(0)
    a = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    b = torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))
    b.load_state_dict(a.state_dict())
    opt = osp.DistributedOptimizer(make_opt(a.parameters()), a.named_parameters(),
                                   sync=osp.OSP(critical=0.3, block_size=64, metric=metric))
    ref = make_opt(b.parameters())
    g = torch.Generator().manual_seed(1)
    for _ in range(6):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    opt.flush()
    st = opt.stats()
    assert all(h["bytes_stage2"] > 0 for h in st["history"][1:])
    # the correction recomputes each deferred update from the snapshot: any slip shows here. SGD's
    # kernel matches ATen bitwise where ATen's vector kernels use FMA (AVX2/AVX512).
    exact = isinstance(ref, torch.optim.RMSprop) or torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q) if exact else torch.allclose(p, q, rtol=1e-6, atol=1e-7)


def tiny_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


def local_steps(model, opt, n, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


class OneRankComm(osp.comm.LocalComm):
    """World size 1 on any device (the average of one rank is its own tensor): lets whole steps run on
    the meta device, where no engine can move data. osp's own LocalComm (a rank outside its process set)."""

    name = "one-rank"


class TwoRankMetaComm(OneRankComm):
    """A world of two whose collectives move nothing (the meta device has no values): the paths that
    only run with peers (HSP's extras) run on meta too."""

    size = 2


_META_MODES = [osp.BSP(), osp.OSP(critical=0.3, block_size=64), osp.OSP(critical="auto", warmup=1, block_size=64),
               osp.OSP(critical=0.0, block_size=64), osp.DSync(delay=1), osp.DSync(delay=2),
               osp.DSync(delay="auto", max_delay=2), osp.HSP(max_extra=2)]
_META_OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
                    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
                    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01)}  # the generic correction


@pytest.mark.parametrize("clip", [False, True], ids=["noclip", "clip"])
@pytest.mark.parametrize("sync", _META_MODES, ids=repr)
@pytest.mark.parametrize("oname", sorted(_META_OPTIMIZERS))
def test_whole_steps_on_meta(sync, oname, clip):
    """Every mode's step is device-generic: no CPU tensor mixed into device math and no host read that a
    device without values refuses (meta runs osp's fake kernels), except the documented reads of
    osp.agreement.read (which reads zeros on meta). HSP runs its extras (world of two, forced)."""
    model = tiny_model().to("meta")
    comm = TwoRankMetaComm() if isinstance(sync, osp.HSP) else OneRankComm()
    opt = osp.DistributedOptimizer(_META_OPTIMIZERS[oname](model.parameters()), model.named_parameters(),
                                   sync=sync, backend=comm)
    if isinstance(sync, osp.HSP):
        opt.mode._worth_waiting = lambda *args: False  # no peer to wait for: run the extras
    x = torch.empty(8, 12, device="meta")

    def closure():
        loss = model(x).sum()
        loss.backward()
        return loss

    for _ in range(4):
        opt.zero_grad()
        closure()
        if clip:
            opt.clip_grad_norm_(1.0)
        opt.step(closure) if isinstance(sync, osp.HSP) else opt.step()
    opt.flush()
    assert opt.stats()["steps"] == 4 and all(p.device.type == "meta" for p in model.parameters())
    if isinstance(sync, osp.OSP) and sync.critical != "auto":  # auto measures nothing without values
        assert opt.stats()["history"][-1]["bytes_stage2"] > 0
    if isinstance(sync, osp.HSP):
        assert opt.stats()["hsp"]["extras"] == 4 * 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.3, block_size=64)], ids=repr)
def test_one_rank_steps_on_cuda_equal_the_plain_optimizer(sync):
    a, b = tiny_model().cuda(), tiny_model().cuda()
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), a.named_parameters(),
                                   sync=sync, backend=OneRankComm())
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for o, m in ((opt, a), (ref, b)):
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            x, y = torch.randn(8, 12, generator=g).cuda(), torch.randint(0, 5, (8,), generator=g).cuda()
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
    opt.flush()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=torch.tensor(0.1), momentum=0.9),
                                      lambda ps: torch.optim.RMSprop(ps, lr=torch.tensor(0.01))],
                         ids=["sgd", "rmsprop"])
def test_tensor_lr_with_scheduler_stays_exact(one_rank, make_opt):
    """A scheduler updates a tensor lr in place; each correction must use its own step's lr."""
    a, b = tiny_model(), tiny_model()
    opt = osp.DistributedOptimizer(make_opt(a.parameters()), a.named_parameters(),
                                   sync=osp.OSP(critical=0.3, block_size=64))
    ref = make_opt(b.parameters())
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref)]
    for o, m, sch in ((opt, a, scheds[0]), (ref, b, scheds[1])):
        g = torch.Generator().manual_seed(1)
        for _ in range(6):
            x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            sch.step()
    opt.flush()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.3, block_size=64)], ids=repr)
@pytest.mark.parametrize("make_opt", [lambda ps: torch.optim.SGD(ps, lr=0.1),
                                      lambda ps: torch.optim.RMSprop(ps, lr=0.01)], ids=["sgd", "rmsprop"])
def test_step_hooks_run_once_per_step(one_rank, sync, make_opt):
    model = tiny_model()
    inner = make_opt(model.parameters())
    calls = []
    inner.register_step_post_hook(lambda o, a, k: calls.append("inner-post"))
    opt = osp.DistributedOptimizer(inner, model.named_parameters(), sync=sync)
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    from torch.optim.optimizer import register_optimizer_step_post_hook

    handle = register_optimizer_step_post_hook(lambda o, a, k: calls.append("global"))
    try:
        local_steps(model, opt, 4)
        opt.flush()
    finally:
        handle.remove()
    assert calls == ["pre", "inner-post", "post", "global"] * 4




@pytest.mark.parametrize("critical", [0.25, 0.9])
def test_bucket_ready_last_sends_only_the_floor_in_stage_1(one_rank, critical):
    """The bucket whose gradients are ready last (the first layer's, at the very end of backward) keeps
    only ``min_critical`` of its blocks critical; the rest of its quota goes to the buckets ready earlier
    (where they have room), so the step's critical total is what the share gives every bucket alike."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 48),
                                torch.nn.Tanh(), torch.nn.Linear(48, 5))
    # a bucket per parameter (each holds more than the cap), the last one ready being the first weight
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.OSP(critical=critical, min_critical=0.1, block_size=16,
                                                bucket_mb=1e-5))
    g = torch.Generator().manual_seed(1)
    for step in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        plan, geo = opt.mode.split.plan(), opt.mode.split.geo  # the split backward packed by
        opt.step()
        sizes = [b1 - b0 for _, b0, b1 in geo]
        assert len(sizes) == 6 and geo[-1][1] == 0, geo  # the first weight's blocks, ready last
        uniform = [min(n, math.ceil(critical * n)) for n in sizes]
        floor = math.ceil(0.1 * sizes[-1])
        if step == 0:  # no scores yet: every block critical
            assert plan.counts == sizes
            continue
        assert sum(plan.counts) == sum(uniform), (plan.counts, uniform)
        assert all(0 <= k <= n for k, n in zip(plan.counts, sizes)), plan.counts
        room = sum(n - u for n, u in zip(sizes[:-1], uniform[:-1]))
        assert plan.counts[-1] == floor + max(0, uniform[-1] - floor - room), (plan.counts, sizes)
        # the mask the blocks were packed by agrees, and so does what stage 1 moved
        assert int(plan.mask[:sizes[-1]].sum()) == plan.counts[-1]
        assert opt.stats()["history"][-1]["bytes_stage1"] == sum(plan.counts) * 16 * 4
    opt.flush()


@pytest.mark.parametrize("sync", [osp.BSP(bucket_mb=1e-5), osp.OSP(critical=0.25, block_size=16, bucket_mb=1e-5)],
                         ids=["bsp", "osp"])
def test_unused_parameter_does_not_hold_back_later_buckets(one_rank, sync):
    """A parameter registered last that the loss never uses sits in the first bucket (buckets run in
    reverse order). It must be ready when backward begins: by the time the first layer's gradient (ready
    last) is in, every bucket has started, as DDP's find_unused_parameters gets it. Without that, the
    first bucket waits for the end of backward and every later one waits behind it: nothing overlaps.
    (DSync's buckets wait for the end of backward by design: its averages land steps later.)"""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 5),
                                torch.nn.Linear(5, 5))  # the last layer: never used
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=sync)
    started = []
    model[0].weight.register_post_accumulate_grad_hook(  # after osp's hook on the same parameter
        lambda p: started.append((len(opt.mode.buckets.launched), len(opt.mode.buckets.buckets))))
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x, y = torch.randn(8, 16, generator=g), torch.randint(0, 5, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model[:3](x), y).backward()
        opt.step()
    opt.flush()
    assert len(started) == 3 and all(n == total and total == 6 for n, total in started), started
    assert model[3].weight.grad is None  # left alone, as torch.optim leaves it


@pytest.mark.parametrize("sync", [osp.BSP(bucket_mb=1e-5), osp.OSP(critical=0.25, block_size=16, bucket_mb=1e-5)],
                         ids=["bsp", "osp"])
def test_accumulation_whose_first_pass_skips_a_branch_is_the_plain_optimizer(one_rank, sync):
    """backward_passes_per_step=2, the first pass skipping a branch the second reaches: the branch is ready early
    only in the step's LAST counted pass (which the graph shows will not reach it), never in an earlier one, whose
    miss says nothing of the passes after it. Small buckets: the branch's bucket would start without the second
    pass's gradient (on several ranks; on one, whose average is in place, nothing may start in the first pass).
    The update equals plain torch.optim on the summed gradient."""
    def model():
        torch.manual_seed(0)
        return torch.nn.ModuleDict({"trunk": torch.nn.Linear(8, 5), "branch": torch.nn.Linear(8, 5)})

    def loss(m, x, y, branch):
        out = m["trunk"](x) + (m["branch"](x) if branch else 0)
        return torch.nn.functional.cross_entropy(out, y)

    a, b = model(), model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), a.named_parameters(),
                                   sync=sync, backward_passes_per_step=2)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for _ in range(4):
        xs = [(torch.randn(6, 8, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(2)]
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            for k, (x, y) in enumerate(xs):
                loss(m, x, y, branch=k == 1).backward()
                if o is opt and k == 0:  # one rank averages in place: an early start shows only here
                    assert not opt.mode.buckets.launched, "a bucket started in the step's first of 2 passes"
            o.step()
    opt.flush()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25, block_size=16)], ids=["bsp", "osp"])
def test_reentrant_checkpoint_is_refused(one_rank, sync):
    """torch.utils.checkpoint(..., use_reentrant=True) runs the segment's backward as a backward of its own,
    which the outer pass's graph does not show: its parameters' gradients would come after their bucket
    started. Refused with the way out, never averaged without them. (DSync's buckets wait for the end of
    the step's backward, and it takes the two passes as two: tests/workers/loops_worker.py two_backwards.)"""
    import torch.utils.checkpoint as cp

    torch.manual_seed(0)
    a, b = torch.nn.Linear(6, 8), torch.nn.Linear(8, 3)
    model = torch.nn.Sequential(a, b)
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=sync)
    x = torch.randn(4, 6, requires_grad=True)
    with pytest.raises(RuntimeError, match="use_reentrant=False"):
        b(cp.checkpoint(a, x, use_reentrant=True)).sum().backward()
    opt.zero_grad()  # the optimizer (whose hooks raised) lives to here


def test_critical_zero_defers_everything(one_rank):
    model = tiny_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.OSP(critical=0.0, block_size=64))
    local_steps(model, opt, 4)
    hist = opt.stats()["history"]
    # the first step too: no scores are needed to defer everything (DSync(delay=1) is this)
    assert all(h["bytes_stage1"] == 0 and h["bytes_stage2"] == opt.nbytes for h in hist), hist


@pytest.mark.parametrize("block_size,warned", [(None, True), (64, False)])
def test_a_fixed_share_that_defers_nothing_says_so(one_rank, block_size, warned):
    """OSP(critical=0.25) on a model smaller than one block (the default block_size=4096): ceil(0.25 x 1 block)
    is the block, and every step is BSP's. Warned at construction, at the user's line, naming the block size and
    what to change (issue 57); with blocks enough, the share defers and nothing is said."""
    import warnings

    model = tiny_model()
    kw = {} if block_size is None else {"block_size": block_size}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       sync=osp.OSP(critical=0.25, **kw))
    said = [w for w in caught if "defers nothing" in str(w.message)]
    assert len(said) == int(warned), [str(w.message) for w in caught]
    local_steps(model, opt, 3)
    deferred = sum(h["bytes_stage2"] for h in opt.stats()["history"])
    assert (deferred == 0) == warned, opt.stats()["history"]  # the warning says what the steps did
    if warned:
        assert said[0].filename == __file__, said[0].filename
        assert "1 block(s) (block_size=4096)" in str(said[0].message) and "smaller block_size" in str(said[0].message)


def test_wrapping_errors(one_rank):
    frozen = tiny_model()
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameter"):
        osp.DistributedOptimizer(torch.optim.SGD(frozen.parameters(), lr=0.1), frozen.named_parameters())
    with pytest.raises(ValueError, match=r"block_size\) must be an integer in \[1, 2\*\*30\], got 4611686018427387904"):
        osp.OSP(block_size=2**62)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.3, block_size=64), osp.DSync(delay=2), osp.HSP()],
                         ids=repr)
def test_parameter_frozen_when_wrapped_must_not_train(one_rank, sync):
    """osp does not synchronize a parameter that was frozen when wrapped: if it trains later, each rank
    would move it with its own gradient, so the step refuses (frozen again, it is left alone)."""
    model = tiny_model()
    name, first = next(iter(model.named_parameters()))
    first.requires_grad_(False)
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), sync=sync)
    first.requires_grad_(True)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match=f"parameter {name!r} has a gradient, but it had requires_grad=False when "
                                           "the optimizer was wrapped"):
        opt.step()
    first.requires_grad_(False)
    first.grad = None
    before = first.detach().clone()
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
    opt.flush()
    assert torch.equal(first, before)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.3, block_size=64)], ids=repr)
def test_param_groups_changed_after_wrapping_raise(one_rank, sync):
    model, head = tiny_model(), torch.nn.Linear(5, 3)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    opt = osp.DistributedOptimizer(inner, model.named_parameters(), sync=sync)
    with pytest.raises(RuntimeError, match="add_param_group\\(\\) after wrapping is not supported"):
        opt.add_param_group({"params": head.parameters()})
    local_steps(model, opt, 1)
    inner.add_param_group({"params": list(head.parameters())})
    with pytest.raises(RuntimeError, match=r"param groups changed after wrapping \(parameters per group \[4\] "
                                           r"then, \[4, 2\] now"):
        local_steps(model, opt, 1)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.3, block_size=64), osp.DSync(delay=2)], ids=repr)
def test_extra_backward_raises(one_rank, sync):
    model = tiny_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=sync)
    x, y = torch.randn(8, 12), torch.randint(0, 5, (8,))
    torch.nn.functional.cross_entropy(model(x), y).backward()
    with pytest.raises(RuntimeError, match="got a gradient from 2 backward passes since the last step\\(\\), "
                                           "more than backward_passes_per_step=1"):
        torch.nn.functional.cross_entropy(model(x), y).backward()
    assert opt.stats()["steps"] == 0  # the optimizer must stay alive: its hooks hold it weakly


def test_cpu_model_on_a_gpu_host_gets_gloo(monkeypatch):
    """The torch engine follows where the model lives: a CPU model on a host with GPUs needs Gloo."""
    import torch.distributed as dist

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    osp.launcher.init_from_env("torch")
    try:
        assert dist.get_backend() == "gloo"
    finally:
        dist.destroy_process_group()
    with pytest.raises(ValueError, match="device\\) must be 'cpu' or 'cuda', got 'xpu'"):
        osp.launcher.init_from_env("torch", device="xpu")


# -- DSync ---------------------------------------------------------------------------------------

DSYNC_OPTIMIZERS = {
    "sgd_nesterov_wd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, weight_decay=0.1),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-2, momentum=0.5),
}


@pytest.mark.parametrize("delay", [1, 2, 3, "auto"])
@pytest.mark.parametrize("oname", sorted(DSYNC_OPTIMIZERS))
def test_one_rank_dsync_is_the_plain_optimizer(one_rank, oname, delay):
    """One rank: every average is the local gradient, so the exact updates DSync applies late (after
    restoring its snapshot, with the provisional updates replayed in between) must give the plain
    optimizer's parameters and state, under an LR schedule, whatever the delay."""
    make_opt = DSYNC_OPTIMIZERS[oname]
    a, b = tiny_model(), tiny_model()
    opt = osp.DistributedOptimizer(make_opt(a.parameters()), a.named_parameters(),
                                   sync=osp.DSync(delay=delay, max_delay=3))
    ref = make_opt(b.parameters())
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + 0.2 * s)) for o in (opt, ref)]
    g = torch.Generator().manual_seed(1)
    for step in range(7):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        for m, o, s in zip((a, b), (opt, ref), scheds):
            o.zero_grad()
            torch.nn.functional.cross_entropy(m(x), y).backward()
            o.step()
            s.step()
        if step == 3:
            opt.flush()  # a flush in the middle: the delay starts over
    opt.flush()
    st = opt.stats()
    assert st["steps"] == 7 and st["delay"] >= 1
    if delay not in (1, "auto"):
        assert sum(h["replayed"] for h in st["history"]) > 0
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
    for p, q in zip(a.parameters(), b.parameters()):
        for k, v in ref.state[q].items():
            torch.testing.assert_close(opt.state[p][k], v, rtol=1e-5, atol=1e-6, msg=f"state {k!r}")


def test_compiled_model_steps_like_the_plain_optimizer(one_rank):
    """torch.compile on the model: the backward hooks still fire (BSP averages in backward), and every
    mode with one rank equals the plain optimizer."""
    for sync in (osp.BSP(), osp.OSP(critical=0.3, block_size=16), osp.DSync(delay=2)):
        model, ref = tiny_model(), tiny_model()
        opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       model.named_parameters(), sync=sync, backend="torch")
        compiled = torch.compile(model)
        local_steps(compiled, opt, 4)
        opt.flush()
        local_steps(ref, torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), 4)
        for a, b in zip(model.parameters(), ref.parameters()):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-6)


def test_select_critical_takes_the_highest_scores_ties_to_the_lower_index():
    from osp.split import select_critical
    s = torch.tensor([0.1, 5.0, 3.0, 0.2, 3.0])
    assert select_critical(s, 2).tolist() == [False, True, True, False, False]
    assert select_critical(s, 3).tolist() == [False, True, True, False, True]  # the tie at 3.0: both
    assert select_critical(torch.tensor([1.0, 1.0, 1.0]), 1).tolist() == [True, False, False]
    assert select_critical(s, 0).tolist() == [False] * 5 and select_critical(s, 9).tolist() == [True] * 5


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25), osp.DSync(delay=1)], ids=["bsp", "osp", "dsync"])
def test_no_sync_after_the_steps_last_pass_is_refused(one_rank, sync):
    # DDP's no_sync() passes come before the pass that averages; one after it could not reach the average
    model = tiny_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), sync=sync)
    x = torch.randn(4, 12)
    model(x).sum().backward()
    with pytest.raises(RuntimeError, match="inside no_sync\\(\\) after the step's last counted"):
        with opt.no_sync():
            model(x).sum().backward()
    with pytest.raises(RuntimeError, match="entered again"):
        with opt.no_sync():
            with opt.no_sync():
                pass


def test_the_default_is_the_share_the_docs_advise():
    """docs/modes.md advises starting with OSP(critical="auto") (on a fast link it settles on BSP); the default
    mode, OSP(), and DistributedOptimizer without sync= are that, not a fixed share."""
    assert osp.OSP().critical == "auto" and osp.OSP().min_critical == 0.05
    model = tiny_model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   backend=OneRankComm())
    assert opt.sync.critical == "auto"
    with open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "modes.md")) as fh:
        assert 'Start with `osp.OSP(critical="auto")`' in fh.read()
