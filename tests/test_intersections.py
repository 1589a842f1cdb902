"""Where a torch feature meets osp's own machinery: each feature trains as plain torch.optim does (the one-rank
oracle), or is refused early with an error that names what was expected, what was got, and the alternative.

- a gradient penalty (``torch.autograd.grad(create_graph=True)``) with ``gradient_predivide_factor`` /
  ``op="sum"``: the prescale acts on what accumulates into ``.grad``, never on autograd.grad's results;
- an optimizer whose ``step()`` needs a closure (LBFGS): refused at construction;
- channels_last (dense, not row-major) parameters keep their strides as views of the flat buffer, and so do
  their gradients; parameters whose elements share memory are refused;
- ``nn.Embedding(max_norm=...)``: trains under BSP and HSP; refused under OSP and DSync, whose exact
  corrections cannot take an in-place edit made inside the forward.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import launch
import osp

WORKER = os.path.join(launch.HERE, "workers", "intersections_worker.py")


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def ulps(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between ``a`` and ``b`` in float32 units in the last place."""
    ia, ib = a.detach().float().view(torch.int32).long(), b.detach().float().view(torch.int32).long()
    # a monotonic integer order of the floats (negative ones mirrored)
    ia = torch.where(ia < 0, -(ia & 0x7FFFFFFF), ia)
    ib = torch.where(ib < 0, -(ib & 0x7FFFFFFF), ib)
    return int((ia - ib).abs().max()) if a.numel() else 0


# -- 1. the prescale (gradient_predivide_factor, op="sum") reaches .grad, not torch.autograd.grad --------------

def penalized(model, x, y):
    loss = F.mse_loss(model(x), y)
    gs = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    return loss + 0.1 * sum((g ** 2).sum() for g in gs), gs


def test_gradient_penalty_with_predivide_factor_is_the_plain_optimizer(one_rank):
    """BSP with gradient_predivide_factor=4 on one rank: the penalty's autograd.grad returns the true gradient,
    and 5 steps of momentum SGD equal plain torch.optim bitwise (a factor of 4 is exact either way)."""
    a, b = mlp(), mlp()
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), a.named_parameters(),
                                   sync=osp.BSP(), gradient_predivide_factor=4)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    for step in range(5):
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)
        grads = []
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            total, gs = penalized(m, x, y)
            grads.append([t.detach() for t in gs])
            total.backward()
            o.step()
        for u, v in zip(*grads):
            assert torch.equal(u, v), f"step {step}: autograd.grad returned {(u / v).flatten()[0]:g} times the gradient"
        for p, q in zip(a.parameters(), b.parameters()):
            assert torch.equal(p, q), f"step {step}: max abs diff {(p - q).abs().max():.3g}"


def test_predivide_factor_scales_no_sync_and_double_backward_passes(one_rank):
    """Every pass that accumulates into .grad is prescaled (and the average postscaled): a no_sync() pass of a
    penalized loss, then a counted one, equal plain torch.optim on the summed gradient; autograd.grad inside
    no_sync() is the true gradient too."""
    a, b = mlp(), mlp()
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), a.named_parameters(), sync=osp.BSP(),
                                   gradient_predivide_factor=4)
    ref = torch.optim.SGD(b.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(3):
        xs = [(torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)) for _ in range(2)]
        opt.zero_grad()
        with opt.no_sync():
            total, gs = penalized(a, *xs[0])
            total.backward()
        penalized(a, *xs[1])[0].backward()
        opt.step()
        ref.zero_grad()
        total, want = penalized(b, *xs[0])
        total.backward()
        penalized(b, *xs[1])[0].backward()
        ref.step()
        assert all(torch.equal(u, v) for u, v in zip(gs, want))
        for p, q in zip(a.parameters(), b.parameters()):
            assert ulps(p, q) <= 2, (p - q).abs().max()


def test_prescale_follows_a_new_gradient_accumulator(one_rank):
    """The prescale sits on each parameter's gradient accumulator, which osp holds: unfreezing a parameter
    frozen after wrapping keeps it, so its gradient is still prescaled (and the update is torch.optim's)."""
    a, b = mlp(), mlp()
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1), a.named_parameters(), sync=osp.BSP(),
                                   gradient_predivide_factor=4)
    ref = torch.optim.SGD(b.parameters(), lr=0.1)
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    for m in (a, b):
        m[0].weight.requires_grad_(False)
        m[0].weight.requires_grad_(True)
    for m, o in ((a, opt), (b, ref)):
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


