"""What the test workers share: joining the job (a file store when the test spawned the ranks itself,
OSP_TEST_STORE, see tests/launch.py; else the environment the launcher set up) and named checks,
written per rank as JSON for the test to read."""
import datetime
import json
import os
import re
import traceback

import torch

import osp
from osp.launcher import init_from_env

results = {"rank": None, "size": None, "checks": {}, "errors": {}}


def start(backend: str, timeout_s: int = 60):
    """Start the engine (one thread per rank) and return osp's Comm for it."""
    if os.environ.get("OSP_TEST_STORE"):
        torch.distributed.init_process_group(
            "gloo", init_method="file://" + os.environ["OSP_TEST_STORE"], rank=int(os.environ["RANK"]),
            world_size=int(os.environ["WORLD_SIZE"]), timeout=datetime.timedelta(seconds=timeout_s))
        comm = osp.comm.TorchComm()
    else:
        comm = init_from_env(backend, timeout_s=timeout_s)
    torch.set_num_threads(1)
    results.update(rank=comm.rank, size=comm.size)
    return comm


def check(name, ok, detail=""):
    """Record check ``name``; one that ran before under the same name stays failed if it failed."""
    was = results["checks"].get(name)
    if was is not None and not was["ok"]:
        return
    results["checks"][name] = {"ok": bool(ok), "detail": str(detail)[:2000]}


def expect_error(name, exc_type, pattern, fn):
    """``fn()`` must raise ``exc_type`` with a message matching ``pattern``."""
    try:
        fn()
    except exc_type as e:
        check(name, re.search(pattern, str(e)) is not None, e)
        return
    except Exception as e:  # wrong type
        check(name, False, f"raised {type(e).__name__}: {e}")
        return
    check(name, False, "no error raised")


def run_all(scenarios):
    """Run each scenario in turn; the first one that raises is recorded and ends the run (the ranks may
    be out of step after it)."""
    for fn in scenarios:
        try:
            fn()
        except Exception:
            results["errors"][getattr(fn, "__name__", "scenario")] = traceback.format_exc()
            break


def save(outdir):
    with open(os.path.join(outdir, f"rank{results['rank']}.json"), "w") as fh:
        json.dump(results, fh, indent=1)


def shutdown(backend):
    if backend == "horovod":
        import horovod.torch as hvd
        hvd.shutdown()  # mpirun counts an exit without MPI_Finalize as a failure
    else:
        torch.distributed.barrier()  # no rank tears its connections down while a peer still talks
        torch.distributed.destroy_process_group()
