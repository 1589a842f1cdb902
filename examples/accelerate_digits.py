"""Hugging Face Accelerate with osp's optimizer doing the averaging, on scikit-learn's digits.

``Accelerator.prepare(model)`` wraps a multi-process model in DistributedDataParallel, and no option of it turns
that off; ``prepare_model(model, evaluation_mode=True)`` places the model (and its autocast forward) without the
wrapper, which is what osp needs: its optimizer averages the gradients itself. The rest is Accelerate as usual
(sharded DataLoaders, ``accumulate``, ``backward``, a prepared optimizer and scheduler, ``save_state``), with four
osp rules: the parameters come from rank 0 once (DDP's constructor did that), ``backward_passes_per_step`` is the
accumulation, clipping is ``opt.clip_grad_norm_`` (Accelerate's clips each rank's own ``.grad``), and ``opt.flush()``
runs on every rank before evaluating and saving. ``save_state(..., safe_serialization=False)``: safetensors keeps one
tensor per storage, and osp's parameters are views of one flat buffer.

    ACCELERATE_USE_CPU=1 torchrun --nproc-per-node 2 examples/accelerate_digits.py --sync osp-auto
"""
import argparse
import json
import tempfile

import torch
import torch.nn.functional as F
from accelerate import Accelerator

import osp
from osp.train import load_digits_split

MODES = {"bsp": lambda: osp.BSP(), "osp-auto": lambda: osp.OSP(critical="auto", block_size=256),
         "osp-0.25": lambda: osp.OSP(critical=0.25, block_size=256), "dsync-2": lambda: osp.DSync(delay=2)}

parser = argparse.ArgumentParser(description="Accelerate + osp on digits")
parser.add_argument("--sync", default="osp-auto", choices=sorted(MODES) + ["ddp"],
                    help="an osp mode, or ddp: Accelerate's own DDP path with the plain optimizer, to compare")
parser.add_argument("--epochs", type=int, default=8)
parser.add_argument("--batch-size", type=int, default=32, help="per rank")
parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
parser.add_argument("--mixed-precision", default="no", choices=["no", "bf16"])
parser.add_argument("--checkpoint-dir", default=None, help="save_state here after every epoch (a temp dir if unset)")
parser.add_argument("--json", default=None, help="rank 0 writes its figures here")
parser.add_argument("--save-params", default=None, help="rank 0 saves the final parameters here (torch.save)")
args = parser.parse_args()

acc = Accelerator(gradient_accumulation_steps=args.accumulate, mixed_precision=args.mixed_precision)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
DDP = args.sync == "ddp"
osp.teardown.register()  # osp's exit hook also for the DDP path, which makes no osp communicator to register it
if DDP:
    model = acc.prepare_model(model)  # DistributedDataParallel
else:
    model = acc.prepare_model(model, evaluation_mode=True)  # the device and autocast, not DDP
    osp.broadcast_parameters(model.state_dict(), root_rank=0)
x_train, y_train, x_test, y_test = load_digits_split(0)
train = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_train, y_train), batch_size=args.batch_size,
                                    shuffle=True, drop_last=True)
test = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x_test, y_test), batch_size=256)
train, test = acc.prepare(train, test)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
if not DDP:
    opt = osp.DistributedOptimizer(opt, named_parameters=model.named_parameters(), sync=MODES[args.sync](),
                                   backward_passes_per_step=args.accumulate)
prepared = acc.prepare_optimizer(opt)  # steps and zero_grads only where accumulate() says the step is due
sched = acc.prepare_scheduler(torch.optim.lr_scheduler.StepLR(opt, step_size=50, gamma=0.5))
ckdir = args.checkpoint_dir or tempfile.mkdtemp(prefix="osp-accelerate-")

for epoch in range(args.epochs):
    model.train()
    for x, y in train:
        with acc.accumulate(model):
            acc.backward(F.cross_entropy(model(x), y))
            if acc.sync_gradients and DDP:
                acc.clip_grad_norm_(model.parameters(), 1.0)
            elif acc.sync_gradients:
                opt.clip_grad_norm_(1.0)  # the averaged gradient's norm, exactly, in every mode
            prepared.step()
            sched.step()
            prepared.zero_grad()
    if not DDP:
        opt.flush()  # every rank: the exact weights before evaluating and saving
    model.eval()
    correct = torch.zeros(2, device=acc.device)
    with torch.no_grad():
        for x, y in test:
            x, y = acc.gather_for_metrics((model(x).argmax(1), y))  # without the padding of uneven shards
            correct += torch.stack([(x == y).sum(), torch.tensor(len(y), device=acc.device)])
    accuracy = correct[0].item() / correct[1].item()
    acc.save_state(ckdir, safe_serialization=False)
    acc.print(f"epoch {epoch}: test accuracy {accuracy:.4f}")

flat = torch.cat([p.detach().flatten() for p in model.parameters()])
replicas = acc.gather(flat[None])
result = {"sync": args.sync, "ranks": acc.num_processes, "steps": None if DDP else opt.stats()["steps"],
          "accuracy": accuracy, "tested": int(correct[1].item()), "lr": sched.get_last_lr()[0],
          "model_wrapped": type(model).__name__, "replicas_bitwise": bool((replicas == replicas[0]).all()),
          "in_flight": False if DDP else opt.in_flight}
acc.print(json.dumps(result))
if args.save_params and acc.is_main_process:
    torch.save(flat, args.save_params)
if args.json and acc.is_main_process:
    with open(args.json, "w") as f:
        json.dump(result, f)
acc.wait_for_everyone()
if DDP:  # DDP's reducer holds the process group: release it, or Gloo's threads outlive the script (docs/faults.md)
    acc.free_memory()
    del model, prepared, opt, sched
acc.end_training()
