"""A parameter only one rank's backward reaches, from the first step on (tests/test_replicas.py), in every mode
of the conformance tables on 2 ranks: no collective mismatch (a rank whose backward missed a parameter starts
that bucket at step(), so the replica check must not stand between), and the replicas end equal. argv: backend,
outdir."""
import os
import sys

import torch
from ranks import check, save, shutdown, start

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import conformance as C  # noqa: E402

backend, outdir = sys.argv[1], sys.argv[2]
comm = start(backend)


def body(env, t):
    env.zero_grad()
    env.backward(t, branch=(env.rank == 1))
    env.step(t)


C.PATTERNS["branch-rank-1-only"] = C.Pattern("branch-rank-1-only", body)
for mode in sorted(m for m in C.MODES if not m.endswith("closure")):
    for optimizer in ("sgd-momentum", "adamw"):
        env = C.Env(C.Case(mode, "branch-rank-1-only", optimizer), wrapped=True, backend=backend, rank=comm.rank)
        for t in range(4):
            body(env, t)
        env.flush()
        mine = [p.detach().clone() for p in env.model.parameters()] + [t for _, t in env.state()]
        equal = all(torch.equal(a, b) for other in comm.allgather_object(mine) for a, b in zip(other, mine))
        check(f"{mode}|{optimizer}", equal, "replicas or optimizer state differ")
save(outdir)
shutdown(backend)
