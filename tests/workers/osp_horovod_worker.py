"""osp.horovod on 2 ranks: every function a training script uses, against what Horovod returns (values computed
here from each rank's known inputs), the refusals, process sets, the optimizer (replicas, a rank outside its
process set), join, and the elastic state's commit and resume. Usage: osp_horovod_worker.py OUTDIR [launch]."""
import datetime
import os
import sys

import ranks
import torch
import torch.distributed as dist
from ranks import check, expect_error

import osp
import osp.horovod as hvd

out = sys.argv[1]
if os.environ.get("OSP_TEST_STORE"):  # spawned ranks: a file store (hvd.init() uses a group made already)
    dist.init_process_group("gloo", init_method="file://" + os.environ["OSP_TEST_STORE"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]),
                            timeout=datetime.timedelta(seconds=60))
expect_error("before_init/rank", ValueError, "has not been initialized", hvd.rank)
hvd.init()
hvd.init()  # again: nothing
torch.set_num_threads(1)
r, n = hvd.rank(), hvd.size()
ranks.results.update(rank=r, size=n)


def run():
    check("topology", (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()) == (r, n, 0, 1)
          and hvd.is_homogeneous(), (hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size()))
    check("built", hvd.gloo_built() is True and hvd.gloo_enabled() and hvd.mpi_enabled() is False
          and hvd.nccl_built() == 0 and hvd.mpi_built() == dist.is_mpi_available())

    # allreduce: each op against the values every rank's input is known to have
    vals = [torch.tensor([1.0, -2.0, 3.5]) * (q + 1) for q in range(n)]
    mine = vals[r].clone()
    stack = torch.stack(vals)
    for op, want in ((hvd.Average, stack.mean(0)), (hvd.Sum, stack.sum(0)), (hvd.Min, stack.min(0).values),
                     (hvd.Max, stack.max(0).values), (hvd.Product, stack.prod(0))):
        got = hvd.allreduce(mine, op=op)
        check(f"allreduce/{op.name}", torch.allclose(got, want) and torch.equal(mine, vals[r]), (got, want))
    check("allreduce/average_kw", torch.allclose(hvd.allreduce(mine, average=False), stack.sum(0)))
    got = hvd.allreduce(mine, op=hvd.Sum, prescale_factor=0.5, postscale_factor=3.0)
    check("allreduce/scale_factors", torch.allclose(got, stack.sum(0) * 1.5), got)
    t = mine.clone()
    h = hvd.allreduce_async_(t, op=hvd.Sum, name="x")
    res = hvd.synchronize(h)
    check("allreduce_async_/in_place", res is t and torch.allclose(t, stack.sum(0)) and hvd.poll(h))
    ts = [mine.clone(), mine[:2].clone() * 10]
    got = hvd.grouped_allreduce(ts)
    check("grouped_allreduce", torch.allclose(got[0], stack.mean(0)) and torch.allclose(got[1], stack.mean(0)[:2] * 10))
    ints = hvd.allreduce(torch.tensor([7 * (r + 1)]), op=hvd.Average)
    check("allreduce/int_average", ints.dtype == torch.int64 and int(ints) == sum(7 * (q + 1) for q in range(n)) // n,
          ints)
    half = hvd.allreduce(mine, compression=hvd.Compression.fp16)
    check("allreduce/fp16_compression", half.dtype == torch.float32 and torch.allclose(half, stack.mean(0), atol=1e-2))
    x = torch.tensor([2.0, 3.0], requires_grad=True)
    (hvd.allreduce(x * (r + 1), op=hvd.Sum) * torch.tensor([1.0, 2.0])).sum().backward()
    check("allreduce/gradient", torch.allclose(x.grad, torch.tensor([1.0, 2.0]) * n * (r + 1)), x.grad)

    # allgather: first dimensions that differ between ranks
    g = hvd.allgather(torch.full((r + 1, 2), float(r)))
    want = torch.cat([torch.full((q + 1, 2), float(q)) for q in range(n)])
    check("allgather/uneven", torch.equal(g, want), g)
    x = torch.ones(r + 1, 2, requires_grad=True)
    (hvd.allgather(x) * torch.arange(want.shape[0]).float()[:, None]).sum().backward()
    off = sum(q + 1 for q in range(r))
    check("allgather/gradient", torch.allclose(x.grad[:, 0], torch.arange(off, off + r + 1).float()), x.grad)

    # broadcast: roots are global ranks
    b = hvd.broadcast(torch.tensor([float(r), 1.0]), root_rank=n - 1)
    check("broadcast", torch.equal(b, torch.tensor([float(n - 1), 1.0])), b)
    t = torch.tensor([float(r)])
    hvd.broadcast_(t, root_rank=0)
    check("broadcast_", float(t) == 0.0)
    expect_error("broadcast/bad_root", ValueError, "root_rank", lambda: hvd.broadcast(t, root_rank=n))

    # alltoall, with and without splits
    src = torch.arange(4) + 100 * r
    splits = [1, 3] if r == 0 else [2, 2]
    got, recv = hvd.alltoall(src, splits=splits)
    all_splits = [[1, 3], [2, 2]]
    pieces = [(torch.arange(4) + 100 * q).split(all_splits[q])[r] for q in range(n)]
    check("alltoall/splits", torch.equal(got, torch.cat(pieces))
          and recv.tolist() == [all_splits[q][r] for q in range(n)] and recv.dtype == torch.int32, (got, recv))
    got = hvd.alltoall(src)
    check("alltoall/equal", torch.equal(got, torch.cat([(torch.arange(4) + 100 * q).chunk(n)[r] for q in range(n)])))
    expect_error("alltoall/bad_splits", ValueError, "splits", lambda: hvd.alltoall(src, splits=[1, 1]))

    check("objects", hvd.broadcast_object({"r": r}, root_rank=1) == {"r": 1}
          and hvd.allgather_object(r * 10) == [q * 10 for q in range(n)])
    hvd.barrier()

    # refusals, on every rank alike
    expect_error("adasum_refused", NotImplementedError, "Adasum", lambda: hvd.allreduce(mine, op=hvd.Adasum))
    for fn in (hvd.reducescatter, hvd.reducescatter_async, hvd.grouped_reducescatter, hvd.grouped_reducescatter_async):
        expect_error(f"{fn.__name__}_refused", NotImplementedError, "allreduce", lambda fn=fn: fn(mine))
    # ranks that disagree: the same error on every rank, as Horovod's coordinator raises (never a silent result)
    expect_error("mismatch/dtype", hvd.CollectiveMismatchError, "dtype=int32.*dtype=float32|dtype=float32.*dtype=int32",
                 lambda: hvd.allreduce(torch.ones(3, dtype=torch.int32 if r == 0 else torch.float32)))
    expect_error("mismatch/shape", hvd.CollectiveMismatchError, "disagree",
                 lambda: hvd.allreduce(torch.ones(3 + r)))
    expect_error("mismatch/root", hvd.CollectiveMismatchError, "root",
                 lambda: hvd.broadcast(torch.ones(2), root_rank=r))
    expect_error("mismatch/kind", hvd.CollectiveMismatchError, "allgather",
                 lambda: hvd.allgather(torch.ones(2)) if r == 0 else hvd.broadcast(torch.ones(2), root_rank=0))
    expect_error("mismatch/allgather_rows_may_differ_other_dims_not", hvd.CollectiveMismatchError, "shape",
                 lambda: hvd.allgather(torch.ones(2, 2 + r)))
    # bad arguments on one rank only: every rank raises, naming it (the others must not wait in the collective)
    expect_error("problem_on_one_rank", ValueError, "rank 1: splits",
                 lambda: hvd.alltoall(torch.ones(4), splits=[2, 2] if r == 0 else [1, 1]))
    expect_error("timeline_refused", NotImplementedError, "torch.profiler", lambda: hvd.start_timeline("/tmp/t"))
    expect_error("init_comm_refused", ValueError, "process_set", lambda: hvd.init(comm=[0]))
    expect_error("bad_op", ValueError, "op must be", lambda: hvd.allreduce(mine, op=9))

    # process sets: Horovod's test_optimizer_process_sets (each rank alone in its set, here)
    evens = hvd.add_process_set([q for q in range(n) if q % 2 == 0])
    odds = hvd.add_process_set(hvd.ProcessSet([q for q in range(n) if q % 2 == 1]))
    expect_error("process_set/duplicate", ValueError, "duplicate", lambda: hvd.add_process_set([0]))
    this = evens if r % 2 == 0 else odds
    other = odds if r % 2 == 0 else evens
    check("process_set/rank", this.rank() == 0 and this.size() == 1 and this.included() and not other.included())
    expect_error("process_set/not_member", ValueError, "does not include this rank",
                 lambda: hvd.allreduce(mine, process_set=other))
    check("process_set/allreduce", torch.equal(hvd.allreduce(mine, op=hvd.Sum, process_set=this), mine))
    torch.manual_seed(r)
    model = torch.nn.Sequential(torch.nn.Linear(10, 4), torch.nn.ReLU(), torch.nn.Linear(4, 3))
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9),
                                   named_parameters=model.named_parameters(), process_set=evens)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)  # alone in its set (rank 0) or outside it (rank 1): local
    check("process_set/optimizer_state_made", all(p in opt.state for p in model.parameters()))
    opt.zero_grad()
    model(torch.randn(8, 10)).pow(2).sum().backward()
    opt.step()
    w = model[2].weight.detach().reshape(-1)
    everyone = hvd.allgather(w[None])
    # rank 0 alone in the even set steps on its own gradient, rank 1 (outside it) too: the replicas differ
    check("process_set/optimizer_outside_the_set", not torch.equal(everyone[0], everyone[1]))
    check("process_set/remove", hvd.remove_process_set(odds) and hvd.remove_process_set(evens)
          and not hvd.remove_process_set(hvd.global_process_set) and odds.process_set_id is None)

    # the optimizer: BSP by default (Horovod's algorithm), bitwise replicas; any mode through sync=
    for name, sync in (("default", None), ("osp", osp.OSP(critical=0.25)), ("dsync", osp.DSync(delay=1))):
        torch.manual_seed(r)
        model = torch.nn.Sequential(torch.nn.Linear(10, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
        opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                       named_parameters=model.named_parameters(),
                                       **({} if sync is None else {"sync": sync}))
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        hvd.broadcast_optimizer_state(opt, root_rank=0)
        check(f"optimizer/{name}/fresh_state_zero_grads",
              all(p.grad is not None and not p.grad.any() for p in model.parameters()))
        if sync is None:
            check("optimizer/default_is_bsp", opt.sync.name == "bsp", opt.sync)
        gen = torch.Generator().manual_seed(100 + r)
        for _ in range(4):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(torch.randn(16, 10, generator=gen)),
                                              torch.randint(0, 3, (16,), generator=gen)).backward()
            opt.step()
        opt.flush()
        hvd.broadcast_optimizer_state(opt, root_rank=0)  # after steps: every rank calls it, nothing changes
        flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
        check(f"optimizer/{name}/replicas", all(torch.equal(flat, f) for f in hvd.allgather_object(flat)))

    # join: rank 0 runs out of data two steps early
    torch.manual_seed(0)
    model = torch.nn.Linear(6, 2)
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    for _ in range(3 + 2 * r):
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    last = hvd.join()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    check("join/last_rank", last == n - 1, last)
    check("join/replicas", all(torch.equal(flat, f) for f in hvd.allgather_object(flat)))
    del opt


