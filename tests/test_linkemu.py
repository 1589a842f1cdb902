"""The user-space link emulation (osp.linkemu, osp.train --link): the rate grammar, the stated formula, collectives
that take at least their emulated time and queue behind each other, without a busy CPU, on osp's Comm, DDP's
hook and Horovod's optimizer, with real ranks."""
import json
import time

import pytest
import torch

import launch
from osp import linkemu
from osp.comm import Comm


def test_rates_are_bits_as_tc_writes_them():
    assert linkemu.parse_rate("1gbit") == 1e9
    assert linkemu.parse_rate("100mbit") == 1e8
    assert linkemu.parse_rate("10gbit") == 1e10
    assert linkemu.parse_rate("2.5Gbit") == 2.5e9
    assert linkemu.parse_rate("500kbit/s") == 5e5
    for bytes_spelling in ("1Gbps", "1gbps", "1GB/s", "100mbps", "10GB"):
        with pytest.raises(ValueError, match="gigaBYTE"):
            linkemu.parse_rate(bytes_spelling)
    for bad in ("fast", "", "0gbit", "-1gbit", "gbit", "1g"):
        with pytest.raises(ValueError, match="link rate"):
            linkemu.parse_rate(bad)
    assert linkemu.parse_latency("200us") == pytest.approx(2e-4)
    assert linkemu.parse_latency("1.5ms") == pytest.approx(1.5e-3)
    assert linkemu.parse_latency("0") == 0.0
    with pytest.raises(ValueError, match="latency must be"):
        linkemu.parse_latency("soon")
    link = linkemu.parse_link("1gbit,200us")
    assert (link.rate, link.latency, link.spec) == (1e9, pytest.approx(2e-4), "1gbit,200us")
    assert link.describe() == "emulated link: 1 Gbit/s, 200 us per collective (user space; not a real network)"
    assert linkemu.parse_link("100mbit").describe() == \
        "emulated link: 100 Mbit/s, 0 us per collective (user space; not a real network)"


def test_the_stated_formula():
    """latency + 2(n-1)/n * 8 * bytes / rate, as the module's docstring states it; nothing with one rank."""
    link = linkemu.Link(1e9, 2e-4)
    for n in (2, 3, 4, 8):
        assert link.seconds(10**6, n) == pytest.approx(2e-4 + 2 * (n - 1) / n * 8e6 / 1e9)
    assert link.seconds(10**6, 1) == 0.0 and link.reserve(10**6, 1) is None


def test_collectives_queue_on_one_link():
    """Booked at the same instant, the second ends one collective's time after the first; booked once the link
    is free again, it starts at once."""
    link = linkemu.Link(1e8, 1e-3)
    dt = link.seconds(10**6, 2)  # 81 ms
    a, b = link.reserve(10**6, 2, now=100.0), link.reserve(10**6, 2, now=100.0)
    assert a == pytest.approx(100.0 + dt) and b == pytest.approx(100.0 + 2 * dt)
    assert link.reserve(10**6, 2, now=200.0) == pytest.approx(200.0 + dt)
    assert link.collectives == 3 and link.link_s == pytest.approx(3 * dt)


class InstantWork:
    """A collective that has already landed (the real one on a very fast network)."""

    def is_completed(self):
        return True


class TwoRankComm(Comm):
    """osp's Comm interface with size 2 whose engine completes everything at once: only the emulation takes time."""

    rank, size, name = 0, 2, "instant"

    def _start(self, tensor, name, average):
        return InstantWork()

    def _complete(self, handle, timeout=None):
        return True

    def poll(self, handle):
        return handle.done or (linkemu.passed(handle.due) and handle.work.is_completed())

    def broadcast_(self, tensor, root, name):
        pass

    def allgather_object(self, obj):
        return [obj, obj]


@pytest.fixture
def link():
    lk = linkemu.Link(1e8, 1e-3)  # 100 Mbit/s, 1 ms: a 1 MB allreduce on 2 ranks takes 81 ms
    old = linkemu.install(lk)
    yield lk
    linkemu.install(old)


