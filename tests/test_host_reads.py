"""The host reads of a steady-state step, per mode (docs/design.md, "Host reads per step").

On a GPU every read of a device value on the host is a sync: the CPU stops queueing work until the
GPU has caught up. osp's steps read the host only through ``osp.agreement.read`` (the summed per-step
agreement, and non-finite checks where a mode must decide on the host whether to apply an update);
every other value a step needs is computed on the device. Here, on CPU with one rank, the reads of each
mode's steady-state step are counted; ``tests/test_cuda.py`` checks on a GPU, under
``torch.cuda.set_sync_debug_mode("error")``, that nothing else syncs. The meta-device steps of
``tests/test_optimizer.py`` (``test_whole_steps_on_meta``) show that no other read is made at all: meta
tensors have no values to read.
"""
from __future__ import annotations

import pytest
import torch

import osp
import osp.agreement

# reads per steady-state step, and why each is there
READS = {
    # the presence of each parameter's gradient (a parameter without one on every rank is left alone) and
    # whether the average is finite (a non-finite average skips the step on every rank)
    "bsp": 2,
    # the side channel (with this rank's mask checksums, one read), whether the last stage 2's averages are
    # finite (before their exact update) and whether stage 1's averages are (before the local update)
    "osp": 3,
    # the oldest step's record (presence, edits) with whether its average is finite and whether this rank's
    # own gradient is (its provisional update): one read
    "dsync": 1,
    # the sum's record (every rank's micro-batch count, failures, presence) with whether the mean is finite
    "hsp": 1,
}

MODES = {"bsp": lambda: osp.BSP(), "osp": lambda: osp.OSP(critical=0.25, block_size=64),
         "dsync": lambda: osp.DSync(delay=2), "hsp": lambda: osp.HSP()}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("oname", ["sgd", "rmsprop"])
def test_reads_per_steady_state_step(one_rank, monkeypatch, mode, oname):
    model = _model()
    make = {"sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), "rmsprop": lambda ps: torch.optim.RMSprop(ps)}
    opt = osp.DistributedOptimizer(make[oname](model.parameters()), model.named_parameters(), sync=MODES[mode]())
    g = torch.Generator().manual_seed(1)
    reads = []
    real = osp.agreement.read
    monkeypatch.setattr(osp.agreement, "read", lambda t: reads.append(t.numel()) or real(t))
    per_step = []
    for _ in range(8):
        x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)
        n = len(reads)  # backward too: BSP reads the presence when the averages land, at the end of backward
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        per_step.append(len(reads) - n)
    opt.flush()
    assert per_step[4:] == [READS[mode]] * 4, per_step  # after the first steps (scores, delays filling)
