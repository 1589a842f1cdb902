"""The model and data the join workers share (join_worker.py, join_amp_worker.py, join_dsync_worker.py): the same
small MLP on every rank, and rank r's k-th batch, drawn from its own seed."""
import torch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def batch(r, k):
    g = torch.Generator().manual_seed(1000 * r + k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def train(m, opt, rank, n):
    """Rank ``rank``'s first ``n`` steps on its own batches; returns the gradient each step handed to step()."""
    mine = []  # this rank's own gradients (OSP: .grad holds them before the step)
    for k in range(n):
        opt.zero_grad()
        x, y = batch(rank, k)
        torch.nn.functional.mse_loss(m(x), y).backward()
        mine.append([p.grad.clone() for p in m.parameters()])
        opt.step()
    return mine


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])
