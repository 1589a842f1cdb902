"""``osp.broadcast_buffers(model)`` with HSP's extra micro-batches (tests/test_broadcast.py): rank 1 is slow
(it sleeps between its backward and its step), so rank 0 runs extras inside ``opt.step(closure)``. Their
forwards run on rank 0 alone: the hook must not broadcast there (it would meet rank 1's gradient sum). The
run must finish quickly, with the parameters bitwise equal after every step and the buffers (BatchNorm's)
bitwise equal once a regular forward broadcast them from root. argv: backend, outdir."""
import sys
import time

import torch
from ranks import check, run_all, save, shutdown, start

import osp

backend, outdir = sys.argv[1], sys.argv[2]
comm = start(backend, timeout_s=20)
rank, size = comm.rank, comm.size
STEPS, SLOW = 6, 0.1


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                               torch.nn.Linear(16, 3))


def batch(r, step, j):
    g = torch.Generator().manual_seed(10000 * r + 100 * step + j)
    return torch.randn(8, 6, generator=g), torch.randn(8, 3, generator=g)


def flat(ts):
    return torch.cat([t.detach().reshape(-1).double() for t in ts])


def hsp_with_buffers():
    m = model()
    osp.broadcast_buffers(m, backend=comm)
    opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                   sync=osp.HSP(max_extra=2), backend=comm, timeout=20)
    t0 = time.perf_counter()
    equal = True
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(rank, step, 0)
        torch.nn.functional.mse_loss(m(x), y).backward()
        if rank == 1:
            time.sleep(SLOW)
        ids = iter(range(1, 100))

        def closure(step=step, ids=ids):
            x, y = batch(rank, step, next(ids))
            loss = torch.nn.functional.mse_loss(m(x), y)
            loss.backward()
            return loss

        opt.step(closure)
        flats = comm.allgather_object(flat(m.parameters()))
        equal &= all(torch.equal(flats[0], f) for f in flats)
    check("params_equal_every_step", equal)
    extras = comm.allgather_object(opt.stats()["hsp"]["extras"])
    check("fast_rank_ran_extras", extras[0] > 0 and extras[1] == 0, extras)
    # a regular forward (the same batch on every rank) broadcasts root's buffers first: equal after it
    m(batch(0, 99, 0)[0])
    bufs = comm.allgather_object(flat(m.buffers()))
    check("buffers_equal_after_a_regular_forward", all(torch.equal(bufs[0], b) for b in bufs),
          max((bufs[0] - b).abs().max().item() for b in bufs))
    elapsed = time.perf_counter() - t0
    check("quick", elapsed < STEPS * SLOW + 10, elapsed)


run_all([hsp_with_buffers])
save(outdir)
shutdown(backend)
