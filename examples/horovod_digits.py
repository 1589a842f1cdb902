"""A Horovod user's training script, as Horovod's examples/pytorch/pytorch_mnist.py is laid out (arguments,
DistributedSampler, Horovod's broadcasts, the optimizer wrapped with compression/op/predivide, a test
averaged with hvd.allreduce), on scikit-learn's handwritten digits (8x8, shipped with the package) instead of
MNIST (a download). Written for osp, not copied from Horovod.

``--optimizer hvd`` wraps with ``hvd.DistributedOptimizer``; any other value is the one-line swap to
``osp.DistributedOptimizer`` with that mode, plus ``opt.flush()`` before each test (the last exact updates):

    horovodrun --gloo -np 2 -H localhost:2 python examples/horovod_digits.py --optimizer osp-auto
"""
import argparse

import horovod.torch as hvd
import torch
import torch.nn.functional as F
import torch.utils.data.distributed

import osp
from osp.train import load_digits_split

MODES = {"bsp": lambda: osp.BSP(), "osp-auto": lambda: osp.OSP(critical="auto"),
         "osp-0.25": lambda: osp.OSP(critical=0.25), "dsync-2": lambda: osp.DSync(delay=2)}

parser = argparse.ArgumentParser(description="Horovod-style digits example")
parser.add_argument("--optimizer", default="osp-auto", choices=["hvd", *MODES])
parser.add_argument("--batch-size", type=int, default=32, help="input batch size per rank for training")
parser.add_argument("--test-batch-size", type=int, default=1000)
parser.add_argument("--epochs", type=int, default=10)
parser.add_argument("--lr", type=float, default=0.1, help="learning rate (scaled by the number of ranks)")
parser.add_argument("--momentum", type=float, default=0.5)
parser.add_argument("--seed", type=int, default=42)
parser.add_argument("--log-interval", type=int, default=10)
parser.add_argument("--fp16-allreduce", action="store_true", help="compression=hvd.Compression.fp16")
parser.add_argument("--use-adasum", action="store_true", help="op=hvd.Adasum")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0)


class Net(torch.nn.Module):
    """Horovod's MNIST network, scaled to 8x8 images: two convolutions, 2-D dropout, two linear layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 10, kernel_size=3)
        self.conv2 = torch.nn.Conv2d(10, 20, kernel_size=2)
        self.conv2_drop = torch.nn.Dropout2d()
        self.fc1 = torch.nn.Linear(80, 50)
        self.fc2 = torch.nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(self.conv2_drop(self.conv2(x)))
        x = F.relu(self.fc1(x.flatten(1)))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def metric_average(val, name):
    return hvd.allreduce(torch.tensor(val), name=name).item()


def main(args):
    hvd.init()
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    x_train, y_train, x_test, y_test = load_digits_split()
    train_dataset = torch.utils.data.TensorDataset(x_train, y_train)
    test_dataset = torch.utils.data.TensorDataset(x_test, y_test)
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler)

    model = Net()
    lr_scaler = 1 if args.use_adasum else hvd.size()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    wrap_args = dict(named_parameters=model.named_parameters(), compression=compression,
                     op=hvd.Adasum if args.use_adasum else hvd.Average,
                     gradient_predivide_factor=args.gradient_predivide_factor)
    if args.optimizer == "hvd":
        optimizer = hvd.DistributedOptimizer(optimizer, **wrap_args)
    else:  # the swap
        optimizer = osp.DistributedOptimizer(optimizer, sync=MODES[args.optimizer](), **wrap_args)

    def train(epoch):
        model.train()
        train_sampler.set_epoch(epoch)
        for batch_idx, (data, target) in enumerate(train_loader):
            optimizer.zero_grad()
            loss = F.nll_loss(model(data), target)
            loss.backward()
            optimizer.step()
            if batch_idx % args.log_interval == 0 and hvd.rank() == 0:
                print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)}]\tLoss: {loss.item():.6f}")

    def test():
        if isinstance(optimizer, osp.DistributedOptimizer):
            optimizer.flush()
        model.eval()
        test_loss, test_accuracy = 0.0, 0.0
        with torch.no_grad():
            for data, target in test_loader:
                output = model(data)
                test_loss += F.nll_loss(output, target, reduction="sum").item()
                test_accuracy += output.argmax(1).eq(target).float().sum().item()
        test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
        test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
        if hvd.rank() == 0:
            print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%")
        return test_loss

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        loss = test()
    if hvd.rank() == 0:
        print(f"final test loss {loss!r}")
    hvd.shutdown()


if __name__ == "__main__":
    main(parser.parse_args())
