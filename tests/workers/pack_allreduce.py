"""Rank program: pack selected blocks, allreduce-average them, unpack; check against a full average.

Usage: pack_allreduce.py BACKEND OUT_JSON
"""
import json
import sys

import torch

from osp import ops
from osp.launcher import init_from_env

backend, out = sys.argv[1], sys.argv[2]
c = init_from_env(backend)
rank, size = c.rank, c.size
bs = 64
n = 10 * bs + 17  # 11 blocks, the last one short
torch.manual_seed(1234 + rank)
flat = torch.randn(n)
original = flat.clone()
full = flat.clone()
c.allreduce_avg_(full, "full")
results = {}
for label, ids in {"some": [7, 10, 0, 3], "none": [], "all": list(range(10, -1, -1))}.items():
    f = original.clone()
    ids_t = torch.tensor(ids, dtype=torch.int64)
    buf = ops.pack_blocks(f, ids_t, bs)
    c.allreduce_avg_(buf, f"stage.{label}")
    ops.unpack_blocks(buf, ids_t, bs, f)
    sel = torch.zeros(n, dtype=torch.bool)
    for b in ids:
        sel[b * bs:(b + 1) * bs] = True
    avg_ok = torch.allclose(f[sel], full[sel], rtol=1e-6, atol=1e-7)
    untouched_ok = torch.equal(f[~sel], original[~sel])
    results[label] = {"avg_ok": bool(avg_ok), "untouched_ok": bool(untouched_ok),
                      "selected": int(sel.sum())}
if rank == 0:
    with open(out, "w") as fh:
        json.dump({"size": size, "backend": c.name, "results": results}, fh)
ok = all(r["avg_ok"] and r["untouched_ok"] for r in results.values())
sys.exit(0 if ok else 1)
