"""Rank program for tests/test_intersections.py: features that meet osp's own machinery, on real ranks.

- op="sum" and a gradient penalty: ``torch.autograd.grad`` inside the training loop returns the true
  gradient (the prescale acts on what accumulates into ``.grad`` only), and the update is the sum of the
  ranks' gradients (a replay with plain torch.optim); under BSP, and under HSP where the fast rank's extra
  micro-batches (``step(closure)``) are prescaled like its first;
- nn.Embedding(max_norm=...) under OSP and DSync: refused on every rank at the same step, with the message
  that names the in-forward edit and the alternatives.

argv: outdir. Ranks spawned by tests/launch.py (torch.distributed, Gloo).
"""
import functools
import sys
import time

import torch
import torch.nn.functional as F
from ranks import check, expect_error, run_all, save, shutdown, start

import osp

outdir = sys.argv[1]
comm = start("torch")
rank, size = comm.rank, comm.size
PENALTY = 0.1


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def batch(step, r, j=0):
    g = torch.Generator().manual_seed(1000 * step + 10 * r + j)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def penalized(model, x, y):
    """The loss plus a gradient-norm penalty (the gradient from torch.autograd.grad, create_graph=True); and
    that gradient."""
    loss = F.mse_loss(model(x), y)
    gs = torch.autograd.grad(loss, list(model.parameters()), create_graph=True)
    return loss + PENALTY * sum((g ** 2).sum() for g in gs), [g.detach().clone() for g in gs]


def truth(model, x, y):
    """What plain torch gives at ``model``'s weights (a copy, no hook of osp's): the autograd.grad result and
    the gradient of the penalized loss."""
    plain = mlp()
    plain.load_state_dict(model.state_dict())
    total, gs = penalized(plain, x, y)
    return gs, [g.detach() for g in torch.autograd.grad(total, list(plain.parameters()))]


def flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def replay(per_step, scale):
    """SGD with momentum on ``scale`` times the sum of the recorded gradients of every step."""
    ref = mlp()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for grads in per_step:
        for k, p in enumerate(ref.parameters()):
            p.grad = sum(g[k] for g in grads) * scale
        ropt.step()
    return flat(ref)


def sum_under_bsp():
    model = mlp()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), sync=osp.BSP(), backend=comm, op="sum", timeout=60)
    true_grad, mine = True, []
    for step in range(4):
        x, y = batch(step, rank)
        want_gs, want_total = truth(model, x, y)
        opt.zero_grad()
        total, gs = penalized(model, x, y)
        true_grad &= all(torch.equal(a, b) for a, b in zip(gs, want_gs))
        total.backward()
        mine.append(want_total)
        opt.step()
    check("bsp_sum/autograd_grad_is_the_true_gradient", true_grad)
    everyone = comm.allgather_object(mine)
    want = replay([[e[s] for e in everyone] for s in range(4)], 1.0)
    got = flat(model)
    check("bsp_sum/update_is_the_sum_of_the_ranks_gradients", torch.allclose(got, want, rtol=1e-6, atol=1e-7),
          f"max abs diff {float((got - want).abs().max()):.3g}")
    check("bsp_sum/replicas_equal", all(torch.equal(got, f) for f in comm.allgather_object(got)))


def sum_under_hsp():
    """The last rank is slow, so the first computes extra micro-batches in step(closure): each one's
    autograd.grad is the true gradient, and the update is size times the mean of every micro-batch's."""
    model = mlp()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                   model.named_parameters(), sync=osp.HSP(max_extra=3), backend=comm, op="sum",
                                   timeout=60)
    delay = 0.15 if rank == size - 1 else 0.03
    true_grad, mine, extras = [], [], 0

    def micro_batch(step, grads):
        """One micro-batch of ``step``: its penalized loss's backward; the true gradient into ``grads``."""
        time.sleep(delay)
        x, y = batch(step, rank, len(grads))
        want_gs, want_total = truth(model, x, y)
        total, gs = penalized(model, x, y)
        true_grad.append(all(torch.equal(a, b) for a, b in zip(gs, want_gs)))
        total.backward()
        grads.append(want_total)
        return total
    for step in range(4):
        opt.zero_grad()
        grads = []
        micro_batch(step, grads)
        opt.step(functools.partial(micro_batch, step, grads))
        extras += opt.last_step()["extras"]
        mine.append(grads)
    check("hsp_sum/autograd_grad_is_the_true_gradient", all(true_grad), true_grad)
    everyone = comm.allgather_object({"grads": mine, "extras": extras})
    check("hsp_sum/the_fast_rank_ran_extras", everyone[0]["extras"] > 0, [e["extras"] for e in everyone])
    steps = [[g for e in everyone for g in e["grads"][s]] for s in range(4)]
    ref = mlp()
    ropt = torch.optim.SGD(ref.parameters(), lr=0.05, momentum=0.9)
    for grads in steps:  # op=sum: size times HSP's mean over every micro-batch of every rank
        for k, p in enumerate(ref.parameters()):
            p.grad = sum(g[k] for g in grads) / len(grads) * size
        ropt.step()
    got, want = flat(model), flat(ref)
    check("hsp_sum/update_is_size_times_the_mean_of_every_micro_batch",
          torch.allclose(got, want, rtol=1e-5, atol=1e-6), f"max abs diff {float((got - want).abs().max()):.3g}")
    check("hsp_sum/replicas_equal", all(torch.equal(got, f) for f in comm.allgather_object(got)))


