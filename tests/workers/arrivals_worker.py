"""Rank program for the slow-rank tests: every mode's per-step record carries each rank's arrival, so
``stats()["arrivals"]`` names a rank that is persistently slower, and rank 0 warns once; a balanced run
names none.

Usage: arrivals_worker.py BACKEND OUTDIR

The last rank sleeps SLOW seconds before each backward (a straggler), the others FAST. Checks, per mode
(bsp, osp, osp-auto, dsync, and HSP composed with OSP, without a closure): ``<mode>/slow_rank_named``,
``<mode>/warned_once_on_rank_0`` (at the ``opt.step()`` line: BSP reads the record inside backward),
``<mode>/balanced_names_none``.
"""
import sys
import time
import warnings

import ranks
import torch

import osp
from osp.arrivals import Arrivals

backend, outdir = sys.argv[1], sys.argv[2]
comm = ranks.start(backend)
rank, size = comm.rank, comm.size
check = ranks.check
FAST, SLOW, STEPS = 0.01, 0.06, Arrivals.WINDOW + Arrivals.HOLD + 2  # named after HOLD windows
MODES = {"bsp": lambda: osp.BSP(), "osp": lambda: osp.OSP(critical=0.25, block_size=64),
         "osp-auto": lambda: osp.OSP(critical="auto", block_size=64), "dsync": lambda: osp.DSync(delay=2),
         "hsp-osp": lambda: osp.HSP(sync=osp.OSP(critical=0.25, block_size=64))}


def run(mode, slow):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   sync=MODES[mode](), backend=backend, timeout=60)
    g = torch.Generator().manual_seed(rank)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(STEPS):
            opt.zero_grad()
            loss = model(torch.randn(8, 16, generator=g)).square().mean()
            time.sleep(SLOW if slow and rank == size - 1 else FAST)
            loss.backward()
            opt.step()  # STEP_LINE: where the warning points, whichever point of the step read the record
        opt.flush()
    named = [w for w in caught if "slower than the median" in str(w.message)]
    check(f"{mode}/{'slow' if slow else 'balanced'}/warned_at_the_step_line",
          all((w.filename, w.lineno) == (__file__, STEP_LINE) for w in named), [(w.filename, w.lineno) for w in named])
    return opt.stats()["arrivals"], [str(w.message) for w in named]


STEP_LINE = next(i for i, ln in enumerate(open(__file__), 1) if ln.strip().startswith("opt.step()  # STEP_LINE"))


def every_mode():
    for mode in MODES:
        arrivals, named = run(mode, slow=True)
        check(f"{mode}/slow_rank_named", arrivals["slow_rank"] == size - 1 and arrivals["slower"] > 2
              and arrivals["steps"] >= STEPS - 3 and arrivals["lag_ms"][size - 1] > 0.5e3 * (SLOW - FAST), arrivals)
        check(f"{mode}/warned_once_on_rank_0", len(named) == (1 if rank == 0 else 0)
              and all(f"rank {size - 1} is " in m for m in named), named)
        arrivals, named = run(mode, slow=False)
        check(f"{mode}/balanced_names_none", arrivals["slow_rank"] is None and not named, (arrivals, named))


ranks.run_all([every_mode])
ranks.save(outdir)
ranks.shutdown(backend)