def test_comm_waits_take_the_emulated_time_and_queue(link, monkeypatch):
    """Structural where the host decides (a loaded host oversleeps by any amount; upper bounds of 50 ms and 'cpu
    under 0.3 of the wall time' were its to fail): each collective is booked ``dt`` after the link frees, the
    wait returns no sooner than that, and a non-blocking test sleeps until the booked end in few pauses."""
    comm = TwoRankComm()
    t = torch.ones(250_000)  # 1 MB
    dt = link.seconds(t.numel() * 4, 2)
    t0 = time.monotonic()
    h = comm.allreduce_avg_async_(t, "one")
    assert t0 + dt <= h.due <= time.monotonic() + dt, (h.due - t0, dt)  # booked dt after its issue
    comm.wait(h, timeout=5.0)
    assert time.monotonic() >= h.due and time.monotonic() - t0 >= dt
    # back to back: the second queues behind the first, booked dt after the first's end
    h1, h2 = comm.allreduce_avg_async_(t, "a"), comm.allreduce_sum_async_(t, "b")
    assert h2.due == pytest.approx(h1.due + dt, abs=1e-9), (h1.due, h2.due, dt)
    comm.wait(h1)
    assert time.monotonic() >= h1.due
    comm.wait(h2)
    assert time.monotonic() >= h2.due
    # a non-blocking test sleeps until the emulated end instead of polling in a loop
    import osp.comm as comm_module
    real_sleep, pauses = time.sleep, []
    monkeypatch.setattr(comm_module.time, "sleep", lambda s: (pauses.append(s), real_sleep(s)))
    h = comm.allreduce_avg_async_(t, "c")
    assert comm.done_within(h, 5.0, max_pause=1e-4) and time.monotonic() >= h.due
    assert 1 <= len(pauses) <= 5 and sum(pauses) >= 0.9 * dt, pauses  # slept to the end, not spun in 0.1 ms steps
    assert link.collectives == 4 and link.held_s > 3 * dt * 0.9


def test_without_a_link_nothing_waits(monkeypatch):
    # structural, not timed (a 20 ms bound failed on a loaded machine): no collective gets an emulated end, and
    # nothing sleeps on the link's account
    assert linkemu.current() is None
    slept = []
    monkeypatch.setattr(linkemu.time, "sleep", lambda s: slept.append(s))
    comm = TwoRankComm()
    h = comm.allreduce_avg_async_(torch.ones(250_000), "x")
    assert h.due is None and linkemu.passed(h.due) and linkemu.remaining(h.due) == 0.0
    comm.wait(h)
    assert slept == []


def test_a_delayed_future_completes_at_its_due_time():
    link = linkemu.Link(1e8)
    fut = torch.futures.Future()
    due = time.monotonic() + 0.1
    out = linkemu.delay_future(fut, due, link)
    fut.set_result(torch.ones(3))
    assert not out.done()
    assert out.wait().sum().item() == 3.0
    assert time.monotonic() >= due  # not before its emulated end (how late a loaded host wakes is not ours)
    failed = torch.futures.Future()
    out = linkemu.delay_future(failed, time.monotonic() + 0.02, link)
    failed.set_exception(RuntimeError("peer died"))
    with pytest.raises(RuntimeError, match="peer died"):
        out.wait()


