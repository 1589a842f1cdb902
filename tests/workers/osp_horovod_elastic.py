"""Horovod Elastic's training loop with ``import osp.horovod as hvd``, under torchrun --max-restarts: with FAIL_AT=k,
rank 1 of the first round dies after global step k; the restarted workers resume from the last commit. Prints
the final parameters' checksum, which must equal an uninterrupted run's. Usage: osp_horovod_elastic.py MODE."""
import collections
import os
import sys

import torch

import osp
import osp.horovod as hvd

MODES = {"bsp": lambda: osp.BSP(), "osp": lambda: osp.OSP(critical=0.25, block_size=16),
         "dsync": lambda: osp.DSync(delay=1)}
hvd.init()
torch.set_num_threads(1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                               named_parameters=model.named_parameters(), sync=MODES[sys.argv[1]]())
g = torch.Generator().manual_seed(1)
data = torch.utils.data.TensorDataset(torch.randn(96, 6, generator=g), torch.randn(96, 2, generator=g))
sampler = hvd.elastic.ElasticSampler(data, shuffle=True, seed=3)
loader = torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)
fail_at = int(os.environ.get("FAIL_AT", "-1"))
first_round = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
resets = []


@hvd.elastic.run
def train(state):
    if not first_round:
        print(f"rank {hvd.rank()} resumed at step {state.step} epoch {state.epoch}", flush=True)
    for state.epoch in range(state.epoch, 3):  # noqa: B020 - Horovod's elastic idiom: the epoch lives in the state
        for batch_idx, (x, y) in enumerate(loader):
            opt.zero_grad()
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            state.step += 1
            sampler.record_batch(batch_idx, 4)
            if state.step % 3 == 0:
                state.counts["commits"] += 1  # a plain Python object in the state (not a tensor)
                state.commit()
            if first_round and state.step == fail_at and hvd.rank() == 1:
                os._exit(3)  # a worker dies between commits
        sampler.set_epoch(state.epoch + 1)
        state.commit()


state = hvd.elastic.TorchState(model, opt, sampler=sampler, epoch=0, step=0, counts=collections.Counter())
state.register_reset_callbacks([lambda: resets.append(hvd.size())])
train(state)
opt.flush()
flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
agree = all(torch.equal(flat, f) for f in hvd.allgather_object(flat))
if hvd.rank() == 0:
    print(f"steps {state.step} resets {resets} replicas equal {agree} checksum {flat.double().sum().item()!r} "
          f"{flat.abs().double().sum().item()!r} commits {state.counts['commits']}", flush=True)
hvd.shutdown()
