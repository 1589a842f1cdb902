"""Compression (osp.compression): gradients travel as float16 or bfloat16, every rank applies the same update
computed from the decompressed average, and the trajectory is torch.optim replaying the same compressed
averaging of the recorded gradients. One rank here (the replay is then bitwise); 2 ranks in
tests/workers/compression_worker.py."""
import pytest
import torch
from conformance import compare

import osp
from osp.compression import Compression, resolve

MODES = {
    "bsp": lambda: osp.BSP(bucket_mb=1e-3),
    "osp-0.25": lambda: osp.OSP(critical=0.25, block_size=16, bucket_mb=1e-3),
    "osp-0.0": lambda: osp.OSP(critical=0.0, block_size=16),
    "dsync-2": lambda: osp.DSync(delay=2),
    "hsp": lambda: osp.HSP(max_extra=0),
}
OPTIMIZERS = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9),
              "adam": lambda ps: torch.optim.Adam(ps, lr=0.01)}
STEPS = 6


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def batches():
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 12, generator=g) * 4, torch.randn(8, 4, generator=g)) for _ in range(STEPS)]


def run(mode, oname, compression, stage2=None):
    """osp's run, and the gradients its backward passes produced (tensor hooks: before osp sees them)."""
    m = model()
    sync = MODES[mode]()
    if stage2 is not None:
        sync = osp.OSP(critical=sync.critical, block_size=16, bucket_mb=1e-3, stage2_compression=stage2)
    opt = osp.DistributedOptimizer(OPTIMIZERS[oname](m.parameters()), m.named_parameters(), sync=sync,
                                   compression=compression)
    recorded = []
    for p in m.parameters():
        p.register_hook(lambda g: recorded.append(g.clone()))
    for x, y in batches():
        opt.zero_grad()
        torch.nn.functional.mse_loss(m(x), y).backward()
        opt.step()
    opt.flush()
    n = len(list(m.parameters()))
    steps = [list(reversed(recorded[k * n:(k + 1) * n])) for k in range(STEPS)]  # backward runs last layer first
    return m, opt, steps


def replay(oname, steps, wire):
    """torch.optim applying, at each step, the recorded gradient after the compressed average of one rank."""
    m = model()
    opt = OPTIMIZERS[oname](m.parameters())
    for grads in steps:
        for p, g in zip(m.parameters(), grads):
            p.grad = g if wire is None else g.to(wire).to(g.dtype)
        opt.step()
    return m


def same(a, b):
    """Equal to the conformance suite's tolerance (bitwise, or a few ulps where a mode recomputes an update:
    DSync's replay of its provisional steps)."""
    return all(compare(p.detach(), q.detach(), STEPS)[1] for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("oname", sorted(OPTIMIZERS))
@pytest.mark.parametrize("wire", ["fp16", "bf16"])
@pytest.mark.parametrize("mode", sorted(MODES))
def test_one_rank_equals_the_replay_of_the_compressed_average(one_rank, mode, wire, oname):
    m, opt, steps = run(mode, oname, getattr(Compression, wire))
    want = replay(oname, steps, getattr(torch, {"fp16": "float16", "bf16": "bfloat16"}[wire]))
    assert same(m, want), max((p - q).abs().max().item() for p, q in zip(m.parameters(), want.parameters()))
    # and it is not the uncompressed run: the test can tell the two apart
    assert not same(m, replay(oname, steps, None))


@pytest.mark.parametrize("critical,compressed", [(0.0, True), (1.0, False)])
def test_osp_stage2_compression_reaches_the_deferred_blocks_only(one_rank, critical, compressed):
    """stage2_compression=fp16 with the optimizer's compression none: all blocks deferred travel in fp16;
    all blocks critical travel as they are."""
    MODES["osp-x"] = lambda: osp.OSP(critical=critical, block_size=16, bucket_mb=1e-3)
    try:
        m, _, steps = run("osp-x", "sgd", Compression.none, stage2=Compression.fp16)
    finally:
        del MODES["osp-x"]
    assert same(m, replay("sgd", steps, torch.float16 if compressed else None))


def test_horovods_compression_objects_and_names():
    hvd = pytest.importorskip("horovod.torch")
    assert resolve(hvd.Compression.none) is Compression.none and resolve(hvd.Compression.fp16) is Compression.fp16
    assert resolve(hvd.Compression.fp16()) is Compression.fp16 and resolve("bf16") is Compression.bf16
    assert resolve(None) is Compression.none
    with pytest.raises(ValueError, match="expected osp.Compression.none, .fp16 or .bf16"):
        resolve("int8")
    assert repr(osp.OSP(stage2_compression="fp16")).endswith("stage2_compression=osp.Compression.fp16)")


@pytest.mark.parametrize("mode", sorted(MODES))
def test_an_average_beyond_float16_skips_the_step(one_rank, mode):
    """A gradient too large for float16's range: the step is skipped (counted), never applied as inf."""
    m = model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05), m.named_parameters(),
                                   sync=MODES[mode](), compression=Compression.fp16)
    before = [p.detach().clone() for p in m.parameters()]
    x, y = batches()[0]
    opt.zero_grad()
    (torch.nn.functional.mse_loss(m(x), y) * 1e9).backward()
    with pytest.warns(RuntimeWarning, match="step skipped"):
        opt.step()
        opt.flush()
    assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert opt.stats()["skipped_steps"] == 1


@pytest.mark.multiproc
@pytest.mark.parametrize("launcher,backend", [("spawn", "torch"), ("horovod", "horovod")])
def test_two_ranks_replicas_equal_and_replay(launcher, backend, tmp_path):
    import os

    import launch

    worker = os.path.join(launch.HERE, "workers", "compression_worker.py")
    proc = launch.run(launcher, 2, [worker, backend, str(tmp_path)], timeout=240)
    launch.check(proc)
    results = launch.rank_results(tmp_path, 2, proc)
    names = {n for r in results for n in r["checks"]}
    assert len(names) == (5 * 3 * 2 if backend == "torch" else 5 * 3 + 1), sorted(names)
