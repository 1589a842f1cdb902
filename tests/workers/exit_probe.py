"""One rank that leaves a collective in flight and returns; an atexit hook registered before osp's
(so it runs after it) reports what osp's exit hook left behind, as JSON on stdout.

Usage: exit_probe.py MODE   MODE: return | destroyed | raise | optout
(``destroyed``: the script destroys the process group itself.) A torch.optim optimizer is built after
init_process_group, as in real scripts: that imports torch.distributed.nn, whose defaults then hold
the group.
"""
import atexit
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from threads_at_exit import thread_names  # beside this script


def probe():
    import osp.teardown
    print("PROBE " + json.dumps({"initialized": dist.is_initialized(), "names": thread_names(),
                                 "inflight": osp.teardown.pending()}), flush=True)
    if mode in ("optout", "raise") and dist.is_initialized():
        # what was left is reported; now do what a script that opts out must do itself (its own hook), or
        # the Gloo threads left alive may abort the interpreter's finalization (the SIGABRT osp's hook
        # prevents), and the exit code would say nothing about what is tested here
        C.get_comm("torch").wait(handle)
        osp.teardown._destroy_process_groups(time.monotonic() + 60)


atexit.register(probe)
mode = sys.argv[1]
if mode == "optout":
    os.environ["OSP_EXIT_HOOK"] = "0"
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
from osp import comm as C  # noqa: E402

torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
handle = C.get_comm("torch").allreduce_avg_async_(torch.ones(1 << 16), "never-waited")
late = C.get_comm("torch").late(60.0)  # OSP's second group, held as an optimizer alive at exit holds it
late.wait(late.allreduce_avg_async_(torch.ones(4), "late"))
if mode == "destroyed":
    C.get_comm("torch").wait(handle)
    dist.destroy_process_group()
if mode == "raise":
    raise RuntimeError("the script fails")
