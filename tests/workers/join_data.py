"""The model and data the join workers share (join_worker.py, join_amp_worker.py, join_dsync_worker.py): the same
small MLP on every rank, and rank r's k-th batch, drawn from its own seed."""
import torch


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 9), torch.nn.Tanh(), torch.nn.Linear(9, 3))


def batch(r, k):
    g = torch.Generator().manual_seed(1000 * r + k)
    return torch.randn(4, 6, generator=g), torch.randn(4, 3, generator=g)


def flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])
