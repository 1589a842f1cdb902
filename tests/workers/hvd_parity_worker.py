"""Horovod 0.28.1's optimizer tests (test/parallel/test_torch.py), restated in our own words with
``osp.DistributedOptimizer`` standing in for ``hvd.DistributedOptimizer`` (tests/test_horovod_parity.py).
Each scenario names the Horovod test it mirrors and says where it departs from it, and why. Where Horovod's
test asserts nothing (it must merely run), the scenario adds an oracle: replicas bitwise equal, or equal to
plain ``torch.optim`` replaying the averaged gradient. argv: mode, outdir. Runs under horovodrun.
"""
import inspect
import sys
import warnings

import horovod.torch as hvd
import torch
import torch.nn.functional as F
from ranks import check, expect_error, run_all, save, shutdown, start

import osp

mode, outdir = sys.argv[1], sys.argv[2]
SYNCS = {"bsp": lambda: osp.BSP(), "osp-auto": lambda: osp.OSP(critical="auto", warmup=1),
         "osp-0.25": lambda: osp.OSP(critical=0.25), "dsync-2": lambda: osp.DSync(delay=2)}
sync = SYNCS[mode]
comm = start("horovod")
rank, size = hvd.rank(), hvd.size()
bsp = mode == "bsp"


def wrap(opt, named=None, **kw):
    """The one-line swap: ``hvd.DistributedOptimizer(opt, named_parameters=...)`` becomes this."""
    return osp.DistributedOptimizer(opt, named_parameters=named, sync=sync(), **kw)


def settle(opt):
    """What OSP and DSync need where Horovod's tests read the state right after step(): the last exact
    updates applied (state_dict() raises while they are in flight). BSP has nothing in flight."""
    opt.flush()


def mlp():
    # Horovod's "Model-A": Linear(100, 10), ReLU, Linear(10, 10); a random init of each rank's own
    return torch.nn.Sequential(torch.nn.Linear(100, 10), torch.nn.ReLU(), torch.nn.Linear(10, 10))


