"""Replicas checked at runtime (tests/test_replicas.py; ``check_replicas``, python/osp/replicas.py), on 2 ranks.

- A forgotten broadcast: each rank builds its model from its own seed; the first ``step()`` raises the same
  RuntimeError on every rank, naming the first parameter and the fix, under every mode; before it nothing
  was applied. With ``broadcast_parameters=True`` the same job trains, replicas bitwise equal.
- A planted divergence: rank 1 skips one update (BSP, HSP: the wrapped optimizer's step does nothing once) or
  takes one step at another learning rate (OSP, DSync: a scheduler stepped on one rank) at step 7; with
  ``check_replicas=4`` every rank raises at step 9 (the next check), naming the parameter; with
  ``check_replicas=0`` nothing is checked and the run ends apart (what the check is for).
- A balanced run with a check every step raises nothing and counts its checks.
argv: backend, outdir, modes (comma-separated)."""
import sys

import torch
from ranks import check, expect_error, run_all, save, shutdown, start

import osp
import osp.modes.bsp as bsp_mode
import osp.modes.hsp as hsp_mode

backend, outdir, modes = sys.argv[1], sys.argv[2], sys.argv[3].split(",")
comm = start(backend)
rank, size = comm.rank, comm.size
SYNCS = {"bsp": lambda: osp.BSP(), "osp-0.25": lambda: osp.OSP(critical=0.25, block_size=8),
         "dsync-2": lambda: osp.DSync(delay=2), "hsp": lambda: osp.HSP(max_extra=0),
         "hsp-osp": lambda: osp.HSP(max_extra=0, sync=osp.OSP(0.25, block_size=8))}


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def train_step(m, opt, k):
    opt.zero_grad()
    g = torch.Generator().manual_seed(1000 * rank + k)
    x, y = torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)
    torch.nn.functional.mse_loss(m(x), y).backward()
    opt.step()


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def equal_everywhere(t):
    return all(torch.equal(t, o) for o in comm.allgather_object(t))


def forgotten_broadcast(name):
    def run():
        m = model(seed=rank)  # the bug: every rank its own initial weights
        before = flat(m).clone()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=60)
        expect_error(f"{name}/forgotten_broadcast_raises", RuntimeError,
                     r"replicas differ at the first step\(\): parameter '0\.weight'.*broadcast_parameters",
                     lambda: train_step(m, opt, 0))
        check(f"{name}/nothing_applied", torch.equal(flat(m), before))
        # the opt-in: rank 0's weights, then training keeps the replicas equal
        m = model(seed=rank)
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=60, broadcast_parameters=True,
                                       check_replicas=1)
        check(f"{name}/broadcast_from_0", torch.equal(flat(m), flat(model(seed=0))))
        for k in range(5):
            train_step(m, opt, k)
        opt.flush()
        check(f"{name}/trains_equal", equal_everywhere(flat(m)))
        check(f"{name}/checked_every_step", opt.stats()["replica_checks"] >= 5, opt.stats()["replica_checks"])
    run.__name__ = f"{name}_forgotten_broadcast"
    return run


def planted(name, every):
    """Rank 1 goes astray at step 7 (index 6); with a check every 4 steps the check of step 9 names it."""
    def run():
        m = model()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[name](), backend=comm, timeout=60, check_replicas=every)
        where = bsp_mode if name == "bsp" else hsp_mode
        real = where.unhooked_step
        raised = None
        try:
            for k in range(12):
                skip = rank == 1 and k == 6 and name in ("bsp", "hsp")
                if skip:
                    where.unhooked_step = lambda o: None
                # the others: a learning rate changed on rank 1 alone for one step (a scheduler stepped there only)
                opt.param_groups[0]["lr"] = 0.05 if rank == 1 and k == 6 and not skip else 0.1
                try:
                    train_step(m, opt, k)
                except RuntimeError as e:
                    raised = (k, str(e))
                    break
                finally:
                    where.unhooked_step = real
            if raised is None:
                opt.flush()
        except RuntimeError as e:
            raised = ("flush", str(e))
        tag = f"{name}/planted/every{every}"
        if every:
            ok = raised is not None and raised[0] == 8 and "replicas differ at step 9" in raised[1] and \
                "parameter '0.weight'" in raised[1]
            check(f"{tag}/named_within_one_interval", ok, raised)
        else:
            check(f"{tag}/unchecked_ends_apart", raised is None and not equal_everywhere(flat(m)), raised)
    run.__name__ = f"{name}_planted_{every}"
    return run


scenarios = []
for n in modes:
    scenarios += [forgotten_broadcast(n), planted(n, 4), planted(n, 0)]
run_all(scenarios)
save(outdir)
shutdown(backend)