@pytest.mark.multiproc
def test_op_sum_gradient_penalty_on_two_ranks(tmp_path):
    """Two real ranks, op="sum", a gradient penalty in the loop: autograd.grad returns the true gradient, and
    the update is the sum of both ranks' gradients (BSP; HSP with the fast rank's extra micro-batches: size
    times the mean of every micro-batch's), replayed with plain torch.optim. Also nn.Embedding(max_norm=...)
    under OSP and DSync: refused on both ranks at the same step. And a model channels_last on one rank only:
    refused at construction on both. And model.state_dict() while corrections are in flight: warned once."""
    proc = launch.run("spawn", 2, [WORKER, str(tmp_path)], timeout=180)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    names = {n for r in results for n in r["checks"]}
    for want in ("bsp_sum/autograd_grad_is_the_true_gradient", "bsp_sum/update_is_the_sum_of_the_ranks_gradients",
                 "hsp_sum/autograd_grad_is_the_true_gradient",
                 "hsp_sum/update_is_size_times_the_mean_of_every_micro_batch", "hsp_sum/the_fast_rank_ran_extras",
                 "embedding_max_norm/osp_refused", "embedding_max_norm/dsync_refused",
                 "embedding_max_norm/osp_same_step_everywhere", "embedding_max_norm/dsync_same_step_everywhere",
                 "layout/disagreement_refused_everywhere", "layout/channels_last_replicas_equal",
                 "state_dict/osp_warned_once_at_the_users_line", "state_dict/dsync_warned_once_at_the_users_line",
                 "state_dict/bsp_not_warned", "state_dict/osp_not_warned_after_flush"):
        assert want in names, sorted(names)


# -- 2. an optimizer whose step() needs a closure ------------------------------------------------------------

class NeedsClosure(torch.optim.SGD):
    """Not LBFGS by name: the refusal reads the signature."""

    def step(self, closure):
        return super().step(closure)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25, block_size=8), osp.DSync(delay=1), osp.HSP()],
                         ids=repr)
@pytest.mark.parametrize("make", [lambda ps: torch.optim.LBFGS(ps), lambda ps: NeedsClosure(ps, lr=0.1)],
                         ids=["lbfgs", "subclass"])
def test_optimizer_whose_step_needs_a_closure_is_refused_at_construction(one_rank, sync, make):
    model = mlp()
    inner = make(model.parameters())
    name = type(inner).__name__
    with pytest.raises(ValueError, match=rf"osp: {name}\.step\(\) requires 'closure' \(expected an optimizer whose "
                                         r"step\(\) runs without arguments\).*steps the wrapped optimizer itself, and "
                                         r"its exact corrections step it again.*no closure.*Use an optimizer whose "
                                         r"step\(\) needs no closure.*hvd\.DistributedOptimizer / "
                                         r"DistributedDataParallel for LBFGS"):
        osp.DistributedOptimizer(inner, model.named_parameters(), sync=sync)


# -- 3. channels_last parameters keep their strides ----------------------------------------------------------

def convnet():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU(), torch.nn.Conv2d(8, 4, 3),
                               torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 5)).to(memory_format=torch.channels_last)


def is_cl(t):
    return t.dim() != 4 or t.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("sync", [osp.BSP(), osp.OSP(critical=0.25, block_size=16)], ids=repr)
@pytest.mark.parametrize("make", [lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
                                  lambda ps: torch.optim.Adam(ps, lr=0.01),
                                  lambda ps: torch.optim.RMSprop(ps, lr=0.01)], ids=["sgd", "adam", "rmsprop"])
def test_channels_last_parameters_keep_their_layout(one_rank, sync, make):
    """A channels_last conv net wrapped under BSP and OSP: the weights stay channels_last views of the flat
    buffer, their gradients channels_last aliases of the flat gradient (accumulated in place by backward),
    and training equals plain torch.optim within 2 ulps per step (the one-rank oracle)."""
    a, b = convnet(), convnet()
    assert not a[0].weight.is_contiguous()
    opt = osp.DistributedOptimizer(make(a.parameters()), a.named_parameters(), sync=sync)
    ref = make(b.parameters())
    assert all(is_cl(p) for p in a.parameters()), [p.stride() for p in a.parameters()]
    g = torch.Generator().manual_seed(3)
    for step in range(5):
        x = torch.randn(4, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
        y = torch.randint(0, 5, (4,), generator=g)
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad(set_to_none=False)
            F.cross_entropy(m(x), y).backward()
            if o is opt:
                for fg in opt.groups:
                    for p, alias in zip(fg.params, fg.grad_views):
                        assert p.grad is alias and is_cl(p.grad), (p.grad.stride(), p.stride())
                        assert p.grad.stride() == p.stride()
            o.step()
        if step % 2:
            opt.flush()
            for p, q in zip(a.parameters(), b.parameters()):
                assert ulps(p, q) == 0, f"step {step}: {(p - q).abs().max():.3g}"
    opt.flush()
    for fg in opt.groups:
        for i, p in enumerate(fg.params):
            assert is_cl(p) and p.data_ptr() == fg.view(fg.param, i).data_ptr()
    for p, q in zip(a.parameters(), b.parameters()):
        assert ulps(p, q) == 0, (p - q).abs().max()  # bitwise: the kernels are torch.optim's arithmetic


def test_transposed_parameter_keeps_its_strides_and_a_state_dict_round_trip(one_rank):
    """Any dense layout is kept (a transposed weight), and state_dict / load_state_dict copy values, not
    memory order."""
    lin = torch.nn.Linear(5, 3)
    lin.weight = torch.nn.Parameter(lin.weight.detach().t().contiguous().t())
    stride = lin.weight.stride()
    before = lin.weight.detach().clone()
    opt = osp.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), lin.named_parameters(), sync=osp.BSP())
    assert lin.weight.stride() == stride == (1, 3) and torch.equal(lin.weight, before)
    lin(torch.randn(2, 5)).sum().backward()
    assert lin.weight.grad.stride() == stride
    opt.step()
    sd = {k: v.clone() for k, v in lin.state_dict().items()}
    lin.load_state_dict(sd)
    assert torch.equal(lin.weight, sd["weight"]) and lin.weight.stride() == stride


