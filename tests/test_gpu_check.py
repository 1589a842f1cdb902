"""`make gpu-check` (scripts/gpu_check.py) where there is no GPU: it prints its plan and why it cannot run,
builds nothing and exits 2; --list prints the plan and exits 0; the Makefile rule needs no install. And its
parts that run on the GPU host only, here on stand-ins: pytest's JUnit counts, a step that runs past its
time, the report and its summary when a step fails."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.py"
STEP_NAMES = ["preflight", "build", "tests", "bench", "report"]


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_script(*args, env=None):
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120, env=env)


def assert_plan(out):
    for i, name in enumerate(STEP_NAMES, 1):
        assert re.search(rf"^\s+{i}\. {name}\s", out, re.M), f"step {i} ({name}) missing from the plan:\n{out}"


def outputs():
    """What a run would leave behind: the results file, the extension's builds, the logs."""
    paths = [ROOT / "bench" / "results" / "gpu.json", *map(Path, glob.glob(str(ROOT / "python" / "osp" / "_C*.so"))),
             ROOT / "build" / "gpu-check"]
    return {str(p): (p.stat().st_mtime_ns if p.exists() else None) for p in paths}


def test_without_a_gpu_it_prints_the_plan_and_why_and_exits_2():
    """CUDA_VISIBLE_DEVICES="" hides any GPU, so this holds on a GPU host too (where the check would
    otherwise run for minutes)."""
    before = outputs()
    proc = run_script(env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert_plan(proc.stdout)
    assert "gpu-check cannot run here:" in proc.stdout
    reasons = re.findall(r"^  - (.*)$", proc.stdout, re.M)
    assert reasons and any("CUDA" in r for r in reasons), proc.stdout
    assert "Nothing was built or run" in proc.stdout
    assert "== 2/5" not in proc.stdout, "a step after the preflight ran"
    assert outputs() == before, "something was built or written"


def test_list_prints_the_plan_and_exits_0():
    proc = run_script("--list", env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert_plan(proc.stdout)
    assert "cannot run" not in proc.stdout


def test_only_refuses_an_unknown_step():
    proc = run_script("--list", "--only", "tests,lint")
    assert proc.returncode == 2 and "unknown step(s) ['lint']" in proc.stderr


def makefile_rules():
    """target -> (prerequisites, target-specific assignments, recipe lines), from the Makefile's text."""
    rules, current = {}, None
    for line in (ROOT / "Makefile").read_text().replace("\\\n", " ").split("\n"):
        if line.startswith("\t"):
            if current is not None:
                current[2].append(line.strip())
            continue
        current = None
        m = re.match(r"^([A-Za-z0-9_.-][^:=#]*?)\s*:(?![=:])(.*)$", line)
        if not m:
            continue
        rest = m.group(2).split("#")[0]
        for target in m.group(1).split():
            rule = rules.setdefault(target, ([], [], []))
            if re.match(r"^\s*[A-Za-z_][A-Za-z0-9_]*\s*(\?|:|\+|!)?=", rest):  # gpu-check: PY = ...
                rule[1].append(rest.strip())
            else:
                rule[0].extend(w for w in rest.split() if w != "|")
                current = rule
    return rules


def test_the_makefile_rule_needs_no_install():
    rules = makefile_rules()
    assert "gpu-check" in rules, "no gpu-check rule in the Makefile"
    assert "gpu-check" in rules[".PHONY"][0]
    seen, todo = set(), ["gpu-check"]
    while todo:  # gpu-check and everything it depends on
        t = todo.pop()
        if t in seen or t not in rules:
            continue
        seen.add(t)
        todo += rules[t][0]
    assert "install" not in seen, f"gpu-check depends on install through {sorted(seen)}"
    prereqs, assigns, recipe = rules["gpu-check"]
    assert any("scripts/gpu_check.py" in line and "$(PY)" in line for line in recipe), recipe
    assert not any("install" in line for line in recipe), recipe
    assert any(a.startswith("PY") and "python3" in a and ".venv/bin/python" in a.replace("$(VENV)", ".venv")
               for a in assigns), f"PY should fall back to python3 without a .venv: {assigns}"


def test_make_runs_the_script_with_the_python_given():
    """make -n prints what the rule runs, without running it: PY=... chooses the python."""
    proc = subprocess.run(["make", "-n", "gpu-check", "PY=/some/python3", 'GPU_CHECK_ARGS=--only tests'], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "/some/python3 scripts/gpu_check.py --only tests" in proc.stdout
    assert "install" not in proc.stdout


# -- the parts that run on the GPU host, on stand-ins -----------------------------------------------------


@pytest.fixture
def gpu_check(tmp_path, monkeypatch):
    mod = load_gpu_check()
    monkeypatch.setattr(mod, "WORK", str(tmp_path / "work"))
    return mod


def test_test_runs_are_counted_from_junit(gpu_check, tmp_path, monkeypatch):
    """The tests step runs pytest, keeps going past failures, and counts from the JUnit XML: passed,
    failed, skipped with its reason, and the properties a test records (agreement_reads)."""
    t = tmp_path / "test_stand_in.py"
    t.write_text(textwrap.dedent('''
        import pytest

        def test_passes(record_property):
            record_property("agreement_reads", 8)

        def test_fails():
            assert 1 == 2, "wrong on purpose"

        @pytest.mark.skip(reason="no CUDA device")
        def test_skipped():
            pass
    '''))
    monkeypatch.setattr(gpu_check, "TEST_RUNS", [("stand-in", [str(t)], 120),
                                                 ("again", [str(t), "-k", "passes"], 120)])
    res = gpu_check.step_tests()
    first, second = res["runs"]
    assert res["status"] == "FAIL" and first["status"] == "FAIL" and second["status"] == "PASS"
    assert (first["tests"], first["passed"], first["failed"], first["skipped"]) == (3, 1, 1, 1), first
    assert first["skip_reasons"] == {"no CUDA device": 1}
    assert any("test_fails" in f and "wrong on purpose" in f for f in first["failures"]), first["failures"]
    assert first["properties"] == [dict(test=first["properties"][0]["test"], agreement_reads="8")]
    assert first["detail"] == "1 passed, 1 failed, 0 errors, 1 skipped"
    assert os.path.exists(first["junit"] if os.path.isabs(first["junit"]) else ROOT / first["junit"])


def test_a_step_past_its_time_is_killed(gpu_check, tmp_path):
    log = tmp_path / "slow.log"
    rc, secs = gpu_check.run_logged([sys.executable, "-c", "import time; print('started', flush=True); "
                                                           "time.sleep(60)"], str(log), timeout=2)
    assert rc is None and secs < 30
    text = log.read_text()
    assert "started" in text and "killed after 2 s" in text


def test_the_report_and_its_summary(gpu_check, tmp_path, monkeypatch, capsys):
    """With the preflight passing and one step failing: every step runs, gpu.json has each step's status
    and seconds, the summary table says which failed, and the exit status is 1."""
    info = dict(python=sys.executable, python_version="3.x", host="h", torch="2.11.0+cu130", torch_cuda="13.0",
                device="NVIDIA Stand-in", capability="9.0", devices=1, memory_gib=139.8, driver="580",
                nvcc="/usr/local/cuda/bin/nvcc", nvcc_version="13.0")
    monkeypatch.setattr(gpu_check, "preflight", lambda: (info, []))
    monkeypatch.setattr(gpu_check, "step_build", lambda info: dict(name="build", status="PASS", seconds=1.0,
                                                                   detail="osp._C with CUDA kernels for sm_90"))
    run = dict(run="test_cuda.py", status="FAIL", seconds=2.0, detail="1 passed, 1 failed, 0 errors, 0 skipped",
               properties=[dict(test="t::x", agreement_reads="8")])
    monkeypatch.setattr(gpu_check, "step_tests", lambda: dict(name="tests", status="FAIL", seconds=2.0,
                                                              detail="1 passed, 1 failed", runs=[run]))
    peak = dict(gbps=4800.0, source="theoretical", copy_gbps=4000.0, copy_bytes=1 << 30)
    rows = [dict(op="score+split", n=1 << 26, size="64M", dtype="float32", gbps=3000.0, x_copy_=0.75, x_peak=0.62,
                 x_torch=10.0)]
    launch = [dict(op="split_blocks", block_size=bs, n=100 << 20, ms=ms, gbps=1.0, x_copy_=0.9, x_peak=0.8,
                   x_time_vs_bs4096=ms / 0.25) for bs, ms in (("whole tensor", 0.3), ("4096", 0.25))]
    monkeypatch.setattr(gpu_check, "step_bench", lambda: dict(name="bench", status="PASS", seconds=3.0, detail="",
                                                              kernels=dict(peak=peak, rows=rows,
                                                                           launch_shape=launch)))
    out = tmp_path / "gpu.json"
    assert gpu_check.main(["--out", str(out)]) == 1
    report = json.loads(out.read_text())
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("preflight", "PASS"), ("build", "PASS"), ("tests", "FAIL"), ("bench", "PASS"), ("report", "PASS")]
    assert all(isinstance(s["seconds"], float) for s in report["steps"])
    assert report["host"]["device"] == "NVIDIA Stand-in" and report["agreement_reads"][0]["agreement_reads"] == "8"
    text = capsys.readouterr().out
    assert "| tests | FAIL |" in text and "| score+split | 64M | float32 | 3000 |" in text
    assert "| split_blocks | whole tensor | 0.30 |" in text and "gpu-check: FAIL (tests)" in text
    # --only: the steps left out are skipped, not failed
    assert gpu_check.main(["--out", str(out), "--only", "build"]) == 0
    assert [s["status"] for s in json.loads(out.read_text())["steps"]] == ["PASS", "PASS", "SKIP", "SKIP", "PASS"]


def test_the_kernel_report_has_what_the_summary_reads(tmp_path):
    """bench/kernels.py --report on the CPU, tiny and short (not a measurement): the fields gpu_check reads."""
    report = tmp_path / "k.json"
    proc = subprocess.run([sys.executable, "bench/kernels.py", "--device", "cpu", "--sizes", "64K", "--dtypes",
                           "float32", "--reps", "1", "--min-time", "0", "--peak", "measure", "--peak-bytes", "4M",
                           "--launch-elements", "64K", "--json", str(tmp_path / "rows.json"), "--report",
                           str(report)], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "python")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    k = json.loads(report.read_text())
    assert k["peak"]["gbps"] > 0 and "measured" in k["peak"]["source"]
    assert {"op", "n", "size", "dtype", "gbps", "x_copy_", "x_peak", "x_torch"} <= set(k["rows"][0])
    assert [(r["op"], r["block_size"]) for r in k["launch_shape"]] == [
        ("score_blocks l2", "whole tensor"), ("split_blocks", "whole tensor"), ("score_blocks l2", "4096"),
        ("split_blocks", "4096")]
    assert {"ms", "gbps", "x_copy_", "x_peak", "x_time_vs_bs4096"} <= set(k["launch_shape"][0])
    assert json.loads((tmp_path / "rows.json").read_text()) == k["rows"]
