"""osp.elastic.State on real ranks under horovodrun (argv: OUTDIR): for every mode, a commit holds exact
updates, a restore brings back the committed parameters, optimizer state and osp's own state (so the
steps redone after it reproduce the first attempt bitwise), and sync() makes a rank that starts
elsewhere equal to rank 0; under Horovod Elastic the parameter check runs in sync(), on every rank. The same
with Horovod's own ``hvd.elastic.TorchState`` holding the optimizer (the one-line swap), and what stays refused.

argv ``--hosts-job LOGFILE MODE SCHEDULE``: Horovod's elastic training script instead (below, ``hosts_job``)."""
import copy
import json
import os
import sys
import time

import torch
from ranks import check, expect_error, run_all, save, shutdown, start

import osp
import osp.elastic


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


def torch_state_scenario(name):
    """The one-line swap under Horovod Elastic: the optimizer kept in Horovod's own ``hvd.elastic.TorchState``, as
    Horovod's examples and its elastic test script keep hvd.DistributedOptimizer. osp's handlers are in Horovod's
    handler registry (its public way in): TorchState's commit() saves the model first, then the optimizer, and the
    model's handler settles the optimizer first (every rank commits at the same point), so the commit holds exact
    parameters and state. After a failure (``hvd.elastic.run`` restores while it handles the HorovodInternalError)
    what was in flight belongs to the dead engine and is dropped, as osp.elastic.State drops it. TorchState tells
    the optimizer nothing of an engine restart: the optimizer rebuilds its mode for a new world at its next use
    (``follow_world``), as osp.elastic.State's reset() does. Horovod's elastic.run is simulated here: the same
    calls, in its order, on a healthy engine (an engine restarted into another world is simulated by the world
    the optimizer remembers)."""
    from horovod.common.exceptions import HorovodInternalError
    from horovod.torch.elastic import TorchState

    def run():
        model = model_for(seed=rank)  # ranks start different: sync() makes them rank 0's
        # DSync's optimizer is given a list of named parameters: osp then does not know the model, and TorchState's
        # commit saves it (provisional) before the optimizer flushes; the commit saves it again, exact
        named = list(model.named_parameters()) if name == "dsync" else model.named_parameters()
        opt = osp.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), named, sync=SYNCS[name])
        state = TorchState(model, opt, step=0)
        state.sync()
        check(f"torch_state/{name}/sync_makes_replicas_equal", same_everywhere(params(model)))
        check(f"torch_state/{name}/osp_handlers_hold_the_state",
              type(state._handlers["model"]).__name__ == "ModelHandler"
              and type(state._handlers["optimizer"]).__name__ == "OptimizerHandler"
              and state._reset_callbacks == [], (state._handlers, state._reset_callbacks))
        steps(model, opt, 0, 4)
        state.step = 4
        state.commit()  # osp: model.state_dict() inside commit() flushes first
        check(f"torch_state/{name}/commit_leaves_nothing_in_flight", not opt.in_flight)
        committed, committed_opt = params(model), copy.deepcopy(opt.state_dict())
        saved = torch.cat([v.reshape(-1) for v in state._handlers["model"]._saved_model_state.values()])
        check(f"torch_state/{name}/commit_holds_the_exact_replicas", torch.equal(saved, committed)
              and same_everywhere(saved))
        steps(model, opt, 4, 7)  # under OSP and DSync: work in flight now
        in_flight = opt.in_flight
        # what hvd.elastic.run does when a collective fails: restore the commit inside its handler
        try:
            raise HorovodInternalError("a peer died")
        except HorovodInternalError:
            state.restore()
        check(f"torch_state/{name}/restore_after_a_failure_brings_back_the_commit",
              torch.equal(params(model), committed) and state.step == 4 and not opt.in_flight
              and state_equal(opt.state_dict(), committed_opt), f"in flight before: {in_flight}")
        mode = opt.mode
        state.on_reset()  # then the engine restarts, and the reset callbacks run, and the state syncs
        state.sync()
        check(f"torch_state/{name}/reset_rebuilds_the_mode", opt.mode is not mode)
        steps(model, opt, 4, 7)
        opt.flush()
        first = params(model)
        # the same steps again from the same commit: bitwise the same
        try:
            raise HorovodInternalError("a peer died")
        except HorovodInternalError:
            state.restore()
        state.on_reset()
        state.sync()
        steps(model, opt, 4, 7)
        opt.flush()
        check(f"torch_state/{name}/steps_redone_equal_the_first_attempt", torch.equal(params(model), first)
              and same_everywhere(first), (params(model) - first).abs().max())
        # with work in flight, a load outside a restore stays refused (the same on every rank: the same steps),
        # and so does an engine reset (check_host_updates() raised outside commit(), which flushes): every rank
        # raises alike, naming osp.elastic.State, before any collective of the new engine
        steps(model, opt, 7, 8)
        if opt.in_flight:
            expect_error(f"torch_state/{name}/load_in_flight_refused", RuntimeError, r"call flush\(\) first",
                         lambda: opt.load_state_dict(committed_opt))
            world = opt._world
            opt._world = (world[0], world[1] + 1)  # the engine restarted into another world: the next use sees it
            expect_error(f"torch_state/{name}/reset_in_flight_refused", RuntimeError,
                         r"osp\.elastic\.State\(model, optimizer", lambda: steps(model, opt, 8, 9))
            opt._world = world
            opt.flush()
        else:
            check(f"torch_state/{name}/load_in_flight_refused", True)
            check(f"torch_state/{name}/reset_in_flight_refused", True)
    run.__name__ = f"torch_state_{name}"
    return run


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
        # a second failure before the next commit: the same commit again (the steps since the first restore
        # must not have changed it in place)
        state.restore()
        check(f"{name}/second_restore_brings_back_the_commit", torch.equal(params(model), committed)
              and state_equal(opt.state_dict(), committed_opt))
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