def test_parameter_whose_elements_share_memory_is_refused(one_rank):
    lin = torch.nn.Linear(3, 4)
    lin.weight = torch.nn.Parameter(torch.randn(3).expand(4, 3))
    with pytest.raises(ValueError, match=r"parameter 'weight' has elements that share memory \(shape \[4, 3\], "
                                         r"strides \[0, 1\].*expected a parameter whose elements are distinct.*"
                                         r"\.contiguous\(\)"):
        osp.DistributedOptimizer(torch.optim.SGD(lin.parameters(), lr=0.1), lin.named_parameters())


# -- 4. nn.Embedding(max_norm=...): an in-place edit inside the forward --------------------------------------

def embedding_steps(emb, opt, n, seed=4):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        ids = torch.randint(0, 12, (6,), generator=g)
        opt.zero_grad()
        emb(ids).pow(2).sum().backward()
        opt.step()


@pytest.mark.parametrize("sync", [osp.BSP(), osp.HSP(max_extra=2)], ids=repr)
def test_embedding_max_norm_trains_under_bsp_and_hsp(one_rank, sync):
    """Nothing is pending between steps: the renormalization in the forward acts on exact weights, as with
    torch.optim (bitwise on one rank)."""
    torch.manual_seed(0)
    a = torch.nn.Embedding(12, 4, max_norm=1.0)
    b = torch.nn.Embedding(12, 4, max_norm=1.0)
    b.load_state_dict(a.state_dict())
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.5, momentum=0.9), a.named_parameters(),
                                   sync=sync)
    embedding_steps(a, opt, 6)
    embedding_steps(b, torch.optim.SGD(b.parameters(), lr=0.5, momentum=0.9), 6)
    opt.flush()
    assert torch.equal(a.weight, b.weight)
    assert a.weight.detach().norm(dim=1).max() > 0  # it trained


@pytest.mark.parametrize("sync", [osp.OSP(critical=0.25, block_size=8), osp.DSync(delay=1), osp.DSync(delay=2)],
                         ids=repr)
def test_embedding_max_norm_is_refused_under_osp_and_dsync(one_rank, sync):
    """The forward renormalizes rows of the provisional weights in place, which the exact correction would
    overwrite, and flush() cannot run inside a forward: refused at the first step where a correction is
    pending, naming the in-forward edit and the alternatives."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(12, 4, max_norm=1.0)
    opt = osp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), emb.named_parameters(), sync=sync)
    with pytest.raises(RuntimeError, match=r"parameters were changed between steps.*inside the forward.*"
                                           r"an in-forward in-place edit \(nn\.Embedding\(max_norm=\.\.\.\).*cannot be "
                                           r"corrected exactly under osp\.OSP\(\) or osp\.DSync\(\)\. Use osp\.BSP\(\) "
                                           r"or osp\.HSP\(\).*or drop max_norm and renormalize after opt\.flush\(\)"
                                           r".*the same rows on every rank: .*torch\.embedding_renorm_\("):
        embedding_steps(emb, opt, 4)


# -- osp's warnings name the user's line, not osp's or torch's own ------------------------------------------------

@pytest.mark.parametrize("sync", [osp.OSP(critical=0.25, block_size=8), osp.HSP()], ids=repr)
def test_the_clip_warning_names_the_users_line(one_rank, sync):
    """clip_grad_norm_ on .grad under OSP/HSP (each rank's own gradient): the warning points at the step() call
    in this file (it pointed at torch/optim/optimizer.py, torch's step wrapper)."""
    import inspect
    import warnings
    m = mlp()
    opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), sync=sync)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            F.mse_loss(m(torch.randn(4, 6)), torch.randn(4, 3)).backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
            line = inspect.currentframe().f_lineno + 1
            opt.step()
    opt.flush()
    edits = [w for w in caught if "changed in place" in str(w.message)]
    assert len(edits) == 1 and (edits[0].filename, edits[0].lineno) == (__file__, line), \
        [(w.filename, w.lineno) for w in edits]