def data(seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(64, 100, generator=g), torch.randn(64, 10, generator=g)


def optimizer_classes():
    """As Horovod enumerates them: the direct subclasses of torch.optim.Optimizer defined in torch.optim,
    by name, without LBFGS and SparseAdam (Horovod leaves those out) and Muon (torch refuses it for the
    model's 1-D biases, with Horovod's optimizer too)."""
    out = [c for c in torch.optim.Optimizer.__subclasses__() if c.__module__.startswith("torch.optim")
           and c.__name__ not in ("LBFGS", "SparseAdam", "Muon")]
    return sorted(out, key=lambda c: c.__name__)


def build(cls, kwargs, params):
    accepted = inspect.signature(cls.__init__).parameters
    return cls(params, **{k: v for k, v in kwargs.items() if k in accepted})


OPTIONS = [dict(lr=0.2, momentum=0.9, weight_decay=0.1, centered=True), dict(lr=0.2)]


def state_values(opt):
    """Every parameter's state entries in param-group order, by name, cloned (Horovod's helper)."""
    sd = opt.state_dict()
    out = []
    for g in sd["param_groups"]:
        for pid in g["params"]:
            for name, v in sorted(sd["state"].get(pid, {}).items()):
                out.append((name, v.clone() if torch.is_tensor(v) else v))
    return out


def same_values(a, b):
    if torch.is_tensor(a) != torch.is_tensor(b):
        return False
    return (type(a) is type(b) and torch.equal(a, b)) if torch.is_tensor(a) else (type(a) is type(b) and a == b)


def test_broadcast_state():
    """Horovod's test_broadcast_state: a step, root's model and state noted; root saves a checkpoint, every
    rank builds a new model and optimizer, root loads the checkpoint, and broadcast_parameters plus
    broadcast_optimizer_state give every rank root's model and state (the ranks without state have it
    made by hvd.broadcast_optimizer_state's zero-gradient step). Departs: settle() after the step, and
check_replicas=0: the ranks' first step runs on replicas that differ on purpose (osp refuses that by default)."""
    import io

    x, y = data(rank)
    for cls in optimizer_classes():
        for k, kwargs in enumerate(OPTIONS):
            name = f"broadcast_state/{cls.__name__}/{k}"
            model = mlp()
            # each rank steps its own random init before the broadcast under test: replicas apart on purpose
            opt = wrap(build(cls, kwargs, model.parameters()), model.named_parameters(), check_replicas=0)
            check(name + "/isinstance", isinstance(opt, cls), type(opt).__mro__)
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
            settle(opt)
            expected_model = [(n, v.clone()) for n, v in sorted(model.state_dict().items())]
            for n, v in expected_model:
                hvd.broadcast_(v, root_rank=0, name=f"{name}.model.{n}")
            expected_state = []
            for i, (n, v) in enumerate(state_values(opt)):
                if torch.is_tensor(v):
                    hvd.broadcast_(v, root_rank=0, name=f"{name}.state.{i}")
                else:
                    v = hvd.broadcast_object(v, root_rank=0, name=f"{name}.state.{i}")
                expected_state.append((n, v))
            buf = io.BytesIO()
            if rank == 0:
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, buf)
            model = mlp()
            opt = wrap(build(cls, kwargs, model.parameters()), model.named_parameters())
            if rank == 0:
                buf.seek(0)
                ck = torch.load(buf)
                model.load_state_dict(ck["model"])
                opt.load_state_dict(ck["optimizer"])
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            got = sorted(model.state_dict().items())
            check(name + "/model", [n for n, _ in got] == [n for n, _ in expected_model]
                  and all(torch.equal(a, b) for (_, a), (_, b) in zip(got, expected_model)), "model differs")
            count = hvd.broadcast_object(len(opt.state_dict()["state"]), root_rank=0, name=f"{name}.count")
            hvd.broadcast_optimizer_state(opt, root_rank=0)
            check(name + "/count", len(opt.state_dict()["state"]) == count, (len(opt.state_dict()["state"]), count))
            got = state_values(opt)
            check(name + "/state", len(got) == len(expected_state) and all(
                a[0] == b[0] and same_values(a[1], b[1]) for a, b in zip(got, expected_state)),
                f"{[n for n, _ in got]} vs {[n for n, _ in expected_state]}")
            # and it trains on from there, every replica alike
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
            settle(opt)
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            check(name + "/replicas", torch.equal(mine, hvd.broadcast(mine, 0, name=f"{name}.after")),
                  "replicas differ after a step from the broadcast state")


def test_broadcast_state_options():
    """Horovod's test_broadcast_state_options: each rank builds its optimizer with other hyper-parameters;
    after a step, broadcast_optimizer_state gives every rank root's, with their Python types, and a
    second step runs on them. As Horovod's, the broadcast comes right after step(), with DSync's average still in
    flight: every rank calls it at the same point, and it flushes first. Departs: settle() after the second step
    (the optimizer is dropped then), and check_replicas=0 (the first step makes the replicas differ on purpose,
    which osp refuses by default)."""
    p0 = dict(lr=0.1, momentum=0.8, weight_decay=0.2, nesterov=True, betas=(0.9, 0.999), etas=(0.8, 2.4),
              step_sizes=(1e-5, 100))
    p1 = dict(lr=0.2, momentum=0.9, weight_decay=0.1, nesterov=False, betas=(0.8, 0.9), etas=(0.25, 1.75),
              step_sizes=(1e-7, 5))
    x, y = data(rank)
    for cls in optimizer_classes():
        name = f"broadcast_state_options/{cls.__name__}"
        model = mlp()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # each rank's own hyper-parameters step the replicas apart on purpose, before the broadcast under test
        opt = wrap(build(cls, p0 if rank == 0 else p1, model.parameters()), model.named_parameters(), check_replicas=0)
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        accepted = inspect.signature(cls.__init__).parameters
        ok, detail = True, ""
        for k, want in p0.items():
            if k not in accepted:
                continue
            have = opt.param_groups[0][k]
            pairs = zip(have, want) if isinstance(want, tuple) else [(have, want)]
            for a, b in pairs:
                if type(a) is not type(b) or abs(a - b) > 1e-5:
                    ok, detail = False, f"{k}: {have!r} vs root's {want!r}"
        check(name, ok, detail)
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
        settle(opt)


