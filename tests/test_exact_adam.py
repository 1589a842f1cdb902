"""Adam and AdamW corrected by osp equal torch.optim bit for bit (one rank: every average is the rank's own
gradient, so the exact corrections of OSP's deferred blocks and DSync's delayed averages must give what
torch.optim's own step gives).

The parameters that show a last-bit difference are those whose gradient is only rounding noise: the key
bias of ``nn.MultiheadAttention`` (its true gradient is zero: softmax is invariant to a shift of the keys)
and the bias of a ``Linear`` feeding a ``BatchNorm1d`` (the batch mean removes it). Adam divides such a
gradient by its own root mean square, so one ulp in the update's arithmetic becomes a visible difference
within a few steps. The parameters' sizes are not multiples of the CPU's vector width, and the blocks
straddle parameters: the elements of a parameter's scalar tail in ATen's loops sit at other places in
osp's packed buffers.
"""
import pytest
import torch

import osp

STEPS = 9
BLOCK = 16
BUCKET_MB = 0.0004  # ~100 fp32 elements: several buckets, boundaries inside parameters

OPTIMIZERS = {
    "adam": lambda ps: torch.optim.Adam(ps, lr=1e-2),
    "adam-wd": lambda ps: torch.optim.Adam(ps, lr=1e-2, weight_decay=1e-2),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, amsgrad=True),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-2, maximize=True),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
}

MODES = {
    "osp": lambda: osp.OSP(0.25, block_size=BLOCK, bucket_mb=BUCKET_MB),
    "osp-0.0": lambda: osp.OSP(0.0, block_size=BLOCK, bucket_mb=BUCKET_MB),
    "dsync": lambda: osp.DSync(delay=2, bucket_mb=BUCKET_MB),
    "hsp-osp": lambda: osp.HSP(max_extra=2, sync=osp.OSP(0.25, block_size=BLOCK, bucket_mb=BUCKET_MB)),
    "hsp-dsync": lambda: osp.HSP(max_extra=2, sync=osp.DSync(delay=2, bucket_mb=BUCKET_MB)),
}


class Net(torch.nn.Module):
    def __init__(self, width=12):
        super().__init__()
        torch.manual_seed(0)
        self.attn = torch.nn.MultiheadAttention(width, 2, batch_first=True)
        self.lin = torch.nn.Linear(width, 13)
        self.bn = torch.nn.BatchNorm1d(13)
        self.head = torch.nn.Linear(13, 3)

    def forward(self, x):
        h, _ = self.attn(x, x, x, need_weights=False)
        h = self.bn(self.lin(h.mean(1)))
        return self.head(torch.tanh(h))


def data(t):
    g = torch.Generator().manual_seed(100 + t)
    return torch.randn(6, 5, 12, generator=g), torch.randn(6, 3, generator=g)


def run(make_opt, mode=None, steps=STEPS, dtype=torch.float32):
    model = Net().to(dtype)
    inner = make_opt(model.parameters())
    opt = inner if mode is None else osp.DistributedOptimizer(inner, model.named_parameters(), sync=mode(),
                                                               timeout=60)
    trace = []
    for t in range(steps):
        opt.zero_grad()
        x, y = data(t)
        torch.nn.functional.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        trace.append([p.detach().clone() for p in model.parameters()])
    if mode is not None:
        opt.flush()
    names = [n for n, _ in model.named_parameters()]
    state = [(f"{n}.{k}", v.detach().clone() if torch.is_tensor(v) else torch.tensor(float(v)))
             for n, p in model.named_parameters() for k, v in sorted(inner.state[p].items())]
    out = model.eval()(data(steps)[0].to(dtype))
    return names, trace, [p.detach().clone() for p in model.parameters()], state, out.detach()


def first_difference(ref, got):
    names, ref_trace, ref_params, ref_state, ref_out = ref
    _, trace, params, state, out = got
    for t, (a, b) in enumerate(zip(trace, ref_trace)):
        for name, x, y in zip(names, a, b):
            if not torch.equal(x, y):
                return f"{name} after step {t}: max abs diff {(x - y).abs().max().item():.3g}"
    for name, x, y in zip(names, params, ref_params):
        if not torch.equal(x, y):
            return f"{name} after flush: max abs diff {(x - y).abs().max().item():.3g}"
    if [k for k, _ in state] != [k for k, _ in ref_state]:
        return f"state keys {[k for k, _ in state]} != {[k for k, _ in ref_state]}"
    for (k, x), (_, y) in zip(state, ref_state):
        if not torch.equal(x, y):
            return f"state {k} after flush: max abs diff {(x.double() - y.double()).abs().max().item():.3g}"
    if not torch.equal(out, ref_out):
        return f"eval output: max abs diff {(out - ref_out).abs().max().item():.3g}"
    return None


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_one_rank_equals_torch_optim_bitwise(one_rank, optimizer, mode):
    ref = run(OPTIMIZERS[optimizer])
    got = run(OPTIMIZERS[optimizer], MODES[mode])
    diff = first_difference(ref, got)
    assert diff is None, f"{optimizer} under {mode} on one rank differs from torch.optim: {diff}"


HALF_OPTIMIZERS = {  # eps=1e-4: torch's 1e-8 underflows in fp16
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, eps=1e-4, weight_decay=0.1),
    "adam-amsgrad": lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=1e-4, amsgrad=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-2),
    "sgd-dampening": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.2, weight_decay=1e-2),
}


@pytest.mark.parametrize("mode", ["osp", "dsync"])
@pytest.mark.parametrize("optimizer", list(HALF_OPTIMIZERS))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_one_rank_equals_torch_optim_bitwise_half(one_rank, dtype, optimizer, mode):
    """fp16/bf16 parameters: where ATen's arithmetic depends on an element's place in its parameter (SGD's
    vector loops and scalar tails), or osp's kernels round less often than torch (Adam), torch's own step
    corrects."""
    ref = run(HALF_OPTIMIZERS[optimizer], dtype=dtype)
    got = run(HALF_OPTIMIZERS[optimizer], MODES[mode], dtype=dtype)
    diff = first_difference(ref, got)
    assert diff is None, f"{optimizer} in {dtype} under {mode} on one rank differs from torch.optim: {diff}"


def test_premise_gradients_of_rounding_noise():
    """The parameters this file is about: the key bias of the attention and the bias of the Linear that
    feeds the BatchNorm get gradients of rounding noise only (their true gradient is zero)."""
    model = Net()
    x, y = data(0)
    torch.nn.functional.mse_loss(model(x), y).backward()
    w = model.attn.embed_dim
    g = model.attn.in_proj_bias.grad
    assert g[w:2 * w].abs().max() < 1e-5 * g[:w].abs().max()
    assert model.lin.bias.grad.abs().max() < 1e-5 * model.lin.weight.grad.abs().max()


def test_premise_torch_sqrt_is_elementwise():
    """osp's Adam kernel takes torch's own CPU sqrt on pieces of its packed buffers (ops.h, SqrtF32): that is
    bitwise torch.optim only if torch's sqrt of an element does not depend on where it sits (offset,
    alignment, length of the tensor, threads). Where torch has MKL this sqrt is not correctly rounded."""
    x = torch.rand(100003, generator=torch.Generator().manual_seed(0)) * 1e-3
    ref = x.sqrt()
    for off in (0, 1, 3, 17, 4097):
        for n in (1, 7, 2049, 40000):
            assert torch.equal(x[off:off + n].clone().sqrt(), ref[off:off + n])
    prev = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(x.sqrt(), ref)
    finally:
        torch.set_num_threads(prev)
