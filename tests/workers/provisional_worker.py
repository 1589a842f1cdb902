"""Rank program for oracle 3 (tests/test_provisional.py): OSP's provisional step against pure PyTorch.

Usage: provisional_worker.py OUTDIR

Right after ``step()``, before its stage 2 lands, the next forward computes with the provisional
parameters. Each step this checks them against a reference built here from nothing but torch.optim and
the gradients every rank handed to ``step()`` (allgathered):

- the exact state before the step: plain torch.optim stepped with the averaged gradient of every
  earlier step (clipped by the norm of the average where the loop clips);
- the provisional gradient: the average on the step's critical blocks, this rank's own gradient on the
  deferred ones; where the loop clips, clipped by its own norm (the exact factor, from the norm of the
  average, comes with the correction);
- the critical blocks: in every bucket, the highest-scoring blocks by the scores this rank held when it
  planned the step, as many as the budget gives the buckets in all; the scores themselves are the l2
  norms of each block's latest averaged gradient that had landed by then (in a step, the last step's
  deferred averages land first, then the step's critical ones).

The model (tests/conformance.py's Net) has parameters of 91, 13, 169, 65 and 3 elements in blocks of 16
and buckets of ~100 elements: blocks straddle parameters and buckets.
"""
import copy
import os
import sys

import ranks
import torch

import osp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conformance as C  # noqa: E402

outdir = sys.argv[1]
comm = ranks.start("torch")
rank, size = comm.rank, comm.size
STEPS = 6
BS = C.BLOCK


def flat(tensors):
    return torch.cat([t.reshape(-1) for t in tensors])


def block_l2(v, nblocks):
    v = torch.nn.functional.pad(v.float() ** 2, (0, nblocks * BS - v.numel()))
    return v.view(nblocks, BS).sum(1)


def run(name, sync, make_opt, max_norm):
    model = C.Net(torch.float32)
    ref = C.Net(torch.float32)  # the exact trajectory, plain torch.optim
    ref_opt = make_opt(list(ref.parameters()))
    opt = osp.DistributedOptimizer(make_opt(list(model.parameters())), model.named_parameters(), sync=sync,
                                   backend="torch", timeout=60)
    params = [p for p in model.parameters()]
    used = [n != "unused" for n, _ in model.named_parameters()]
    fg = opt.groups[0]
    assert [id(p) for p in fg.params] == [id(p) for p in params], "one flat group, in model order"
    nb = fg.nblocks
    scores_ref = None  # the reference scores, as of the last landed averages
    pending = None  # (mask, avg) of the last step's deferred blocks, landing in this step
    env = C.Env(C.Case("bsp", "plain", "sgd"), wrapped=False, rank=rank)  # for its data only
    for t in range(STEPS):
        held = None if opt.mode.split.scores is None else opt.mode.split.scores.clone()
        opt.zero_grad()
        x, y = env.data(t)
        ((model(x).float() - y) ** 2).mean().backward()
        own = flat([p.grad if p.grad is not None else torch.zeros_like(p) for p in params]).double()
        every = comm.allgather_object(own)
        avg = sum(every) / size
        if max_norm is not None:
            opt.clip_grad_norm_(max_norm)
        opt.step()
        mask = opt.mode.stage2.pending[0].mask.clone() if opt.mode.stage2.pending else torch.ones(nb, dtype=torch.bool)
        # the critical blocks: the top scores of each bucket, as many in all as the budget gives
        if held is not None:
            k_total = 0
            for (_, b0, b1) in opt.mode.split.geo:
                m, s = mask[b0:b1], held[b0:b1]
                k_total += int(m.sum())
                top = torch.zeros_like(m)
                top[torch.sort(s, descending=True, stable=True).indices[:int(m.sum())]] = True
                if not torch.equal(m, top):
                    return False, (f"step {t}: bucket blocks {b0}-{b1} critical {m.tolist()}, "
                                   f"top by score {top.tolist()}")
            want = sum(opt.mode.split.budget.count(b1 - b0) for _, b0, b1 in opt.mode.split.geo)
            if k_total != want:
                return False, f"step {t}: {k_total} critical blocks, the budget gives {want}"
            if not torch.allclose(held, scores_ref, rtol=1e-5, atol=1e-12):
                bad = (~torch.isclose(held, scores_ref, rtol=1e-5, atol=1e-12)).nonzero().flatten().tolist()
                return False, (f"step {t}: scores of blocks {bad}: {held[bad].tolist()} != reference "
                               f"{scores_ref[bad].tolist()}")
        # the provisional gradient, from the exact state before this step
        emask = mask.repeat_interleave(BS)[:own.numel()]
        prov = torch.where(emask, avg, own)
        if max_norm is not None:  # provisionally by the norm of this provisional gradient
            prov = prov * min(1.0, max_norm / (float(prov.norm()) + 1e-6))
        trial = copy.deepcopy(ref)
        trial_opt = make_opt(list(trial.parameters()))
        trial_opt.load_state_dict(copy.deepcopy(ref_opt.state_dict()))  # load_state_dict keeps the tensors
        _set_grads(trial, prov, used)
        trial_opt.step()
        for i, (a, b) in enumerate(zip(params, trial.parameters())):
            if not C.compare(a.detach(), b.detach(), t + 1)[1]:
                return False, (f"step {t}: provisional parameter {i}: max abs diff "
                               f"{(a.detach().double() - b.detach().double()).abs().max().item():.3g}")
        # the exact step, and the scores as the averages land
        _set_grads(ref, avg, used)
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        # in this step the last step's deferred averages landed first, then this step's critical ones
        scores_ref = torch.zeros(nb) if scores_ref is None else scores_ref
        if pending is not None:
            scores_ref = torch.where(~pending[0], block_l2(pending[1], nb), scores_ref)
        scores_ref = torch.where(mask, block_l2(avg, nb), scores_ref)
        pending = (mask, avg)
    opt.flush()
    for i, (a, b) in enumerate(zip(params, ref.parameters())):
        if not C.compare(a.detach(), b.detach(), STEPS)[1]:
            return False, f"after flush, parameter {i} differs from the exact trajectory"
    return True, ""


def _set_grads(model, vec, used):
    off = 0
    for p, u in zip(model.parameters(), used):
        n = p.numel()
        p.grad = vec[off:off + n].view_as(p).to(p.dtype).clone() if u else None
        off += n


SGD = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=1e-3)  # noqa: E731
ADAMW = lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4)  # noqa: E731
for name, sync, make_opt, max_norm in [
        ("osp-0.25/sgd", osp.OSP(0.25, block_size=BS, bucket_mb=C.BUCKET_MB), SGD, None),
        ("osp-0.25/sgd/clip", osp.OSP(0.25, block_size=BS, bucket_mb=C.BUCKET_MB), SGD, 0.05),
        ("osp-0.5/adamw", osp.OSP(0.5, block_size=BS, bucket_mb=C.BUCKET_MB), ADAMW, None),
        ("osp-0.1/adamw/clip", osp.OSP(0.1, block_size=BS, bucket_mb=C.BUCKET_MB), ADAMW, 0.05)]:
    ok, detail = run(name, sync, make_opt, max_norm)
    ranks.check(name, ok, detail)
ranks.save(outdir)
ranks.shutdown("torch")
