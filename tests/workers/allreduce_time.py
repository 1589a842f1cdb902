"""Rank program: time one allreduce of N float32 over torch.distributed (Gloo); rank 0 writes JSON."""
import json
import sys
import time

import torch
import torch.distributed as dist

n, out = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
t = torch.ones(n)
dist.all_reduce(torch.ones(1))  # connect first
t0 = time.perf_counter()
dist.all_reduce(t)
dt = time.perf_counter() - t0
if dist.get_rank() == 0:
    with open(out, "w") as fh:
        json.dump({"seconds": dt, "value": float(t[0]), "size": dist.get_world_size()}, fh)
dist.destroy_process_group()