def test_broadcast_state_in_flight():
    """Horovod's tests call broadcast_optimizer_state right after step(). Where OSP's stage 2 or DSync's average is
    in flight then (a model big enough that OSP(0.25) defers blocks), hvd.broadcast_optimizer_state, which every
    rank calls at the same point, flushes first: the parameters and state it leaves are bitwise those of
    ``opt.flush()`` by hand. osp.broadcast_optimizer_state does the same. A plain state_dict() with work in flight
    stays refused, on every rank alike, naming flush()."""
    x, y = data(300 + rank)

    def run(how):
        torch.manual_seed(3)
        model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.ReLU(), torch.nn.Linear(100, 10))
        opt = wrap(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters())
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
        in_flight = opt.in_flight
        if how == "flush":
            if in_flight:
                expect_error("broadcast_state_in_flight/state_dict_refused", RuntimeError,
                             r"call flush\(\) on every rank first", opt.state_dict)
            else:
                check("broadcast_state_in_flight/state_dict_refused", True)
            opt.flush()
        elif how == "hvd":
            hvd.broadcast_optimizer_state(opt, root_rank=0)
        else:
            osp.broadcast_optimizer_state(opt, root_rank=0)
        check(f"broadcast_state_in_flight/{how}/nothing_in_flight", not opt.in_flight)
        return in_flight, torch.cat([p.detach().reshape(-1) for p in model.parameters()]), state_values(opt)

    in_flight, params, state = run("flush")
    check("broadcast_state_in_flight/exercised", in_flight == (mode in ("osp-0.25", "dsync-2")), in_flight)
    check("broadcast_state_in_flight/replicas", torch.equal(params, hvd.broadcast(params, 0, name="bsif")))
    for how in ("hvd", "osp"):
        _, p, st = run(how)
        check(f"broadcast_state_in_flight/{how}_is_flush", torch.equal(p, params) and len(st) == len(state) and all(
            a[0] == b[0] and same_values(a[1], b[1]) for a, b in zip(st, state)), (p - params).abs().max())


def test_broadcast_state_no_grad():
    """Horovod's test_broadcast_state_no_grad: an int parameter without gradient next to a float one;
    broadcasting the state of a new optimizer gives the float one a zero gradient, the int one none."""

    class ModelNoGrad(torch.nn.Module):
        def __init__(self, a, b):
            super().__init__()
            self.a = torch.nn.Parameter(a.int(), requires_grad=False)
            self.b = torch.nn.Parameter(b)

        def forward(self, x):
            return torch.index_select(self.b, 0, self.a.long()) * x

    model = ModelNoGrad(torch.tensor([1.0, 3.0]), torch.rand(4))
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.001, weight_decay=1e-6, momentum=0.9, nesterov=True),
               model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    grad = opt.param_groups[0]["params"][1].grad
    check("broadcast_state_no_grad/int_param_no_grad", opt.param_groups[0]["params"][0].grad is None)
    check("broadcast_state_no_grad/zero_grad_alike", grad is not None and torch.equal(
        grad, hvd.broadcast(grad, root_rank=0, name="no_grad.grad")) and not grad.any(), grad)
    # osp's own function does the same, and the optimizer then steps alike everywhere
    osp.broadcast_optimizer_state(opt, root_rank=0)
    x = torch.rand(2) + rank
    opt.zero_grad()
    model(x).sum().backward()
    opt.step()
    settle(opt)
    check("broadcast_state_no_grad/replicas", torch.equal(model.b.detach(), hvd.broadcast(
        model.b.detach(), 0, name="no_grad.b")))


def test_force_allreduce():
    """Horovod's test_force_allreduce: rank 0's loss leaves fc3 without a gradient, the others' use it;
    every step must finish on every rank (Horovod asserts nothing more). Added: replicas bitwise equal."""

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = torch.nn.Linear(100, 10), torch.nn.Linear(10, 10), torch.nn.Linear(10, 10)

        def forward(self, x):
            x1 = self.fc2(F.relu(self.fc1(x)))
            return x1, self.fc3(F.relu(x1))

    x, y = data(rank)
    for cls in optimizer_classes():
        for k, kwargs in enumerate(OPTIONS):
            name = f"force_allreduce/{cls.__name__}/{k}"
            model = Net()
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
            opt = wrap(build(cls, kwargs, model.parameters()), model.named_parameters())
            x1, x2 = model(x)
            opt.zero_grad()
            F.mse_loss(x1 if rank == 0 else x2, y, reduction="sum").backward()
            opt.step()
            settle(opt)
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            check(name, torch.equal(mine, hvd.broadcast(mine, 0, name=name)), "replicas differ")


