"""Two real ranks: pack selected blocks, allreduce-average, unpack (Horovod Gloo and torch Gloo)."""
import json
import os

import pytest

import launch

pytestmark = pytest.mark.multiproc


@pytest.mark.parametrize("backend", ["horovod", "torch"])
def test_pack_allreduce_unpack_two_ranks(backend, tmp_path):
    out = tmp_path / "result.json"
    proc = launch.run(backend, 2, [os.path.join(launch.HERE, "workers", "pack_allreduce.py"),
                                   backend, str(out)])
    launch.check(proc)
    res = json.loads(out.read_text())
    assert res["size"] == 2 and res["backend"] == backend
    assert res["results"]["some"]["selected"] == 4 * 64 - 47  # block 10 is the short one (17 elems)
    assert res["results"]["none"]["selected"] == 0
    assert res["results"]["all"]["selected"] == 10 * 64 + 17
    for label, r in res["results"].items():
        assert r["avg_ok"], f"{label}: selected blocks differ from the full average"
        assert r["untouched_ok"], f"{label}: blocks that were not selected changed"
