"""HSP on real ranks (tests/workers/hsp_worker.py: a straggler, extras counted, I1, I3 replayed from every
micro-batch, I4, bad closures) with both engines, and its surface in one process."""
import os

import pytest
import torch

import launch
import osp

WORKER = os.path.join(launch.HERE, "workers", "hsp_worker.py")
CHECKS = ["I1_replicas_equal_every_step", "stats_count_every_micro_batch",
          "I3_I4_equals_torch_optim_on_the_mean_of_all_micro_batches", "wait_at_most_about_one_micro_batch",
          "max_extra_replicas_equal", "slow_rank_warned_once_on_rank_0", "slow_rank_in_stats"] + [
    f"bad/{c}" for c in ("no_backward", "zero_grad_inside", "closure_raises", "no_update_applied",
                         "training_goes_on", "max_extra_negative", "max_extra_float", "max_extra_bool",
                         "sync_hsp", "sync_string")]
FAST = ["fast_rank_computes_extras", "max_extra_caps_the_extras"]
# (engine, ranks, what HSP composes with): BSP, OSP and DSync on both engines with 2 ranks; with 3, OSP and
# DSync, each on one engine
CASES = [(b, 2, s) for b in ("horovod", "torch") for s in ("bsp", "osp", "dsync")] + [
    ("torch", 3, "osp"), ("horovod", 3, "dsync")]


@pytest.mark.multiproc
@pytest.mark.parametrize("backend,nranks,sync", CASES, ids=[f"{b}-{n}-{s}" for b, n, s in CASES])
def test_hsp_with_a_straggler(backend, nranks, sync, tmp_path):
    proc = launch.run("horovod" if backend == "horovod" else "spawn", nranks, [WORKER, backend, str(tmp_path), sync],
                      timeout=240)
    launch.check(proc)
    for r in launch.rank_results(tmp_path, nranks, proc):
        mine = ["straggler_computes_none"] if r["rank"] == nranks - 1 else FAST
        assert sorted(r["checks"]) == sorted(CHECKS + mine)


def tiny(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


def test_closure_only_under_hsp(one_rank):
    model = tiny()
    for sync in (osp.BSP(), osp.OSP(critical=0.5, block_size=64), osp.DSync(delay=2)):
        opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                       sync=sync)
        model(torch.randn(4, 12)).sum().backward()
        with pytest.raises(ValueError, match=r"step\(closure\) runs extra micro-batches under osp.HSP only"):
            opt.step(lambda: None)
        opt.flush()
        del opt
        model = tiny()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=osp.HSP())
    model(torch.randn(4, 12)).sum().backward()
    with pytest.raises(TypeError, match=r"step\(closure\) expects a callable, got 3"):
        opt.step(3)


@pytest.mark.parametrize("bpps", [1, 2])
def test_one_rank_hsp_is_the_plain_optimizer(one_rank, bpps):
    """One rank: "ready" completes at once, so no extra runs (the closure is never called) and HSP is the
    wrapped optimizer on the gradient summed over the step's backward passes (BSP's scale)."""
    a, b = tiny(), tiny()
    opt = osp.DistributedOptimizer(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9), a.named_parameters(),
                                   sync=osp.HSP(max_extra=3), backward_passes_per_step=bpps)
    ref = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    called = []
    for _ in range(5):
        xs = [(torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)) for _ in range(bpps)]
        for m, o in ((a, opt), (b, ref)):
            o.zero_grad()
            for x, y in xs:
                torch.nn.functional.cross_entropy(m(x), y).backward()
        assert opt.step(lambda: called.append(1)) is None
        assert opt.last_step()["micro_batches"] == [bpps] and opt.last_step()["extras"] == 0
        ref.step()
    assert not called
    st = opt.stats()
    assert st["hsp"]["extras"] == 0 and st["hsp"]["passes_per_rank"] == [5 * bpps]
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