def test_dynamic_requires_grad():
    """Horovod's test_dynamic_requires_grad: a generator and a discriminator, each with its own optimizer,
    trained in turns by switching requires_grad; the frozen one gets no gradient."""
    gen, disc = torch.nn.Conv2d(1, 10, 1), torch.nn.Conv2d(10, 1, 1)
    hvd.broadcast_parameters(gen.state_dict(), root_rank=0)
    hvd.broadcast_parameters(disc.state_dict(), root_rank=0)
    inp = torch.rand(1, 1, 20, 20) + rank
    g_opt = wrap(torch.optim.SGD(gen.parameters(), lr=0.1), gen.named_parameters())
    d_opt = wrap(torch.optim.SGD(disc.parameters(), lr=0.1), disc.named_parameters())
    ok = True
    for _ in range(10):
        for train_gen in (True, False):
            for p in gen.parameters():
                p.requires_grad_(train_gen)
            for p in disc.parameters():
                p.requires_grad_(not train_gen)
            g_opt.zero_grad()
            d_opt.zero_grad()
            disc(gen(inp)).sum().backward()
            for module, training in ((gen, train_gen), (disc, not train_gen)):
                for p in module.parameters():
                    ok &= training == (p.grad is not None and bool(p.grad.abs().max() != 0))
            (g_opt if train_gen else d_opt).step()
    g_opt.flush()
    d_opt.flush()
    check("dynamic_requires_grad/grads", ok)
    mine = torch.cat([p.detach().reshape(-1) for m in (gen, disc) for p in m.parameters()])
    check("dynamic_requires_grad/replicas", torch.equal(mine, hvd.broadcast(mine, 0, name="drg")))


def clip_model():
    model = torch.nn.Linear(1, 1)
    with torch.no_grad():
        model.weight.fill_(0.5)
        model.bias.fill_(0.0)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return model


def test_gradient_clipping():
    """Horovod's test_gradient_clipping: synchronize(), clip the averaged gradient, and step inside
    skip_synchronize() (BSP; no warning). OSP and DSync refuse synchronize() with the alternative,
    opt.clip_grad_norm_, which must give BSP's clipped update."""
    model = clip_model()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    x, y = torch.ones(1, 1), torch.ones(1, 1)
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    if bsp:
        opt.synchronize()
        prior = model.weight.grad.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
        clipped = model.weight.grad.item()
        check("gradient_clipping/clipped", abs(prior) > abs(clipped), (prior, clipped))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with opt.skip_synchronize():
                opt.step()
        check("gradient_clipping/no_warning", not caught, [str(w.message) for w in caught])
    else:
        expect_error("gradient_clipping/synchronize_refused", RuntimeError, r"opt\.clip_grad_norm_\(max_norm\)",
                     opt.synchronize)
        opt.clip_grad_norm_(0.1)
        opt.step()
        settle(opt)
    # the oracle: plain torch on the same gradient (every rank's is the same here, so it is the average)
    ref = clip_model()
    plain = torch.optim.SGD(ref.parameters(), lr=0.1)
    F.mse_loss(ref(x), y).backward()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    plain.step()
    check("gradient_clipping/update", torch.allclose(model.weight, ref.weight, rtol=1e-6, atol=0)
          and torch.allclose(model.bias, ref.bias, rtol=1e-6, atol=0),
          (model.weight.item(), ref.weight.item()))


def test_synchronize_step_warning():
    """Horovod's test_synchronize_step_warning: step() after synchronize() without skip_synchronize()
    warns exactly once (BSP; the other modes refuse synchronize(), test_gradient_clipping)."""
    if not bsp:
        return
    model = torch.nn.Linear(1, 1)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters())
    opt.zero_grad()
    F.mse_loss(model(torch.zeros(1, 1)), torch.ones(1, 1)).backward()
    opt.synchronize()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    check("synchronize_step_warning", len(caught) == 1 and "optimizer.step() called without "
          "optimizer.skip_synchronize()" in str(caught[0].message), [str(w.message) for w in caught])


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = torch.nn.Conv2d(1, 100, 1), torch.nn.Conv2d(100, 1, 1)

    def forward(self, x):
        return self.conv2(F.relu(self.conv1(x)))


