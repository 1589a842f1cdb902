"""Uneven data (tests/test_join.py): rank r has 2 + 2r batches, then calls ``opt.join()``. Every rank must
return from join() at the same step, with the replicas bitwise equal, and under BSP and OSP (exact after
its corrections) with the parameters a replay in this process gives: at each step the sum of the
gradients of the ranks that still had data, divided by the number of ranks (a joined rank counts as
zeros, as DDP's Join and Horovod's join do). Under HSP a joined rank adds no micro-batch, so the mean
is over the others' micro-batches. argv: backend, outdir, modes (comma-separated)."""
import sys

import torch
from join_data import batch, model, train
from ranks import check, run_all, save, shutdown, start

import osp

backend, outdir, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
comm = start(backend)
rank, size = comm.rank, comm.size
SYNCS = {"bsp": lambda: osp.BSP(), "osp-0.5": lambda: osp.OSP(critical=0.5, block_size=8),
         "dsync-2": lambda: osp.DSync(delay=2), "hsp": lambda: osp.HSP(max_extra=0)}


def batches(r):
    return 2 + 2 * r


def grads(m, r, k):
    m.zero_grad()
    x, y = batch(r, k)
    torch.nn.functional.mse_loss(m(x), y).backward()
    return [p.grad.clone() for p in m.parameters()]


def replay(hsp: bool, recorded=None):
    """torch.optim on one model: each step's gradient from the ranks that still have data, recomputed here
    (BSP, HSP: their gradients are taken at the replicas' weights, which equal the replay's), or as each
    rank ``recorded`` them (OSP: taken at weights with a local estimate for the deferred blocks)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for k in range(batches(size - 1)):
        active = [r for r in range(size) if k < batches(r)]
        gs = [grads(m, r, k) if recorded is None else recorded[r][k] for r in active]
        for i, p in enumerate(m.parameters()):
            p.grad = sum(g[i] for g in gs) / (len(active) if hsp else size)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def scenario(name):
    def run():
        m = model()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=60)
        mine = train(m, opt, rank, batches(rank))
        opt.join()
        steps = len(opt.stats()["history"])
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        check(f"{name}/replicas_equal", all(torch.equal(flat, f) for f in comm.allgather_object(flat)))
        check(f"{name}/same_steps", len(set(comm.allgather_object(steps))) == 1, comm.allgather_object(steps))
        if name != "dsync-2":  # DSync applies each average later: its own trajectory
            want = replay(name == "hsp", comm.allgather_object(mine) if name.startswith("osp") else None)
            check(f"{name}/equals_replay", torch.allclose(flat, want, rtol=1e-5, atol=1e-6),
                  (flat - want).abs().max().item())
        # after join() the optimizer trains on as before: one step on every rank, and a second uneven round
        # right after it (a count left from the first join() must not end the second early)
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(batch(rank, 99)[0]), batch(rank, 99)[1]).backward()
        opt.step()
        for k in range(rank):
            opt.zero_grad()
            torch.nn.functional.mse_loss(m(batch(rank, 100 + k)[0]), batch(rank, 100 + k)[1]).backward()
            opt.step()
        opt.join()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        check(f"{name}/trains_after", all(torch.equal(flat, f) for f in comm.allgather_object(flat)))
    run.__name__ = name
    return run


def with_scheduler(name):
    """A learning-rate scheduler stepped every batch: a joined rank's stands still while the others' move,
    so its own updates during join() differ; it ends with the last joiner's parameters and state."""
    def run():
        m = model()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=60)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for k in range(batches(rank)):
            opt.zero_grad()
            x, y = batch(rank, k)
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
            sched.step()
        opt.join()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        check(f"{name}/scheduler/replicas_equal", all(torch.equal(flat, f) for f in comm.allgather_object(flat)))
        lrs = comm.allgather_object(opt.param_groups[0]["lr"])
        check(f"{name}/scheduler/lr_of_the_last", len(set(lrs)) == 1 and lrs[0] == 0.1 * 0.5 ** batches(size - 1), lrs)
    run.__name__ = f"{name}_scheduler"
    return run


run_all([scenario(n) for n in modes] + [with_scheduler(n) for n in modes])
save(outdir)
shutdown(backend)
