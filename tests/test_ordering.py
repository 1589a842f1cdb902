"""Collective ordering on engines that run a communicator's collectives strictly in issue order.

ProcessGroupNCCL runs one process group's collectives in order on one stream (and Horovod's NCCL path
does with its default single stream): a collective cannot start before every one issued before it on
that communicator has completed. Gloo runs two worker threads per group, so CPU runs never show what
this costs. ``InOrderComm`` is that engine on Gloo: a communicator's collectives complete in issue order
(waiting for one first completes every earlier one), and each collective records which collectives
issued before it on its communicator were still in flight (started, not yet waited for): on one NCCL
stream it would queue behind them.

The property: a stage-1 bucket of step t+1, started from the backward hooks, never queues behind step
t's stage 2 (75% of the gradient at ``critical=0.25``), which is only needed at step t+1's ``step()``.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import osp
from osp.comm import TorchComm


class InOrderComm(TorchComm):
    """torch.distributed with one in-order queue per communicator, as one NCCL stream per process group."""

    name = "torch"

    def __init__(self, group=None, log=None):
        super().__init__(group)
        self.queue = []  # handles issued here, in order
        self.names = {}  # id(handle) -> the collective's name
        self.log = [] if log is None else log  # (name, [names in flight ahead of it]), shared with late()
        self.forced = []  # (name waited for, [names issued before it, not waited for yet, completed first])
        self._late_comm = None

    def _allreduce_async_(self, tensor, name, average, wire=None):
        self.queue = [h for h in self.queue if not h.done]
        ahead = [self.names[id(h)] for h in self.queue]
        h = super()._allreduce_async_(tensor, name, average, wire)
        self.names[id(h)] = name
        self.queue.append(h)
        self.log.append((name, ahead))
        return h

    def _complete(self, handle, timeout=None):
        if handle in self.queue:  # every collective issued before it completes first
            earlier = [h for h in self.queue[:self.queue.index(handle)] if not h.done]
            if earlier:
                self.forced.append((self.names[id(handle)], [self.names[id(h)] for h in earlier]))
            for h in earlier:
                self.wait(h, timeout)
        return super()._complete(handle, timeout)

    def poll(self, handle):
        if handle in self.queue:
            for h in self.queue[:self.queue.index(handle)]:
                if not (h.done or h.work is None or h.work.is_completed()):
                    return False
        return super().poll(handle)

    def late(self, timeout, device=None):
        # the engine's second communicator (a process group of its own) is in order too
        if self._late_comm is None:
            self._late_comm = InOrderComm(dist.new_group(), self.log)
        return self._late_comm


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.Tanh(), torch.nn.Linear(128, 128), torch.nn.Tanh(),
                               torch.nn.Linear(128, 10))


def _train(opt, model, steps=5):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(16, 32, generator=g), torch.randint(0, 10, (16,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    opt.flush()


@pytest.mark.parametrize("critical", [0.25, 0.5])
def test_stage1_does_not_queue_behind_the_last_stage2(one_rank, critical):
    comm = InOrderComm()
    model = _model()
    # buckets of a few KiB: several stage-1 buckets per step, started from the backward hooks
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                                   model.named_parameters(), backend=comm,
                                   sync=osp.OSP(critical=critical, block_size=64, bucket_mb=0.01))
    _train(opt, model)
    s1 = [(n, ahead) for n, ahead in comm.log if ".s1." in n]
    s2 = [n for n, _ in comm.log if ".s2." in n]
    assert len(s2) >= 4 and len(s1) >= 5, (len(s1), s2)  # stage 1 and stage 2 every step
    behind = [(n, [a for a in ahead if ".s2." in a]) for n, ahead in s1 if any(".s2." in a for a in ahead)]
    assert not behind, f"stage-1 buckets queued behind the last step's stage 2: {behind[:3]}"


@pytest.mark.parametrize("sync", [osp.DSync(delay=2, bucket_mb=0.01), osp.DSync(delay=1, bucket_mb=0.01),
                                  osp.OSP(critical=0.25, block_size=64, bucket_mb=0.01), osp.BSP(bucket_mb=0.01)],
                         ids=repr)
def test_every_wait_is_for_the_oldest_collective_in_flight(one_rank, sync):
    """On an in-order engine a wait for a collective first waits for every one issued before it. DSync
    needs its averages in the order it starts them (step t's at step t + delay, before step t+1's), so
    one in-order communicator is right for it: no wait of any mode here has to complete a collective
    issued earlier that the step did not ask for yet."""
    comm = InOrderComm()
    model = _model()
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   backend=comm, sync=sync)
    _train(opt, model, steps=6)
    late = comm._late_comm.forced if comm._late_comm is not None else []
    assert len(comm.log) > 6
    assert not comm.forced and not late, (comm.forced + late)[:3]