# Real ranks: osp's Comm on both engines, DDP's hook (torch) and Horovod's optimizer (horovod), 100 Mbit/s, 1 ms.
WORKER = r'''
import json, os, sys, time
import torch
from osp import linkemu

engine, out = sys.argv[1], sys.argv[2]
if engine == "torch":
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method="file://" + os.environ["OSP_TEST_STORE"],
                            rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    from osp.comm import TorchComm
    comm = TorchComm()
else:
    import horovod.torch as hvd
    hvd.init()
    from osp.comm import HorovodComm
    comm = HorovodComm()
link = linkemu.Link(1e8, 1e-3)
t = torch.ones(250_000)  # 1 MB
comm.wait(comm.allreduce_avg_async_(t.clone(), "warm"))  # connections made before anything is timed
res = {"dt": link.seconds(t.numel() * 4, comm.size)}
linkemu.install(link)
t0 = time.monotonic()
h = comm.allreduce_avg_async_(t.clone(), "one")
res["polled_early"] = comm.poll(h)
res["value"] = comm.wait(h, 30.0)[0].item()
res["one"] = time.monotonic() - t0
t0 = time.monotonic()
h1, h2 = comm.allreduce_avg_async_(t.clone(), "a"), comm.allreduce_avg_async_(t.clone(), "b")
comm.wait(h1, 30.0)
res["first"] = time.monotonic() - t0
comm.wait(h2, 30.0)
res["both"] = time.monotonic() - t0
linkemu.uninstall()

torch.manual_seed(0)
model = torch.nn.Linear(500, 500)  # 1 MB of gradient
x = torch.ones(4, 500)
if engine == "torch":
    ddp = torch.nn.parallel.DistributedDataParallel(model, bucket_cap_mb=100)
    ddp(x).sum().backward()  # warm
    ddp.register_comm_hook(None, linkemu.ddp_hook(link))
    model.zero_grad()
    t0 = time.monotonic()
    ddp(x).sum().backward()  # DDP's reducer waits for the hook's future at the end of backward
    res["framework"] = time.monotonic() - t0
    res["grad"] = model.bias.grad[0].item()
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
    model(x).sum().backward()
    opt.step()  # warm
    opt.zero_grad()
    linkemu.emulate_horovod_optimizer(link)
    t0 = time.monotonic()
    model(x).sum().backward()
    opt.step()  # synchronize() waits for each handle
    res["framework"] = time.monotonic() - t0
    res["grad"] = model.bias.grad[0].item()
res["framework_dt"] = link.seconds(sum(p.numel() * 4 for p in model.parameters()), comm.size)
json.dump(res, open(out + f".{comm.rank}", "w"))
if engine == "torch":
    dist.destroy_process_group()
else:
    hvd.shutdown()
'''


@pytest.mark.multiproc
@pytest.mark.parametrize("engine", ["torch", "horovod"])
def test_real_ranks_wait_for_the_emulated_link(engine, tmp_path):
    """2 ranks: a 1 MB allreduce takes at least its emulated 81 ms, two back to back at least twice that, the
    average is right; DDP's backward (its comm hook) and Horovod's optimizer step wait for theirs too."""
    out = str(tmp_path / "res")
    proc = launch.run("spawn" if engine == "torch" else "horovod", 2, ["-c", WORKER, engine, out], timeout=180)
    launch.check(proc)
    for rank in range(2):
        r = json.loads(open(f"{out}.{rank}").read())
        dt = r["dt"]
        assert dt == pytest.approx(1e-3 + 8e6 / 1e8)
        assert not r["polled_early"] and r["value"] == 1.0
        assert dt <= r["one"] < dt + 0.5, r
        assert dt <= r["first"] and 2 * dt <= r["both"] < 2 * dt + 0.5, r
        assert r["framework"] >= r["framework_dt"], r
        assert r["grad"] == 4.0, r  # the hook's future carries the average on


def load_demo():
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("osp_demo", os.path.join(os.path.dirname(launch.HERE), "scripts",
                                                                           "demo.py"))
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    return demo


def test_demo_without_shaped_links_takes_the_emulated_link(monkeypatch):
    """Not root (no tc, no namespaces): `make demo` runs behind the emulated link, not on plain loopback."""
    demo = load_demo()
    seen = {}
    monkeypatch.setattr(demo, "why_no_netem", lambda rate: "not running as root (network namespaces, ... need root)")
    monkeypatch.setattr(demo, "emulated", lambda a, reason: seen.update(reason=reason, rate=a.rate) or 0)
    monkeypatch.setattr(demo, "loopback", lambda a, reason: pytest.fail("plain loopback"))
    assert demo.main([]) == 0
    assert seen == {"reason": "not running as root (network namespaces, ... need root)", "rate": "1gbit"}


