"""Compression on 2 ranks (tests/test_compression.py): every mode with its gradients on a float16 (and, where
the engine has it, bfloat16) wire. Replicas bitwise equal after flush(), and the parameters torch.optim gives
replaying the recorded gradients with the same compressed averaging: each rank's gradient divided by the
number of ranks, cast to the wire, summed there, cast back. argv: backend, outdir."""
import os
import sys

import torch
from ranks import check, expect_error, run_all, save, shutdown, start

import osp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conformance as C  # noqa: E402

backend, outdir = sys.argv[1], sys.argv[2]
comm = start(backend)
rank, size = comm.rank, comm.size
STEPS = 5
SYNCS = {"bsp": lambda c: osp.BSP(bucket_mb=1e-3), "osp-0.25": lambda c: osp.OSP(critical=0.25, block_size=16),
         "osp-0.0-stage2": lambda c: osp.OSP(critical=0.0, block_size=16, stage2_compression=c),
         "dsync-2": lambda c: osp.DSync(delay=2), "hsp": lambda c: osp.HSP(max_extra=0)}
WIRES = {"fp16": torch.float16, "bf16": torch.bfloat16}


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 4))


def replay(recorded, wire):
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9)
    for k in range(STEPS):
        for i, p in enumerate(m.parameters()):
            p.grad = C.wire_average([r[k][i] for r in recorded], torch.float32, wire)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def scenario(mode, wname):
    def run():
        c = getattr(osp.Compression, wname)
        m = model()
        opt = osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9), m.named_parameters(),
                                       sync=SYNCS[mode](c), backend=comm, timeout=60,
                                       compression=osp.Compression.none if mode.endswith("stage2") else c)
        recorded, n = [], len(list(m.parameters()))
        grads = []
        for p in m.parameters():
            p.register_hook(lambda g: grads.append(g.clone()))
        g = torch.Generator().manual_seed(10 + rank)
        for _ in range(STEPS):
            grads.clear()
            opt.zero_grad()
            x, y = torch.randn(8, 12, generator=g) * 3, torch.randn(8, 4, generator=g)
            torch.nn.functional.mse_loss(m(x), y).backward()
            recorded.append(list(reversed(grads[:n])))
            opt.step()
        opt.flush()
        flat = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
        check(f"{mode}/{wname}/replicas_equal", all(torch.equal(flat, f) for f in comm.allgather_object(flat)))
        want = replay(comm.allgather_object(recorded), WIRES[wname])
        check(f"{mode}/{wname}/equals_replay", torch.allclose(flat, want, rtol=1e-5, atol=1e-6),
              (flat - want).abs().max().item())
        plain = replay(comm.allgather_object(recorded), None)
        check(f"{mode}/{wname}/not_uncompressed", not torch.allclose(flat, plain, rtol=1e-7, atol=1e-8))
    run.__name__ = f"{mode}_{wname}"
    return run


def bf16_on_horovod():
    m = model()
    expect_error("horovod/bf16_refused", ValueError, r"bfloat16, which Horovod cannot allreduce",
                 lambda: osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1), m.named_parameters(),
                                                  backend=comm, compression=osp.Compression.bf16))


wires = ["fp16"] + (["bf16"] if backend == "torch" else [])
run_all([scenario(mo, w) for w in wires for mo in SYNCS] + ([bf16_on_horovod] if backend == "horovod" else []))
save(outdir)
shutdown(backend)
