"""The drop-in for Horovod: Horovod 0.28.1's own optimizer tests, restated in tests/workers/hvd_parity_worker.py
with osp.DistributedOptimizer in place of hvd.DistributedOptimizer, on 2 ranks under horovodrun for every
mode; and hvd.DistributedOptimizer's keywords checked in this process."""
import os

import pytest
import torch

import launch
import osp

WORKER = os.path.join(launch.HERE, "workers", "hvd_parity_worker.py")
MODES = ["bsp", "osp-auto", "osp-0.25", "dsync-2"]
# every scenario of the worker leaves at least these checks (one that stopped early records an error)
EXPECTED = {"broadcast_state_no_grad/replicas", "broadcast_state_in_flight/exercised",
            "broadcast_state_in_flight/hvd_is_flush", "broadcast_state_in_flight/osp_is_flush",
            "dynamic_requires_grad/replicas", "gradient_clipping/update",
            "no_named_parameters/names", "optimizer_no_named_parameters/alike", "sparse_embeddings/sparse_adam_refused",
            "op/sum_is_average_times_size", "op/adasum_refused", "compression/fp16", "groups/duplicate"}


@pytest.mark.multiproc
@pytest.mark.parametrize("mode", MODES)
def test_horovods_optimizer_tests_pass_in_every_mode(mode, tmp_path):
    proc = launch.run("horovod", 2, [WORKER, mode, str(tmp_path)], timeout=400,
                      env={"HOROVOD_DYNAMIC_PROCESS_SETS": "1"})
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    for r in results:
        missing = EXPECTED - set(r["checks"])
        assert not missing, f"rank {r['rank']} did not run {sorted(missing)}"
        assert any(k.startswith("broadcast_state/SGD/") for k in r["checks"])
        assert any(k.startswith("force_allreduce/Adam/") for k in r["checks"])


def sgd(model=None):
    model = model or torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def test_duplicate_names_raise_before_any_engine_is_needed():
    # Horovod's test_duplicate_names: no engine is initialized here, and the names are checked first
    a, b = torch.nn.Conv2d(1, 1, 1), torch.nn.Conv2d(1, 1, 1)
    opt = torch.optim.SGD(list(a.parameters()) + list(b.parameters()), lr=0.1)
    named = list(a.named_parameters()) + list(b.named_parameters())
    with pytest.raises(ValueError, match="Found duplicates: bias, weight"):
        osp.DistributedOptimizer(opt, named_parameters=named)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(op="max"), "op must be hvd.Average or hvd.Sum"),
    (dict(op=True), "op must be"),
    (dict(op="sum", gradient_predivide_factor=2.0), "for op=hvd.Average only"),
    (dict(gradient_predivide_factor=0.0), "positive number"),
    (dict(gradient_predivide_factor=float("nan")), "positive number"),
    (dict(compression="int8"), "compression"),
    (dict(groups=0), "groups must be"),
    (dict(groups=[[torch.zeros(1)]]), "not a parameter of the optimizer"),
    (dict(groups=["x"]), "list of lists"),
    (dict(sparse_as_dense=1), "sparse_as_dense must be True or False"),
    (dict(process_set="evens"), "horovod ProcessSet"),
])
def test_horovod_keywords_bad_values_are_named(kwargs, pattern):
    _, opt = sgd()
    with pytest.raises(ValueError, match=pattern):
        osp.DistributedOptimizer(opt, **kwargs)


def test_groups_naming_a_parameter_twice_is_refused(one_rank):
    """Horovod's rule (its test_duplicate_groups): each parameter in at most one group; a partition is accepted."""
    model, opt = sgd()
    w0, b0, w1, b1 = model.parameters()
    with pytest.raises(ValueError, match="a parameter can only appear once in groups"):
        osp.DistributedOptimizer(opt, model.named_parameters(), groups=[[w0, b0], [w1, w0]])
    d = osp.DistributedOptimizer(opt, model.named_parameters(), sync=osp.BSP(), groups=[[w0, b0], [w1, b1]])
    assert d.optimizer is opt


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25, block_size=4), osp.DSync(delay=1),
                                  osp.HSP(max_extra=0)], ids=repr)
def test_sparse_as_dense_trains_as_the_dense_embedding(one_rank, sync):
    """sparse_as_dense=True: an Embedding(sparse=True)'s gradient is made dense where it enters osp, and the
    update is plain torch.optim's on the same Embedding(sparse=False) (the one-rank oracle); without it the
    sparse gradient is refused with the keyword to pass."""
    def embedding(sparse):
        torch.manual_seed(0)
        return torch.nn.Embedding(10, 3, sparse=sparse)

    a, b = embedding(True), embedding(False)
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), a.named_parameters(),
                                   sync=sync, sparse_as_dense=True)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for step in range(5):
        ids = torch.tensor([step % 10, (3 * step + 1) % 10, 7])
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            m(ids).pow(2).sum().backward()
            o.step()
    opt.flush()
    torch.testing.assert_close(a.weight, b.weight, rtol=1e-6, atol=1e-7)
    assert not torch.equal(a.weight, embedding(False).weight)  # it trained
    c = embedding(True)
    opt = osp.DistributedOptimizer(torch.optim.SGD(c.parameters(), lr=0.1), c.named_parameters(), sync=sync)
    with pytest.raises(ValueError, match="sparse gradient.*pass sparse_as_dense=True"):  # in backward or step()
        c(torch.tensor([1, 2])).sum().backward()
        opt.step()
        opt.flush()


