"""osp.profile repeats its measurements and says how much they varied (a busy host's profile warns, osp.plan refuses
an extreme one), and ``python -m osp.profile`` runs from any directory on the models the installed package holds."""
import json
import math
import os
import subprocess
import sys
import time

import pytest
import torch

from osp.plan import EXTREME, Cluster, plan
from osp.profile import MODELS, MODES, NoisyProfileWarning, profile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
ENV = {**os.environ, "PYTHONPATH": os.path.join(ROOT, "python")}  # the package, not the checkout's root


def tiny(batch=16):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 10))
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(batch, 32, generator=g), torch.randint(0, 10, (batch,), generator=g))
    return model, (lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1])), data


QUIET = pytest.mark.filterwarnings("ignore::osp.profile.NoisyProfileWarning")  # a tiny model on a busy host


@QUIET
def test_the_profile_holds_the_spread_of_every_time(tmp_path):
    model, loss_fn, batch = tiny()
    out = tmp_path / "p.json"
    p = profile(model, loss_fn, batch, out=str(out), steps=2, warmup=1, repeats=2, bucket_mb=0.001)
    assert json.loads(out.read_text()) == json.loads(json.dumps(p))
    assert p["version"] == 2 and p["repeats"] == 2 and p["steps"] == 2 and p["warmup"] == 1
    for name, m in p["modes"].items():
        assert set(m["spread"]) == {"forward_s", "backward_s", "step_s", "iteration_s"}, name
        assert all(s >= 0 for s in m["spread"].values()), (name, m)
        assert m["iteration_s"] > 0
    assert len(p["buckets"]) >= 2 and all(b["spread"] >= 0 for b in p["buckets"])
    assert p["noise"] == max(m["spread"]["iteration_s"] for m in p["modes"].values())
    assert p["modes"][p["noisiest"]]["spread"]["iteration_s"] == p["noise"]
    # medians of ready times measured inside each iteration's backward stay inside BSP's backward
    assert max(b["ready_s"] for b in p["buckets"]) <= p["modes"]["bsp"]["backward_s"]
    assert plan(p, Cluster(2, 1e9), max_noise=math.inf)[0]["noise"] == p["noise"]


def test_a_noisy_host_warns_and_the_plan_refuses_an_extreme_profile():
    """A slow spell over the first repetition: every forward of its modes stalls 20 ms (the host was busy then),
    none of the second's. The iterations vary by far more than half, whatever the profile averages: a value
    spans at least ``MIN_SAMPLE_S`` of consecutive iterations, and a spell that long is the host's."""
    model, loss_fn, batch = tiny()
    seen = []  # every repetition of every mode runs on a copy of the model of its own

    def stalling(m, b):
        if not any(m is x for x in seen):
            seen.append(m)
        if next(i for i, x in enumerate(seen) if m is x) < len(MODES):
            time.sleep(0.02)
        return loss_fn(m, b)

    with pytest.warns(NoisyProfileWarning, match=r"the host is noisy: \w+'s iterations .* varied by \d+%.*osp.plan "
                                                 r"refuses a profile noisier than 50%"):
        p = profile(model, stalling, batch, steps=4, warmup=1, repeats=2)
    assert p["noise"] > EXTREME
    with pytest.raises(ValueError, match="too noisy to plan from"):
        plan(p, Cluster(2, 1e9))


@QUIET
def test_a_short_iteration_is_timed_as_the_mean_of_enough_of_them():
    """A model of a fraction of a millisecond: each timed value is the mean of consecutive iterations spanning
    ``MIN_SAMPLE_S`` (at most ``MAX_PER``: its own scheduling jitter is not the host's noise), and there are
    ``steps`` of them; after a warm-up of ``MIN_WARMUP_S`` at least, whose last iteration sets how many."""
    from osp.profile import MAX_PER, MAX_WARMUP, MIN_SAMPLE_S, MIN_WARMUP_S, _time_mode
    model, loss_fn, batch = tiny(batch=2)
    calls = [0]

    def counted(m, b):
        calls[0] += 1
        return loss_fn(m, b)

    t0 = time.perf_counter()
    out = _time_mode("plain", model, counted, batch, None, steps=3, warmup=1, bucket_mb=25.0)
    took = time.perf_counter() - t0
    assert len(out["forward_s"]) == len(out["backward_s"]) == len(out["step_s"]) == 3, out
    warm = calls[0] - 3 * out["per"]
    assert out["per"] > 1 and warm > 1, (out["per"], calls)  # the warm-up ran on past its one iteration
    assert warm == MAX_WARMUP or took >= MIN_WARMUP_S, (warm, took)  # for MIN_WARMUP_S, or MAX_WARMUP of them
    # a value of ``per`` iterations spans MIN_SAMPLE_S about (the last warm-up iteration's length sets ``per``)
    iteration = sum(out[k][0] for k in ("forward_s", "backward_s", "step_s"))
    assert out["per"] == MAX_PER or out["per"] * iteration > MIN_SAMPLE_S / 4, (out["per"], iteration)
    one = _time_mode("plain", model, loss_fn, batch, None, steps=2, warmup=0, bucket_mb=25.0)
    assert one["per"] == 1 and len(one["forward_s"]) == 2  # no warm-up: nothing to size it by, one a value


