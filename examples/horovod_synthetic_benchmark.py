"""A Horovod user's synthetic benchmark, as Horovod's examples/pytorch/pytorch_synthetic_benchmark.py is laid
out (arguments, the optimizer wrapped with compression/op, Horovod's broadcasts, warm-up, timed iterations of
several batches, images per second per rank with a 95% interval and in total). Written for osp, not copied
from Horovod. Horovod's takes a torchvision model; torchvision does not load beside this project's torch, so
the models are the throughput bench's (bench/models.py: mlp, resnet18, gpt).

``--optimizer hvd`` wraps with ``hvd.DistributedOptimizer``; any other value is the one-line swap to
``osp.DistributedOptimizer`` with that mode (and ``opt.flush()`` before the parameters are read at the end):

    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod_synthetic_benchmark.py --optimizer osp-auto

The figures are what Horovod's prints; for ratios against DDP and the perfect-overlap bound behind a shaped
link use bench/train_throughput.py, which runs every contender side by side.
"""
import argparse
import os
import sys
import timeit

import horovod.torch as hvd
import numpy as np
import torch

import osp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "bench"))
import models  # noqa: E402  (bench/models.py)

MODES = {"bsp": lambda: osp.BSP(), "osp-auto": lambda: osp.OSP(critical="auto"),
         "osp-0.25": lambda: osp.OSP(critical=0.25), "dsync-2": lambda: osp.DSync(delay=2)}

parser = argparse.ArgumentParser(description="Horovod-style synthetic benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
parser.add_argument("--optimizer", default="osp-auto", choices=["hvd", *MODES])
parser.add_argument("--fp16-allreduce", action="store_true", help="compression=hvd.Compression.fp16")
parser.add_argument("--model", default="mlp", choices=models.MODELS)
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
parser.add_argument("--num-warmup-batches", type=int, default=10, help="batches before timing")
parser.add_argument("--num-batches-per-iter", type=int, default=10, help="batches per timed iteration")
parser.add_argument("--num-iters", type=int, default=10, help="timed iterations")
parser.add_argument("--use-adasum", action="store_true", help="op=hvd.Adasum")


def main(args):
    hvd.init()
    torch.set_num_threads(1)
    model, make_batch, loss_fn = getattr(models, args.model)()
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * lr_scaler)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    wrap_args = dict(named_parameters=model.named_parameters(), compression=compression,
                     op=hvd.Adasum if args.use_adasum else hvd.Average)
    if args.optimizer == "hvd":
        optimizer = hvd.DistributedOptimizer(optimizer, **wrap_args)
    else:  # the swap
        optimizer = osp.DistributedOptimizer(optimizer, sync=MODES[args.optimizer](), **wrap_args)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data, target = make_batch(args.batch_size, torch.Generator().manual_seed(hvd.rank()))

    def benchmark_step():
        optimizer.zero_grad()
        loss_fn(model(data), target).backward()
        optimizer.step()

    def log(s):
        if hvd.rank() == 0:
            print(s, flush=True)

    log(f"Model: {args.model}, batch size: {args.batch_size}, ranks: {hvd.size()}, optimizer: {args.optimizer}")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    img_secs = []
    for x in range(args.num_iters):
        t = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / t
        log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
        img_secs.append(img_sec)
    if isinstance(optimizer, osp.DistributedOptimizer):
        optimizer.flush()  # the last exact updates, before the parameters are read
    mean, conf = np.mean(img_secs), 1.96 * np.std(img_secs)
    log(f"Img/sec per rank: {mean:.1f} +-{conf:.1f}")
    log(f"Total img/sec on {hvd.size()} rank(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")
    # the replicas agree at the end (what Horovod's example takes on trust)
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    agree = all(torch.equal(flat, f) for f in hvd.allgather_object(flat))
    log(f"replicas bitwise equal: {agree}")
    hvd.shutdown()


if __name__ == "__main__":
    main(parser.parse_args())