def variants():
    """The asynchronous, in-place and grouped forms, the remaining answers and refusals, and a failed collective."""
    vals = [torch.tensor([1.0, -2.0, 3.5]) * (q + 1) for q in range(n)]
    mine, stack = vals[r].clone(), torch.stack(vals)
    got = hvd.synchronize(hvd.allreduce_async(mine, op=hvd.Sum))
    check("allreduce_async", torch.allclose(got, stack.sum(0)) and torch.equal(mine, vals[r]))
    t = mine.clone()
    check("allreduce_", hvd.allreduce_(t) is t and torch.allclose(t, stack.mean(0)))
    ts = [mine.clone(), mine.clone() * 2]
    check("grouped_allreduce_", all(a is b for a, b in zip(hvd.grouped_allreduce_(ts, op=hvd.Sum), ts))
          and torch.allclose(ts[1], stack.sum(0) * 2))
    got = hvd.synchronize(hvd.grouped_allreduce_async([mine, mine * 3]))
    check("grouped_allreduce_async", torch.allclose(got[1], stack.mean(0) * 3) and torch.equal(mine, vals[r]))
    ts = [mine.clone()]
    hvd.synchronize(hvd.grouped_allreduce_async_(ts, op=hvd.Max))
    check("grouped_allreduce_async_", torch.allclose(ts[0], stack.max(0).values))
    want = torch.cat([torch.full((q + 1,), float(q)) for q in range(n)])
    check("allgather_async", torch.equal(hvd.synchronize(hvd.allgather_async(torch.full((r + 1,), float(r)))), want))
    both = hvd.grouped_allgather([torch.full((r + 1,), float(r)), torch.ones(1, 2) * r])
    check("grouped_allgather", torch.equal(both[0], want) and both[1].shape == (n, 2))
    both = hvd.synchronize(hvd.grouped_allgather_async([torch.full((r + 1,), float(r))]))
    check("grouped_allgather_async", torch.equal(both[0], want))
    src = torch.tensor([float(r)])
    got = hvd.synchronize(hvd.broadcast_async(src, root_rank=1))
    check("broadcast_async", float(got) == 1.0 and float(src) == r)
    hvd.synchronize(hvd.broadcast_async_(src, root_rank=1))
    check("broadcast_async_", float(src) == 1.0)
    # Horovod's synchronize of an alltoall returns (output, received_splits), with splits given or not
    got, counts = hvd.synchronize(hvd.alltoall_async(torch.arange(n) + 10 * r))
    check("alltoall_async", got.tolist() == [10 * q + r for q in range(n)]
          and counts.dtype == torch.int32 and counts.tolist() == [1] * n, (got, counts))
    check("built/rest", hvd.cuda_built() == (torch.version.cuda is not None) and hvd.rocm_built() is False
          and hvd.ddl_built() is False and hvd.ccl_built() is False and hvd.mpi_threads_supported() is False)
    expect_error("stop_timeline_refused", NotImplementedError, "profiler", hvd.stop_timeline)
    expect_error("sparse_refused", NotImplementedError, "sparse_as_dense",
                 lambda: hvd.sparse_allreduce_async(mine, "x", hvd.Sum))
    check("hosts_updated_interrupt", issubclass(hvd.HostsUpdatedInterrupt, RuntimeError)
          and hvd.HostsUpdatedInterrupt(True).skip_sync)
    # a collective no peer meets fails as Horovod's do, with HorovodInternalError (a set whose group times out
    # in 1 s; rank 1 never calls it)
    lonely = hvd.ProcessSet(list(range(n)))  # made by hand: add_process_set would refuse the global set's ranks
    lonely._group = dist.new_group(lonely.ranks, timeout=datetime.timedelta(seconds=1))
    lonely.process_set_id = 99
    if r == 0:
        expect_error("horovod_internal_error", hvd.HorovodInternalError, ".",
                     lambda: hvd.allreduce(mine, process_set=lonely))
    else:
        check("horovod_internal_error", True)
    hvd.barrier()


ranks.run_all([run, variants])
hvd.shutdown()
# the group hvd.init() made is destroyed; one the script made before hvd.init() stays the script's
made_here = bool(os.environ.get("OSP_TEST_STORE"))
check("shutdown", not hvd.is_initialized() and dist.is_initialized() == made_here)
if made_here:
    dist.destroy_process_group()
ranks.save(out)