def test_the_spread_is_the_larger_of_the_iqr_and_the_repetitions_range():
    from osp.profile import _spread

    assert _spread([[1.0, 1.0, 1.0], [1.0, 1.0, 1.0]]) == 0.0
    # a slow spell covering one repetition: the IQR of all six is 0.5, the medians' range 1.0, the median 1.5
    assert _spread([[1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]) == pytest.approx(1.0 / 1.5)
    # jitter inside each repetition, none between them: quartiles 1.25 and 2.75 of 1, 1, 2, 2, 3, 3, median 2
    assert _spread([[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]) == pytest.approx(1.5 / 2.0)


def test_python_m_osp_profile_runs_from_any_directory(tmp_path):
    """The models --model names come from the installed package, not from bench/ in the working directory."""
    got = subprocess.run([sys.executable, "-m", "osp.profile", "--model", "mlp", "--batch", "2", "--steps", "1",
                          "--warmup", "0", "--repeats", "1", "--out", "p.json"], cwd=tmp_path, env=ENV,
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr
    p = json.loads((tmp_path / "p.json").read_text())
    assert p["model"] == "mlp" and p["batch"] == 2 and p["params"] == 8344552  # the bench's MLP
    assert p["noise"] is None and "noise unknown (one timed iteration a mode) -> p.json" in got.stdout


def test_an_unknown_model_names_the_choices_once(tmp_path):
    for spec, what in (("nosuch", "unknown model 'nosuch': expected one of mlp, digits-mlp, digits-cnn"),
                       ("nosuch_pkg.mod:build", "cannot load 'build' from 'nosuch_pkg.mod'")):
        got = subprocess.run([sys.executable, "-m", "osp.profile", "--model", spec, "--batch", "2", "--out",
                              "p.json"], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=300)
        assert got.returncode == 2 and what in got.stderr, got.stderr
        assert got.stderr.count("osp.profile:") == 1, got.stderr


def returns_a_module(batch):
    return torch.nn.Linear(2, 2)


def returns_two(batch):
    return torch.nn.Linear(2, 2), None


def raises(batch):
    return {}["no such key"]  # the user's bug, on this line


def test_a_factory_that_raises_or_returns_the_wrong_thing_is_named(tmp_path, capsys):
    """Not 'cannot unpack non-iterable Linear object': what the factory returned, against what was expected; and
    what it raised keeps its type and the line that raised it."""
    from osp.profile import main
    line = raises.__code__.co_firstlineno + 1
    for attr, what in (("returns_a_module", "expected the factory to return (model, loss_fn, batch)"),
                       ("returns_a_module", "got Linear"),
                       ("returns_two", "got a tuple of 2"),
                       ("raises", f"the factory raised KeyError: 'no such key' (at {__file__}:{line}, in raises)"),
                       ("HERE", "expected a callable factory(batch_size)")):
        assert main(["--model", f"{__name__}:{attr}", "--batch", "2", "--out", str(tmp_path / "p.json")]) == 2
        err = capsys.readouterr().err
        assert what in err and err.count("osp.profile:") == 1, (attr, err)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_every_model_the_tool_offers_trains(name):
    model, loss_fn, batch = MODELS[name](3)
    loss = loss_fn(model, batch)
    loss.backward()
    assert loss.dim() == 0 and all(p.grad is not None for p in model.parameters())


def test_the_mlp_is_the_benchs():
    """``--model mlp`` profiles the model bench/train_throughput.py measures (docs/plan.md's validation)."""
    sys.path.insert(0, ROOT)
    try:
        from bench.models import build
    finally:
        sys.path.remove(ROOT)
    model, loss_fn, batch = MODELS["mlp"](5)
    bench_model, make_batch, bench_loss = build("mlp")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), bench_model.state_dict().values()))
    x, y = make_batch(5, torch.Generator().manual_seed(0))
    assert torch.equal(batch[0], x) and torch.equal(batch[1], y)
    assert torch.equal(loss_fn(model, batch), bench_loss(bench_model(x), y))
