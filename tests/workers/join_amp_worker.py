"""``opt.join()`` with a ``torch.amp.GradScaler`` (tests/test_join.py): rank 0 runs out of data 3 steps before
rank 1 and joins. Its shadow steps in join() must go through its scaler as rank 1's steps do (join() calls
the step itself): its scale and growth tracker move with rank 1's (growth_interval=2: the scale changes while
it shadows), it unscales the average alike, so the replicas are equal wherever they are exact, and after join()
every scaler holds the last joiner's state. Training on with the scaler (the scale changing again) keeps the
replicas bitwise equal. A rank that never stepped through a scaler before join() gets the same error on every
rank. argv: backend, outdir, modes (comma-separated).
"""
import sys

import torch
from join_data import batch, flat, model
from ranks import check, expect_error, run_all, save, shutdown, start

import osp

backend, outdir, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
comm = start(backend, timeout_s=30)
rank, size = comm.rank, comm.size
SYNCS = {"bsp": lambda: osp.BSP(), "osp-0.5": lambda: osp.OSP(critical=0.5, block_size=8),
         "dsync-2": lambda: osp.DSync(delay=2), "hsp": lambda: osp.HSP(max_extra=0)}
BATCHES = 4  # rank 0's; every later rank has 3 more
AFTER = 4  # steps every rank trains after join(): the scale doubles twice in them (growth_interval=2)


def scaler_state(s):
    return {k: v for k, v in s.state_dict().items()}


def scenario(name):
    def run():
        m = model()
        exact = []  # the parameters wherever the replicas are exact: the joined rank's too (it unscales as the others)
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=30,
                                       on_synced=None if name in ("bsp", "hsp") else lambda o: exact.append(flat(m)))
        if name in ("bsp", "hsp"):  # exact after every step
            opt.register_step_post_hook(lambda *_: exact.append(flat(m)))
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)

        def train(k):
            opt.zero_grad()
            x, y = batch(rank, k)
            scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
            scaler.step(opt)
            scaler.update()

        for k in range(BATCHES + 3 * (rank > 0)):
            train(k)
        opt.join()
        seen = comm.allgather_object(exact)
        check(f"{name}/replicas_equal_while_joined", len(seen[0]) > BATCHES and all(
            len(s) == len(seen[0]) and all(torch.equal(a, b) for a, b in zip(s, seen[0])) for s in seen),
            [len(s) for s in seen])
        states = comm.allgather_object(scaler_state(scaler))
        check(f"{name}/scaler_equal_after_join", all(s == states[-1] for s in states), states)
        check(f"{name}/replicas_equal_after_join", all(torch.equal(flat(m), f) for f in comm.allgather_object(flat(m))))
        before = scaler.get_scale()
        for k in range(AFTER):
            train(100 + k)
        opt.flush()
        states = comm.allgather_object(scaler_state(scaler))
        check(f"{name}/scale_moved_after_join", scaler.get_scale() > before, (before, scaler.get_scale()))
        check(f"{name}/scaler_equal_after_training_on", all(s == states[0] for s in states), states)
        flats = comm.allgather_object(flat(m))
        check(f"{name}/replicas_equal_after_training_on", all(torch.equal(flats[0], f) for f in flats),
              max((flats[0] - f).abs().max().item() for f in flats))
    run.__name__ = name
    return run


def no_batch_no_scaler():
    """Rank 0 has no batch: it never stepped through a scaler, so its loss scale cannot be made rank 1's."""
    m = model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                   sync=osp.BSP(), backend=comm, timeout=30)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8, growth_interval=2)
    for k in range(2 * rank):
        opt.zero_grad()
        x, y = batch(rank, k)
        scaler.scale(torch.nn.functional.mse_loss(m(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    expect_error("no_batch/same_error_on_every_rank", RuntimeError,
                 r"rank\(s\) \[1\] but none ever did on rank\(s\) \[0\]", opt.join)
    check("no_batch/replicas_equal", all(torch.equal(flat(m), f) for f in comm.allgather_object(flat(m))))


run_all([scenario(n) for n in modes if n != "no-batch"] + ([no_batch_no_scaler] if "no-batch" in modes else []))
save(outdir)
shutdown(backend)