def train_embedding(emb, opt, at):
    for step in range(6):
        at.append(step)
        opt.zero_grad()
        # the same rows on every rank: each rank's forward renormalizes the rows it looks up, so other rows
        # would leave the replicas apart before any correction (under BSP and DDP too)
        emb(torch.tensor([1, 4, 7])).pow(2).sum().backward()
        opt.step()


def embedding_max_norm():
    """An in-forward in-place edit under OSP and DSync: refused on every rank, at the same step."""
    for name, sync in (("osp", lambda: osp.OSP(critical=0.25, block_size=8)), ("dsync", lambda: osp.DSync(delay=1))):
        torch.manual_seed(0)
        emb = torch.nn.Embedding(12, 4, max_norm=1.0)
        opt = osp.DistributedOptimizer(torch.optim.SGD(emb.parameters(), lr=0.5), emb.named_parameters(),
                                       sync=sync(), backend=comm, timeout=60)
        at = []
        expect_error(f"embedding_max_norm/{name}_refused", RuntimeError,
                     r"in-forward in-place edit \(nn\.Embedding\(max_norm=\.\.\.\).*cannot be corrected exactly "
                     r"under osp\.OSP\(\) or osp\.DSync\(\)\. Use osp\.BSP\(\) or osp\.HSP\(\)",
                     functools.partial(train_embedding, emb, opt, at))
        steps = comm.allgather_object(at[-1] if at else None)
        check(f"embedding_max_norm/{name}_same_step_everywhere", len(set(steps)) == 1 and steps[0] <= 3, steps)


def layouts_disagree():
    """A conv net channels_last on one rank and row-major on the other: the flat buffers would pair different
    elements, so every rank refuses at construction; alike, both wrap and train with equal replicas."""
    def net(channels_last):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.Linear(4 * 4 * 4, 2))
        return m.to(memory_format=torch.channels_last) if channels_last else m
    m = net(rank == 0)
    expect_error("layout/disagreement_refused_everywhere", ValueError,
                 r"ranks disagree on the memory layout of parameter '0\.weight' \(group 0\): rank 0 has strides "
                 r"\[27, 1, 9, 3\], rank 1 has row-major \(contiguous\) memory; expected the same on every rank",
                 lambda: osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                                  backend=comm, timeout=60))
    m = net(True)
    opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                   sync=osp.OSP(critical=0.25, block_size=16), backend=comm, timeout=60)
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x = torch.randn(2, 3, 6, 6, generator=g).to(memory_format=torch.channels_last)
        opt.zero_grad()
        F.cross_entropy(m(x), torch.tensor([0, 1])).backward()
        opt.step()
    opt.flush()
    got = flat(m)
    check("layout/channels_last_replicas_equal", m[0].weight.is_contiguous(memory_format=torch.channels_last)
          and all(torch.equal(got, f) for f in comm.allgather_object(got)))


def provisional_state_dict():
    """model.state_dict() between steps: under OSP and DSync (corrections in flight) the weights are provisional
    and differ across ranks: warned once, at this file's line, naming flush(); after flush(), and under BSP
    (exact between steps), not."""
    import warnings
    for name, sync, warned in (("osp", osp.OSP(critical=0.25, block_size=8), True), ("dsync", osp.DSync(delay=2), True),
                               ("bsp", osp.BSP(), False)):
        m = mlp()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(), sync=sync,
                                       backend=comm, timeout=60)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in range(3):
                x, y = batch(step, rank)
                opt.zero_grad()
                F.mse_loss(m(x), y).backward()
                opt.step()
                m.state_dict()
            mid = [w for w in caught if "provisional" in str(w.message)]
            opt.flush()
            after = len(caught)
            m.state_dict()
        check(f"state_dict/{name}_warned_once_at_the_users_line" if warned else f"state_dict/{name}_not_warned",
              (len(mid) == 1 and mid[0].filename == __file__ and "opt.flush()" in str(mid[0].message)) if warned
              else not mid, [(w.filename, str(w.message)[:80]) for w in caught])
        check(f"state_dict/{name}_not_warned_after_flush", len(caught) == after, len(caught) - after)


run_all([layouts_disagree, sum_under_bsp, sum_under_hsp, embedding_max_norm, provisional_state_dict])
save(outdir)
shutdown("torch")
