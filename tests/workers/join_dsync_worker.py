"""``opt.join()`` under DSync, whose per-step records are read ``delay`` steps late (tests/test_join.py). Rank 0
has 3 batches, rank 1 has 8 and is slow (it sleeps before each step): with ``delay="auto"`` rank 0's averages
arrive late and it takes a longer delay than rank 1 (3 against 1), so the two read the record that says every
rank joined at different steps. Every rank must still return from join() at the same step, with bitwise equal
replicas whose updates are the exact averages (a replay of the recorded gradients with torch.optim), and train
on. argv: backend, outdir, modes (comma-separated)."""
import sys
import time

import torch
from join_data import batch, flat, model, train
from ranks import check, run_all, save, shutdown, start

import osp

backend, outdir, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
comm = start(backend, timeout_s=30)
rank, size = comm.rank, comm.size
SYNCS = {"dsync-auto": lambda: osp.DSync(delay="auto", max_delay=3), "dsync-2": lambda: osp.DSync(delay=2),
         "hsp-dsync-auto": lambda: osp.HSP(max_extra=0, sync=osp.DSync(delay="auto", max_delay=3)),
         "hsp-dsync-2": lambda: osp.HSP(max_extra=0, sync=osp.DSync(delay=2))}
SLOW = 0.15  # seconds rank 1 sleeps before each of its steps (in the first round, its shadow steps too): well above
# a loaded host's stalls, which at 50 ms could raise rank 1's own delay to rank 0's and the two read alike


def batches(r):
    return 3 + 5 * r


def replay(recorded, hsp):
    """torch.optim on one model: at step k the sum of the gradients the ranks with data recorded, divided by
    the number of ranks (a joined rank counts as zeros); under HSP by the number of ranks with data (a joined
    rank adds no micro-batch)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
    for k in range(batches(size - 1)):
        gs = [recorded[r][k] for r in range(size) if k < batches(r)]
        for i, p in enumerate(m.parameters()):
            p.grad = sum(g[i] for g in gs) / (len(gs) if hsp else size)
        opt.step()
    return flat(m)


def scenario(name):
    def run():
        m = model()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=30)
        # rank 1 is slow at every step, its shadow steps in join() too (a step hook runs in every step())
        slow = opt.register_step_pre_hook(lambda *_: time.sleep(SLOW)) if rank == 1 else None
        mine = train(m, opt, rank, batches(rank))
        opt.join()
        if slow is not None:
            slow.remove()
        steps = comm.allgather_object(len(opt.stats()["history"]))
        check(f"{name}/same_steps", len(set(steps)) == 1, steps)
        flats = comm.allgather_object(flat(m))
        check(f"{name}/replicas_equal", all(torch.equal(flats[0], f) for f in flats))
        want = replay(comm.allgather_object(mine), name.startswith("hsp"))
        check(f"{name}/equals_replay", torch.allclose(flat(m), want, rtol=1e-5, atol=1e-6),
              (flat(m) - want).abs().max().item())
        if name == "dsync-auto":
            # what makes the case: the ranks read the record of the step where every rank had joined (rank 1's
            # first shadow step) at different steps, each at its own delay
            delays = comm.allgather_object([h["delay"] for h in opt.stats()["history"]])
            t = batches(size - 1)
            read = [next(T for T in range(t, len(d)) if T - t >= d[T]) for d in delays]
            check(f"{name}/read_at_different_steps", len(set(read)) > 1, (read, delays))
        # trains on: a few steps on every rank, then a second uneven round (rank 1 out of data first)
        for k in range(3):
            opt.zero_grad()
            x, y = batch(rank, 50 + k)
            torch.nn.functional.mse_loss(m(x), y).backward()
            opt.step()
        for k in range(2 * (1 - rank)):
            opt.zero_grad()
            x, y = batch(rank, 60 + k)
            torch.nn.functional.mse_loss(m(x), y).backward()
            if rank == 0:
                time.sleep(SLOW)
            opt.step()
        opt.join()
        steps = comm.allgather_object(len(opt.stats()["history"]))
        flats = comm.allgather_object(flat(m))
        check(f"{name}/trains_after", len(set(steps)) == 1 and all(torch.equal(flats[0], f) for f in flats), steps)
    run.__name__ = name
    return run


run_all([scenario(n) for n in modes])
save(outdir)
shutdown(backend)
