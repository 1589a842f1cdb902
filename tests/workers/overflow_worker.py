"""Rank program: each rank's float16 gradient is finite, their sum across ranks is not (item 6 of the
conformance issue). BSP and DSync skip the step on every rank; OSP skips it when the critical blocks'
average overflows, and raises the same FloatingPointError on every rank when the deferred blocks' does
(their critical blocks are applied already), leaving the replicas equal.

Usage: overflow_worker.py BACKEND OUTDIR
"""
import sys
import warnings

import ranks
import torch

import osp

backend, outdir = sys.argv[1], sys.argv[2]
comm = ranks.start(backend)
check = ranks.check


def run(name, sync, expect_raise):
    torch.manual_seed(0)
    w = torch.nn.Parameter(torch.zeros(64, dtype=torch.float16))
    opt = osp.DistributedOptimizer(torch.optim.SGD([w], lr=1e-6), [("w", w)], sync=sync, backend=backend, timeout=60)
    raised, skipped = None, 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            for step in range(3):
                opt.zero_grad()
                coef = torch.full((64,), 1.0, dtype=torch.float16)
                if step == 1:
                    coef[:] = 40000.0  # finite here; 2 x 40000 > 65504, float16's largest
                (w * coef).sum().backward()
                opt.step()
            opt.flush()
        except FloatingPointError as e:
            raised = str(e)
    skipped = sum("step skipped on every rank" in str(c.message) for c in caught)
    finite = bool(w.detach().isfinite().all())
    everyone = comm.allgather_object(w.detach().clone())
    check(f"{name}/replicas_equal", all(torch.equal(x, everyone[0]) for x in everyone))
    check(f"{name}/parameters_finite", finite)
    if expect_raise:
        check(f"{name}/raised_on_every_rank", raised is not None and "not finite on every rank" in raised, raised)
    else:
        check(f"{name}/skipped_on_every_rank", raised is None and skipped >= 1, f"raised {raised}, {skipped} skips")


run("bsp", osp.BSP(), False)
run("dsync", osp.DSync(delay=2), False)
run("osp_critical", osp.OSP(critical=0.5, block_size=16), False)  # the first step's blocks are all critical
run("osp_deferred", osp.OSP(critical=0.0, block_size=16), True)
ranks.save(outdir)
ranks.shutdown(backend)