def test_sparse_adam_is_refused_with_the_alternative():
    emb = torch.nn.Embedding(5, 2, sparse=True)
    with pytest.raises(ValueError, match="use torch.optim.Adam, with sparse_as_dense=True"):
        osp.DistributedOptimizer(torch.optim.SparseAdam(list(emb.parameters())), sparse_as_dense=True)


def test_wrapper_is_an_instance_of_the_wrapped_class(one_rank):
    model, opt = sgd()
    d = osp.DistributedOptimizer(opt, sync=osp.BSP())
    assert isinstance(d, torch.optim.SGD) and isinstance(d, osp.DistributedOptimizer)
    assert type(d).__name__ == "DistributedSGD"
    # one class per wrapped class, and nothing of SGD runs on the wrapper: its step is osp's
    _, opt2 = sgd()
    assert type(osp.DistributedOptimizer(opt2, sync=osp.BSP())) is type(d)
    assert type(d).step.__qualname__.startswith("DistributedOptimizer.step")
    adam = osp.DistributedOptimizer(torch.optim.Adam(torch.nn.Linear(2, 2).parameters()))
    assert isinstance(adam, torch.optim.Adam) and not isinstance(adam, torch.optim.SGD)


def test_a_custom_optimizers_attributes_read_through(one_rank):
    class Custom(torch.optim.SGD):
        def __init__(self, params, **kw):
            super().__init__(params, **kw)
            self.extra = 3

        def extra_twice(self):
            return 2 * self.extra

    model = torch.nn.Linear(2, 2)
    d = osp.DistributedOptimizer(Custom(model.parameters(), lr=0.1), sync=osp.BSP())
    assert isinstance(d, Custom) and d.extra_twice() == 6
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        _ = d.missing


def test_no_names_are_horovods(one_rank):
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opt = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
    d = osp.DistributedOptimizer(opt, sync=osp.BSP())
    assert list(d._parameter_names.values()) == ["allreduce.noname.0.0", "allreduce.noname.0.1",
                                                 "allreduce.noname.1.0", "allreduce.noname.1.1"]
    assert list(d._parameter_names) == list(model.parameters())


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25)], ids=["bsp", "osp"])
def test_state_dict_is_the_optimizers_with_osps_part(one_rank, sync):
    model, opt = sgd()
    d = osp.DistributedOptimizer(opt, sync=sync)
    model(torch.randn(2, 3)).sum().backward()
    d.step()
    d.flush()
    sd = d.state_dict()
    assert set(sd) == {"state", "param_groups", "osp"}
    # live: the state tensors are the optimizer's own (what hvd.broadcast_optimizer_state writes into)
    assert sd["state"][0]["momentum_buffer"] is opt.state[opt.param_groups[0]["params"][0]]["momentum_buffer"]
    before = [p.detach().clone() for p in model.parameters()]
    d.load_state_dict(sd)  # this layout, the layout before (optimizer/osp) and a plain one all load
    d.load_state_dict({"optimizer": opt.state_dict(), "osp": sd["osp"]})
    d.load_state_dict(opt.state_dict())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    with pytest.raises(TypeError, match="expects a dict"):
        d.load_state_dict([1])


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25, block_size=4), osp.DSync(delay=2), osp.HSP()],
                         ids=repr)
def test_horovods_state_initialization_leaves_zero_gradients(one_rank, sync):
    """hvd.broadcast_optimizer_state on a new optimizer (Horovod's test_broadcast_state_no_grad): every parameter
    that requires a gradient is left with a zero .grad and the state is made, a parameter that requires none keeps
    None. osp's part of it (statedict.init_state_for_horovod) does that itself, whoever calls it: Horovod's function
    sets the zeros before, osp.horovod's does not (there the gradient stayed None and no state was made). The
    parameters do not move (weight decay would move them on the ranks without state only), and training goes on
    from there."""
    from osp import statedict

    class NoGrad(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
            self.b = torch.nn.Parameter(torch.rand(6))
            self.c = torch.nn.Parameter(torch.rand(3), requires_grad=False)  # frozen when wrapped

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x + self.c[:2]

    model = NoGrad()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.1, momentum=0.9,
                                                   nesterov=True), model.named_parameters(), sync=sync)
    before = model.b.detach().clone()
    statedict.init_state_for_horovod(opt)
    assert model.b.grad is not None and torch.equal(model.b.grad, torch.zeros(6)), model.b.grad
    assert model.b.grad.data_ptr() == opt.groups[0].grad_views[0].data_ptr()  # its alias in the flat gradient
    assert model.a.grad is None and model.c.grad is None
    assert set(opt.state_dict()["state"]) == {1} and "momentum_buffer" in opt.state_dict()["state"][1]
    assert torch.equal(model.b.detach(), before)
    opt.zero_grad()
    model(torch.ones(2)).sum().backward()
    opt.step()
    opt.flush()
    assert not torch.equal(model.b.detach(), before)


