"""Horovod 0.28.1's own PyTorch tests (test/parallel/test_torch.py, vendored unmodified in tests/third_party/horovod/)
against ``osp.horovod``: ``import horovod.torch as hvd`` resolves to it, 2 ranks under torchrun, CPU
(tests/workers/hvd_upstream_runner.py).

``make test`` runs the tests that expected.json lists as passed or refused (measured: table.py --write-expected),
in the file's order, and holds each to its outcome on both ranks: a pass must pass, a refusal must be refused with
its message. The whole file (115 tests, a few minutes: the tests osp.horovod fails include Gloo aborts, each a fresh
launch, and collectives a peer never joins, each a 10 s timeout) runs with ``make horovod-upstream``, which also
regenerates docs/horovod-tests.md."""
import hashlib
import importlib.util
import json
import os
import re

import pytest

import launch

RUNNER = os.path.join(launch.HERE, "workers", "hvd_upstream_runner.py")
VENDOR = os.path.join(launch.HERE, "third_party", "horovod")


def _runner():
    spec = importlib.util.spec_from_file_location("hvd_upstream_runner", RUNNER)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _expected() -> dict:
    with open(os.path.join(VENDOR, "expected.json")) as f:
        return json.load(f)["tests"]


def test_the_vendored_files_are_horovods_unmodified():
    # git's blob ids of Horovod v0.28.1's files (tests/third_party/horovod/README.md)
    blobs = {"test/parallel/test_torch.py": "2b1ed470b1d97b8298819dc9bfacb5d1aae28331",
             "test/utils/common.py": "77871c456a4fce06236013271fb10d59563bd240",
             "LICENSE": "51fe616cb02e607a6a96a7d819682810bfba2e1f"}
    for path, blob in blobs.items():
        with open(os.path.join(VENDOR, path), "rb") as f:
            data = f.read()
        assert hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() == blob, path


def test_expected_covers_every_test_of_the_file():
    # a test added to (or renamed in) the vendored file must be measured into expected.json
    assert list(_expected()) == _runner().list_tests()


@pytest.mark.multiproc
@pytest.mark.jobs
def test_horovods_own_torch_tests_pass_on_osp_horovod(tmp_path):
    runner, expected = _runner(), _expected()
    names = [n for n, e in expected.items() if e["class"] in ("passed", "refused")]
    log = []
    res = runner.drive(str(tmp_path), names, nproc=2, timeout=240, test_timeout=60, pg_timeout=10,
                       env={"CUDA_VISIBLE_DEVICES": ""}, log=log.append)
    summary = runner.summary(res)
    print("\n".join(log + [summary]))
    assert res["horovod_modules"] == [], f"a real Horovod was imported: {res['horovod_modules']}"
    problems = []
    for n in names:
        want, got = expected[n], res["tests"][n]
        if want["class"] == "passed":
            statuses = [o["status"] if o else None for o in got["ranks"]]
            if got["class"] != "passed" or statuses != ["passed", "passed"]:
                problems.append(f"{n}: expected passed on both ranks, got {got['class']} {statuses}: {got['reason']}")
        elif got["class"] != "refused" or not re.search(want["pattern"], got["reason"]):
            problems.append(f"{n}: expected refused /{want['pattern']}/, got {got['class']}: {got['reason']}")
    assert not problems, f"{summary}\n" + "\n".join(problems)