def test_no_named_parameters():
    """Horovod's test_no_named_parameters and test_missing_named_parameters (a 100x100 input where
    Horovod's is 1000x1000: the same model, a hundredth of the memory). Departs: check_replicas=0 (the ranks
    step their own random initial weights, which osp refuses by default)."""
    model = ConvNet()
    # each rank steps its own random init (Horovod's test broadcasts nothing): replicas apart on purpose
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), check_replicas=0)
    opt.zero_grad()
    model(torch.rand(1, 1, 100, 100)).sum().backward()
    opt.step()
    settle(opt)
    check("no_named_parameters/names", sorted(opt._parameter_names.values()) == [
        f"allreduce.noname.0.{i}" for i in range(4)], opt._parameter_names)
    model = ConvNet()
    expect_error("missing_named_parameters", ValueError, "not in named_parameters", lambda: wrap(
        torch.optim.SGD(model.parameters(), lr=0.1), list(model.named_parameters())[0:1]))


def test_optimizer_no_named_parameters():
    """Horovod's test_optimizer_no_named_parameters: two param groups, no names; every parameter gets its
    own name, the same on every rank."""
    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10))
    opt = wrap(torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}],
                               lr=0.001))
    names = opt._parameter_names
    check("optimizer_no_named_parameters/distinct", len(names) == 4 == len(set(names.values())), names)
    everyone = hvd.allgather_object(set(names.values()))
    check("optimizer_no_named_parameters/alike", len(everyone) == size and all(s == everyone[0] for s in everyone))


def test_sparse_embeddings():
    """Horovod's test_sparse_embeddings with sparse_as_dense=True: an Embedding(sparse=True), other indices on
    each rank. Departs: Adam where Horovod steps SparseAdam (osp's gradients are dense: SparseAdam is refused
    at wrapping, as is a sparse gradient without sparse_as_dense). Added: equal to plain Adam replaying the
    averaged dense gradient."""
    torch.manual_seed(0)
    model = torch.nn.Embedding(10, 3, sparse=True)
    start_w = model.weight.detach().clone()
    idx = torch.tensor([[1, 2, 4, 5], [4, 3, 2, 9]]) if rank == 0 else torch.tensor([[1, 3, 4], [4, 7, 9]])
    opt = wrap(torch.optim.Adam(model.parameters(), lr=0.1), sparse_as_dense=True)
    opt.zero_grad()
    model(idx).sum().backward()
    opt.step()
    settle(opt)
    ref = torch.nn.Embedding(10, 3, sparse=True)
    with torch.no_grad():
        ref.weight.copy_(start_w)
    ref(idx).sum().backward()
    avg = hvd.allreduce(ref.weight.grad.to_dense(), name="sparse.avg")
    ref.weight.grad = avg
    torch.optim.Adam(ref.parameters(), lr=0.1).step()
    check("sparse_embeddings/update", torch.allclose(model.weight, ref.weight, rtol=1e-6, atol=1e-7),
          (model.weight - ref.weight).abs().max())
    model = torch.nn.Embedding(10, 3, sparse=True)
    opt = wrap(torch.optim.Adam(model.parameters(), lr=0.1))
    # raised where the gradient is gathered: in backward (BSP's buckets) or in step()
    expect_error("sparse_embeddings/needs_sparse_as_dense", ValueError, "sparse_as_dense=True",
                 lambda: (model(idx).sum().backward(), opt.step()))
    expect_error("sparse_embeddings/sparse_adam_refused", ValueError, "SparseAdam",
                 lambda: wrap(torch.optim.SparseAdam(list(model.parameters()), lr=0.1), sparse_as_dense=True))