@pytest.mark.multiproc
def test_demo_says_first_that_the_link_is_emulated(tmp_path):
    """A small emulated demo (the CNN, one epoch, BSP and OSP auto once each): the first lines say there is no shaped
    network and what the emulated link is; the table gives each ratio with 'one run: no spread'."""
    import os

    root = os.path.dirname(launch.HERE)
    p = launch.run_cmd([launch.PY, os.path.join(root, "scripts", "demo.py"), "--emulate", "--repeats", "1",
                        "--contenders", "bsp,osp-auto", "--model", "cnn", "--width", "1", "--batch-size", "32",
                        "--epochs", "1", "--eval-every", "1", "--out", str(tmp_path)], timeout=240)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert lines[0] == "No shaped network for this demo: asked for with --emulate.", lines[:3]
    assert "emulated link: 1 Gbit/s, 0 us per collective (user space; not a real network)" in lines[1], lines[:3]
    assert "docs/benchmarks.md" in p.stdout
    row = next(ln for ln in lines if ln.startswith("| osp critical=auto | 2 | 1 |"))
    assert "(one run: no spread)" in row, row
    assert sorted(f for f in os.listdir(tmp_path) if f.endswith(".json")) == ["bsp-1.json", "osp-auto-1.json"]


# OSP's step() work as auto's Meter measures it: the stage-2 wait at the next step() is the network's
WORK_WORKER = r'''
import json, os, sys, time
import torch
import torch.distributed as dist
import osp
from osp import linkemu
dist.init_process_group("gloo", init_method="file://" + os.environ["OSP_TEST_STORE"],
                        rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
torch.manual_seed(0)
model = torch.nn.Linear(1000, 1000)  # 4 MB of gradient: stage 2 at 0.25 carries 3 MB, 240 ms at 100 Mbit/s
opt = osp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model.named_parameters(),
                               sync=osp.OSP(critical=0.25, block_size=4096))
x = torch.ones(4, 1000)
linkemu.install(linkemu.Link(1e8, 1e-3))
works, waits, walls = [], [], []
for _ in range(5):
    opt.zero_grad()
    model(x).sum().backward()
    t0 = time.perf_counter()
    opt.step()
    walls.append(time.perf_counter() - t0)
    rec = opt.last_step()
    works.append(opt.mode.meter.figures()["work_ms"] / 1e3)  # the step before this one's
    waits.append(rec["stage2_wait_s"])
opt.flush()
linkemu.uninstall()
json.dump({"works": works, "waits": waits, "walls": walls}, open(sys.argv[1] + "." + str(dist.get_rank()), "w"))
dist.destroy_process_group()
'''


@pytest.mark.multiproc
def test_osp_step_work_leaves_out_the_wait_for_the_last_stage_2(tmp_path):
    """The last step's stage 2 (240 ms on the emulated link) is waited for at the next step(): auto's model has
    that on the link, so the work it is fed (step()'s time less its waits) must not hold it too, or OSP's step is
    predicted with the transfer counted twice (the meter's work was 214 ms where the stage-2 wait was most of it)."""
    out = str(tmp_path / "work")
    launch.check(launch.run("spawn", 2, ["-c", WORK_WORKER, out], timeout=180))
    for rank in range(2):
        r = json.loads(open(f"{out}.{rank}").read())
        assert min(r["waits"][2:]) > 0.15, r  # from the third step (the first defers) the transfer is waited for
        # the work the meter reports (the step before's) is step()'s time less its waits: never the stage-2 wait
        # too (how long step()'s own work takes is the host's: no bound on it)
        for i in range(3, 5):
            assert r["works"][i] <= max(r["walls"][j] - r["waits"][j] for j in (i - 1, i)) + 0.005, (i, r)
