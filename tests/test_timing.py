"""Where osp's time goes, and time as the device sees it (python/osp/timing.py).

- Every mode's steps mark their parts as ``torch.profiler.record_function`` ranges: read back here from
  the Chrome trace a user's profiler writes (what TensorBoard and Perfetto show).
- ``Interval`` is a host clock on a CPU and CUDA events on a GPU, where the host only queues the work.
"""
from __future__ import annotations

import json
import time

import pytest
import torch

import osp
from osp.timing import RANGES, Interval

# the ranges each mode's steady-state steps show
EXPECTED = {
    "bsp": {"osp.bsp.allreduce"},
    "osp": {"osp.stage1.bucket", "osp.stage1.launch", "osp.stage1.wait", "osp.side_channel", "osp.stage2.launch",
            "osp.stage2.wait", "osp.correction"},
    "dsync": {"osp.dsync.wait", "osp.correction", "osp.dsync.replay"},
    "hsp": {"osp.hsp.wait", "osp.hsp.extra"},
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 40), torch.nn.Tanh(), torch.nn.Linear(40, 5))


@pytest.mark.parametrize("mode", sorted(EXPECTED))
def test_profiler_trace_shows_the_ranges(one_rank, tmp_path, mode):
    model = _model()
    sync = {"bsp": osp.BSP(), "osp": osp.OSP(critical=0.25, block_size=64), "dsync": osp.DSync(delay=2),
            "hsp": osp.HSP(max_extra=1)}[mode]
    opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), model.named_parameters(),
                                   sync=sync)
    if mode == "hsp":  # one rank waits for nobody: make it run an extra as if a peer were late
        opt.mode.size = 2
        opt.mode._worth_waiting = lambda *args: False
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(8, 12, generator=g), torch.randint(0, 5, (8,), generator=g)

    def closure():
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        return loss

    def steps(n):
        for _ in range(n):
            opt.zero_grad()
            closure()
            opt.step(closure) if mode == "hsp" else opt.step()

    steps(3)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        steps(3)
    opt.flush()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    names = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert EXPECTED[mode] <= names, sorted(EXPECTED[mode] - names)
    assert {n for n in names if str(n).startswith("osp.")} <= set(RANGES)


def test_interval_on_the_host():
    iv = Interval(torch.device("cpu"))
    assert iv.seconds() is None
    iv.start()
    time.sleep(0.02)
    iv.stop()
    assert 0.015 < iv.seconds() < 1.0 and iv.wait() == iv.seconds()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: CUDA events need a GPU")
def test_interval_times_the_device_not_the_queueing():
    torch.cuda.synchronize()
    iv = Interval(torch.device("cuda")).start()
    t0 = time.perf_counter()
    torch.cuda._sleep(200_000_000)  # about 0.1 s of device time, queued in microseconds
    iv.stop()
    queued = time.perf_counter() - t0
    device = iv.wait()
    assert device is not None and device > 0.03 and device > 10 * queued, (device, queued)
