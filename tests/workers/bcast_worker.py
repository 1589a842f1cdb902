"""Broadcasts of optimizer state (tests/test_broadcast.py): osp.broadcast_optimizer_state and the elastic
sync's broadcast_state move the state tensors in place, on each rank's own device, and a rank without
state (no step yet) gets root's. argv: backend, outdir, device ("cpu" or "cuda")."""
import sys

import torch
from ranks import check, run_all, save, shutdown, start

import osp
from osp.broadcast import broadcast_state

backend, outdir, device = sys.argv[1], sys.argv[2], sys.argv[3]
comm = start(backend)
rank = comm.rank
dev = torch.device(f"cuda:{rank % torch.cuda.device_count()}") if device == "cuda" else torch.device("cpu")


def model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3)).to(dev)


def local_steps(m, opt, n, seed):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        opt.zero_grad()
        x, y = torch.randn(4, 6, generator=g).to(dev), torch.randn(4, 3, generator=g).to(dev)
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()


def digest(opt):
    """The state and hyper-parameters by value, on the host."""
    sd = opt.state_dict()
    state = {k: {n: (v.cpu() if torch.is_tensor(v) else v) for n, v in s.items()} for k, s in sd["state"].items()}
    return state, [{k: v for k, v in g.items() if k != "params"} for g in sd["param_groups"]]


def same_as_root(name, opt):
    mine = digest(opt)
    root = comm.broadcast_object(mine, 0)
    def same(a, b):
        return torch.equal(a, b) if torch.is_tensor(b) else a == b

    ok = mine[1] == root[1] and mine[0].keys() == root[0].keys() and all(
        mine[0][k].keys() == root[0][k].keys() and all(same(mine[0][k][n], root[0][k][n]) for n in root[0][k])
        for k in root[0])
    check(name, ok, f"rank {rank} state differs from root's")


def on_own_device(name, opt):
    where = {t.device for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1}
    check(name, where == {dev}, f"state tensors on {where}, expected {dev}")


def plain():
    for oname, make in (("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
                        ("adam", lambda ps: torch.optim.Adam(ps, lr=0.01))):
        m = model()
        opt = make(m.parameters())
        if rank == 0:  # root has state and another learning rate; the others none yet
            local_steps(m, opt, 3, seed=7)
            opt.param_groups[0]["lr"] = 0.05
        osp.broadcast_optimizer_state(opt, 0, backend=comm)
        same_as_root(f"plain/{oname}/no_state_before", opt)
        on_own_device(f"plain/{oname}/device", opt)
        local_steps(m, opt, 2, seed=10 + rank)  # every rank has state of its own now, then root's again
        before = {id(t): t.data_ptr() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)}
        osp.broadcast_optimizer_state(opt, 0, backend=comm)
        same_as_root(f"plain/{oname}/with_state_before", opt)
        after = [t for s in opt.state.values() for t in s.values() if torch.is_tensor(t) and t.numel() > 1]
        check(f"plain/{oname}/in_place", all(before.get(id(t)) == t.data_ptr() for t in after),
              "a state tensor was replaced instead of overwritten")


def distributed():
    for sync in (osp.OSP(critical=0.5, block_size=8), osp.DSync(delay=2), osp.BSP()):
        m = model()
        opt = osp.DistributedOptimizer(torch.optim.Adam(m.parameters(), lr=0.01), m.named_parameters(), sync=sync,
                                       backend=comm)
        local_steps(m, opt, 3, seed=3)
        opt.flush()
        for p in opt.state:  # make the ranks' states differ, as a resumed rank's would
            opt.state[p]["exp_avg"].add_(float(rank))
        osp.broadcast_optimizer_state(opt, 0)
        same_as_root(f"osp/{sync.name}/state", opt.optimizer)
        on_own_device(f"osp/{sync.name}/device", opt)
        # the full state_dict (osp's own part too), as osp.elastic's sync sends it
        sd = broadcast_state(comm, opt.state_dict(), 0, dev, f"test.{sync.name}")
        opt.load_state_dict(sd)
        local_steps(m, opt, 2, seed=5)
        opt.flush()
        flat = torch.cat([p.detach().reshape(-1).cpu() for p in m.parameters()])
        check(f"osp/{sync.name}/replicas_equal_after", all(torch.equal(flat, f) for f in comm.allgather_object(flat)))


def buffers_like_ddp():
    """osp.broadcast_buffers(model) keeps BatchNorm's statistics as DDP(broadcast_buffers=True) does: root's
    before each training forward, then each rank's own batch. The BatchNorm comes first, so its statistics
    depend on the data alone and must equal DDP's bitwise on every rank."""
    def bn_model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.BatchNorm1d(6), torch.nn.Linear(6, 9), torch.nn.Tanh(),
                                   torch.nn.Linear(9, 3)).to(dev)

    def train(m, opt, seed=20):
        g = torch.Generator().manual_seed(seed + rank)  # each rank its own batches: statistics differ
        for _ in range(4):
            opt.zero_grad()
            x = (torch.randn(8, 6, generator=g) * (1 + rank)).to(dev)
            torch.nn.functional.mse_loss(m(x), torch.zeros(8, 3, device=dev)).backward()
            opt.step()

    ddp_model = bn_model()
    ddp = torch.nn.parallel.DistributedDataParallel(ddp_model, broadcast_buffers=True)
    train(ddp, torch.optim.SGD(ddp.parameters(), lr=0.1))
    m = bn_model()
    handle = osp.broadcast_buffers(m, backend=comm)
    train(m, osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                      sync=osp.BSP(), backend=comm))
    handle.remove()
    ours, theirs = dict(m.named_buffers()), dict(ddp_model.named_buffers())
    check("buffers/like_ddp", ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours),
          {k: (ours[k] - theirs[k]).abs().max().item() for k in ours if ours[k].is_floating_point()})
    # the last forward updated each rank's statistics from its own batch; eval forwards leave them alone
    mine = torch.cat([b.float().reshape(-1).cpu() for b in m.buffers()])
    check("buffers/differ_after_last_forward", not all(torch.equal(mine, o) for o in comm.allgather_object(mine)))
    with torch.no_grad():
        m.eval()(torch.randn(2, 6).to(dev))
    osp.sync_buffers(m, backend=comm)
    mine = torch.cat([b.float().reshape(-1).cpu() for b in m.buffers()])
    check("buffers/sync_buffers_equal", all(torch.equal(mine, o) for o in comm.allgather_object(mine)))


run_all([plain, distributed, buffers_like_ddp])
save(outdir)
shutdown(backend)
