"""A user's training script that simply returns: OSP and BSP steps, then either ``flush()`` or OSP's
stage 2 left in flight, then the final loss averaged over ranks with the engine's own allreduce (the
last line of many scripts). No destroy_process_group(), hvd.shutdown() or os._exit.

Usage: exit_script.py BACKEND ENDING   (under torchrun or horovodrun; 2 ranks; ENDING: flush | inflight)
The process must exit 0: tests/test_exit.py runs it many times.
"""
import sys

import torch

import osp
from osp.launcher import init_from_env

backend, ending = sys.argv[1], sys.argv[2]
comm = init_from_env(backend)
torch.set_num_threads(1)
torch.manual_seed(0)


def make_model():
    # big enough (1.3M parameters) that stage 2 is still on the wire when the script returns
    return torch.nn.Sequential(torch.nn.Linear(64, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1024),
                               torch.nn.Tanh(), torch.nn.Linear(1024, 10))


models = [make_model(), make_model()]
opts = [osp.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9), m.named_parameters(),
                                 sync=sync)
        for m, sync in zip(models, (osp.OSP(critical=0.25), osp.BSP(bucket_mb=1)))]
g = torch.Generator().manual_seed(comm.rank)
for _step in range(3):
    x, y = torch.randn(32, 64, generator=g), torch.randint(0, 10, (32,), generator=g)
    for model, opt in zip(models, opts):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
if ending == "flush":  # as README advises before evaluating or stopping: the last call waits for stage 2
    opts[0].flush()
else:
    assert opts[0].mode.in_flight, "OSP's stage 2 should still be in flight when the script returns"
# the last line, as in many scripts: the final loss averaged over ranks with the engine's own collective
if backend == "torch":
    final = torch.tensor([loss.item()])
    torch.distributed.all_reduce(final)
else:
    import horovod.torch as hvd
    final = hvd.allreduce(torch.tensor([loss.item()]), name="final_loss")