def test_synchronize_then_step_warns_like_horovod_and_skip_synchronize_does_not(one_rank):
    import warnings

    model, opt = sgd()
    d = osp.DistributedOptimizer(opt, sync=osp.BSP())
    for skip in (False, True):
        model(torch.randn(2, 3)).sum().backward()
        d.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if skip:
                with d.skip_synchronize():
                    d.step()
            else:
                d.step()
        assert len(caught) == (0 if skip else 1), [str(w.message) for w in caught]
        d.zero_grad()


@pytest.mark.parametrize("sync", [osp.OSP(critical=0.25), osp.DSync(delay=1), osp.HSP()],
                         ids=["osp", "dsync", "hsp"])
def test_synchronize_outside_bsp_names_the_exact_alternative(one_rank, sync):
    model, opt = sgd()
    d = osp.DistributedOptimizer(opt, sync=sync)
    model(torch.randn(2, 3)).sum().backward()
    with pytest.raises(RuntimeError, match=r"opt\.clip_grad_norm_\(max_norm\); opt\.step\(\)"):
        d.synchronize()
    d.step()
    d.flush()


EXAMPLE = os.path.join(os.path.dirname(launch.HERE), "examples", "horovod_digits.py")


def _example(*args):
    import re

    proc = launch.run("horovod", 2, [EXAMPLE, *args], timeout=240)
    found = re.findall(r"final test loss (\S+)", proc.stdout)
    return proc, (float(found[-1]) if found else None)


@pytest.mark.multiproc
@pytest.mark.jobs
def test_the_horovod_style_example_with_the_swap():
    """examples/horovod_digits.py (Horovod's pytorch_mnist.py laid out on digits, compression= passed):
    BSP ends at exactly Horovod's test loss; OSP trains (its forward passes run on the provisional parameters,
    so its path is not BSP's; DSync's is measured in README, and the parity worker runs DSync); with
    --fp16-allreduce Horovod and OSP train."""
    results = {o: _example("--optimizer", o) for o in ("hvd", "bsp", "osp-0.25")}
    for proc, _ in results.values():
        launch.check(proc)
    loss = {o: v for o, (_, v) in results.items()}
    assert loss["hvd"] is not None and loss["hvd"] < 0.8, loss  # it learns: 2.30 before training
    assert loss["bsp"] == loss["hvd"], loss
    assert loss["osp-0.25"] < 0.8, loss
    # compression=hvd.Compression.fp16 through the swap: it trains as Horovod's does (their roundings differ:
    # Horovod divides after the fp16 sum, osp before it)
    fp16 = {o: _example("--optimizer", o, "--fp16-allreduce") for o in ("hvd", "osp-0.25")}
    for proc, _ in fp16.values():
        launch.check(proc)
    assert all(v is not None and v < 0.8 for _, v in fp16.values()), {o: v for o, (_, v) in fp16.items()}


SYNTHETIC = os.path.join(os.path.dirname(launch.HERE), "examples", "horovod_synthetic_benchmark.py")


@pytest.mark.multiproc
@pytest.mark.jobs
@pytest.mark.parametrize("optimizer", ["hvd", "osp-auto", "dsync-2"])
def test_the_horovod_style_synthetic_benchmark_with_the_swap(optimizer):
    """examples/horovod_synthetic_benchmark.py (Horovod's pytorch_synthetic_benchmark.py laid out on the bench's
    MLP, compression= and op= passed), a few batches: it runs to its totals with the replicas bitwise equal, and
    with --fp16-allreduce too. (Its figures are not measurements: bench/train_throughput.py makes those.)"""
    quick = ["--num-warmup-batches", "2", "--num-batches-per-iter", "2", "--num-iters", "2", "--batch-size", "8"]
    proc = launch.run("horovod", 2, [SYNTHETIC, "--optimizer", optimizer, *quick], timeout=180)
    launch.check(proc)
    assert "Total img/sec on 2 rank(s)" in proc.stdout and "replicas bitwise equal: True" in proc.stdout, proc.stdout
    if optimizer == "osp-auto":
        proc = launch.run("horovod", 2, [SYNTHETIC, "--optimizer", optimizer, "--fp16-allreduce", *quick], timeout=180)
        launch.check(proc)
        assert "replicas bitwise equal: True" in proc.stdout, proc.stdout
