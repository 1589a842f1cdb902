"""osp.elastic.State on real ranks under horovodrun (argv: OUTDIR): for every mode, a commit holds exact
updates, a restore brings back the committed parameters, optimizer state and osp's own state (so the
steps redone after it reproduce the first attempt bitwise), and sync() makes a rank that starts
elsewhere equal to rank 0; under Horovod Elastic the parameter check runs in sync(), on every rank."""
import copy
import os
import sys

import torch
from ranks import check, expect_error, run_all, save, shutdown, start

import osp
import osp.elastic

OUT = sys.argv[1]
comm = start("horovod")
rank = comm.rank


def model_for(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 4))


def params(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])


def same_everywhere(t):
    return all(torch.equal(x, t) for x in comm.allgather_object(t))


def steps(model, opt, lo, hi):
    for t in range(lo, hi):
        g = torch.Generator().manual_seed(1000 * rank + t)  # each rank its own data
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()


def state_equal(a, b):
    if torch.is_tensor(a):
        return torch.is_tensor(b) and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(state_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(state_equal(x, y) for x, y in zip(a, b))
    return a == b


SYNCS = {"bsp": osp.BSP(), "osp": osp.OSP(critical=0.3, block_size=64), "dsync": osp.DSync(delay=2),
         "hsp": osp.HSP()}


def scenario(name):
    def run():
        model = model_for(seed=rank)  # ranks start different: sync() makes them rank 0's
        opt = osp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model.named_parameters(),
                                       sync=SYNCS[name])
        state = osp.elastic.State(model, opt, step=0)
        state.sync()
        check(f"{name}/sync_makes_replicas_equal", same_everywhere(params(model)))
        steps(model, opt, 0, 4)
        state.step = 4
        state.commit()
        check(f"{name}/commit_leaves_nothing_in_flight", not opt.in_flight)
        committed, committed_opt = params(model), copy.deepcopy(opt.state_dict())
        check(f"{name}/commit_replicas_equal", same_everywhere(committed))
        steps(model, opt, 4, 7)  # under OSP and DSync: work in flight now
        opt.flush()
        first = params(model)
        state.step = 7
        state.restore()  # what hvd.elastic.run does after a HorovodInternalError
        check(f"{name}/restore_brings_back_the_commit",
              torch.equal(params(model), committed) and state.step == 4 and not opt.in_flight)
        check(f"{name}/restore_brings_back_the_optimizer_state", state_equal(opt.state_dict(), committed_opt))
        state.reset()
        state.sync()
        steps(model, opt, 4, 7)
        opt.flush()
        check(f"{name}/steps_redone_equal_the_first_attempt", torch.equal(params(model), first),
              (params(model) - first).abs().max())
    run.__name__ = name
    return run


def deferred_check():
    """Under Horovod Elastic (HOROVOD_ELASTIC=1) the optimizer's constructor runs no collective (a rank may
    join while the others train); State.sync() checks the parameters on every rank instead."""
    os.environ["HOROVOD_ELASTIC"] = "1"
    try:
        model = model_for(0) if rank == 0 else torch.nn.Sequential(torch.nn.Linear(16, 47))
        opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       sync=osp.OSP())
        state = osp.elastic.State(model, opt)
        expect_error("sync_checks_the_parameters_on_every_rank", ValueError, "ranks disagree on the parameters",
                     state.sync)
    finally:
        del os.environ["HOROVOD_ELASTIC"]


run_all([scenario(n) for n in SYNCS] + [deferred_check])
save(OUT)
shutdown("horovod")