def test_optimizer_process_sets():
    """Horovod's test_optimizer_process_sets on 2 ranks: the set {0}, every rank builds its optimizer on it; rank 0's
    averages over the set alone and rank 1, outside it, steps alone (as under Horovod's optimizer, which registers
    no hooks there): each equals plain torch.optim on its own data."""
    even = hvd.add_process_set([0])
    try:
        torch.manual_seed(rank)
        x, y = data(100 + rank)
        model = mlp()
        start_w = [p.detach().clone() for p in model.parameters()]
        opt = wrap(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9, weight_decay=0.1),
                   model.named_parameters(), process_set=even)
        for _ in range(3):
            opt.zero_grad()
            F.mse_loss(model(x), y, reduction="sum").backward()
            opt.step()
        settle(opt)
        ref = mlp()
        with torch.no_grad():
            for p, w in zip(ref.parameters(), start_w):
                p.copy_(w)
        plain = torch.optim.SGD(ref.parameters(), lr=0.2, momentum=0.9, weight_decay=0.1)
        for _ in range(3):
            plain.zero_grad()
            F.mse_loss(ref(x), y, reduction="sum").backward()
            plain.step()
        pairs = list(zip(model.parameters(), ref.parameters()))
        close = all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in pairs)
        exact = all(torch.equal(a, b) for a, b in pairs)
        check("optimizer_process_sets/one_rank_set_is_plain_torch" if rank == 0 else
              "optimizer_process_sets/outside_steps_alone", exact if bsp else close)
    finally:
        hvd.remove_process_set(even)


def sgd_run(**kw):
    """Three momentum-SGD steps from the same start on rank-dependent data; the parameters after."""
    torch.manual_seed(7)
    model = mlp()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=kw.pop("lr"), momentum=0.9), model.named_parameters(), **kw)
    x, y = data(200 + rank)
    for _ in range(3):
        opt.zero_grad()
        F.mse_loss(model(x), y, reduction="sum").backward()
        opt.step()
    settle(opt)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_op_and_predivide():
    """Horovod's op= and gradient_predivide_factor (no test of Horovod's covers them): op=hvd.Sum applies
    the sum, so SGD with lr equals op=hvd.Average with lr * size, bitwise for a power-of-two size; a
    predivide factor of 2 under BSP equals none, bitwise; elsewhere it is refused."""
    summed = sgd_run(lr=0.001, op=hvd.Sum)
    averaged = sgd_run(lr=0.001 * size)
    check("op/sum_is_average_times_size", torch.equal(summed, averaged), (summed - averaged).abs().max())
    if bsp:
        check("predivide/bsp", torch.equal(sgd_run(lr=0.001, gradient_predivide_factor=2.0), sgd_run(lr=0.001)))
    else:
        model = mlp()
        expect_error("predivide/refused", ValueError, "osp.BSP", lambda: wrap(
            torch.optim.SGD(model.parameters(), lr=0.1), gradient_predivide_factor=2.0))
    model = mlp()
    expect_error("op/adasum_refused", ValueError, "Adasum", lambda: wrap(
        torch.optim.SGD(model.parameters(), lr=0.1), op=hvd.Adasum))


def test_compression_and_groups():
    """The examples pass compression=hvd.Compression.none or fp16 (both accepted: fp16 sends the gradients as
    float16, the replicas stay equal); groups= is accepted (osp's buckets fuse) and checked as Horovod checks it."""
    model = mlp()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
               compression=hvd.Compression.none, groups=2)
    x, y = data(rank)
    F.mse_loss(model(x), y).backward()
    opt.step()
    settle(opt)
    check("compression/none", True)
    model = mlp()
    opt = wrap(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(), compression=hvd.Compression.fp16)
    F.mse_loss(model(x), y).backward()
    opt.step()
    settle(opt)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    check("compression/fp16", opt.compression is osp.Compression.fp16
          and all(torch.equal(flat, f) for f in hvd.allgather_object(flat)))
    expect_error("groups/duplicate", ValueError, "only appear once", lambda: wrap(
        torch.optim.SGD(model.parameters(), lr=0.1), groups=[[model[0].weight, model[0].weight]]))


run_all([test_broadcast_state, test_broadcast_state_options, test_broadcast_state_in_flight,
         test_broadcast_state_no_grad, test_force_allreduce, test_dynamic_requires_grad, test_gradient_clipping,
         test_synchronize_step_warning, test_no_named_parameters, test_optimizer_no_named_parameters,
         test_sparse_embeddings, test_optimizer_process_sets, test_op_and_predivide, test_compression_and_groups])
save(outdir)
shutdown("horovod")