JOB_SYNCS = {"default": None, "bsp": osp.BSP(), "osp-0.25": osp.OSP(critical=0.25, block_size=2),
             "dsync-2": osp.DSync(delay=2)}


def hosts_job(logfile, mode, schedule, kill=None, batches=10, epochs=3, discovery_wait=30.0):
    """Horovod 0.28.1's elastic test script (test/integration/data/elastic_torch_main.py, which its
    test_hosts_added_and_removed runs), restated with the one-line swap: ``osp.DistributedOptimizer`` where it
    builds ``hvd.DistributedOptimizer`` (``mode`` "default": no sync= at all, as the swap is written), the state
    in Horovod's own ``hvd.elastic.TorchState``, a commit after every batch. At each epoch's end rank 0 logs the
    epoch, its host, rank and size, and (added) whether every rank holds the same parameters; where the
    schedule's hosts change for the next epoch it waits for Horovod's notice, as the original does. ``kill``:
    ``(epoch, batch, start_rank)``, that rank SIGKILLs itself there (the original's exit schedule, kill mode).
    Departs: osp's "osp-0.25" mode uses blocks of 2 elements, so that Horovod's 6-parameter model defers some;
    the notice is waited for up to 30 s, not 3 (the driver's discovery runs about once a second, then it starts
    the new worker and sends its message: on a loaded 2-core host that took longer than 3 s; a notice that comes
    returns at once)."""
    import signal

    import horovod.torch as hvd
    import torch.nn.functional as F

    hvd.init()
    data, target = torch.randn(32, 2), torch.randint(0, 2, (32,))
    lr = 0.001
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr * hvd.size()),
                                   named_parameters=model.named_parameters(), sync=JOB_SYNCS[mode])
    hostname = os.environ.get("HOROVOD_HOSTNAME")
    start_rank = int(os.environ.get("HOROVOD_RANK", 0))
    hosts_at = {epoch: hosts for epoch, hosts in schedule if epoch is not None}
    default_hosts = schedule[-1][1]

    @hvd.elastic.run
    def train(state):
        state.rendezvous += 1
        while state.epoch < epochs:
            print(f"epoch {state.epoch} batch {state.batch}", flush=True)
            while state.batch < batches:
                if kill is not None and (state.epoch, state.batch, start_rank) == tuple(kill):
                    os.kill(os.getpid(), signal.SIGKILL)
                opt.zero_grad()
                F.cross_entropy(model(data), target).backward()
                opt.step()
                state.batch += 1
                state.commits += 1
                state.commit()
            mine = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            alike = all(torch.equal(mine, t) for t in hvd.allgather_object(mine))
            if hvd.rank() == 0:
                with open(logfile, "a") as f:
                    f.write(json.dumps({"epoch": state.epoch, "batch": state.batch, "commits": state.commits,
                                        "hostname": hostname, "start_rank": start_rank, "rank": hvd.rank(),
                                        "size": hvd.size(), "rendezvous": state.rendezvous,
                                        "replicas_equal": alike}) + "\n")
                now, after = hosts_at.get(state.epoch, default_hosts), hosts_at.get(state.epoch + 1, default_hosts)
                if now != after:
                    print(f"host changes: {now} -> {after}", flush=True)
                    t0 = time.monotonic()
                    state._last_updated_timestamp = 0
                    while state._host_messages.empty():
                        if time.monotonic() - t0 > discovery_wait:
                            raise TimeoutError("no notice of the host change from Horovod's driver")
                        time.sleep(0.1)
            state.epoch += 1
            state.batch = 0
            state.commits += 1
            state.commit()

    def on_state_reset():
        for group in opt.param_groups:
            group["lr"] = lr * hvd.size()

    state = hvd.elastic.TorchState(model, opt, batch=0, epoch=0, commits=0, rendezvous=0)
    state.register_reset_callbacks([on_state_reset])
    restore = state.restore

    def restore_noted():
        print(f"restore with work in flight: {opt.in_flight}", flush=True)
        restore()

    state.restore = restore_noted
    train(state)


if sys.argv[1] == "--hosts-job":
    hosts_job(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), json.loads(sys.argv[5]) if len(sys.argv) > 5 else None)
else:
    OUT = sys.argv[1]
    comm = start("horovod")
    rank = comm.rank
    run_all([scenario(n) for n in SYNCS] + [torch_state_scenario(n) for n in SYNCS] + [deferred_check])
    save(OUT)
    shutdown("horovod")
