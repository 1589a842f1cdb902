"""Models for the throughput bench (bench/train_throughput.py), on synthetic data.

Each factory returns ``(model, make_batch, loss_fn)``: ``make_batch(batch, generator) -> (x, y)`` draws
one batch from ``generator`` (a per-rank ``torch.Generator``), ``loss_fn(model(x), y)`` is the loss.
The weights are deterministic: every factory seeds torch with 0 before building its model.

    mlp       1024 -> width -> width -> 1000 (width 2048: ~8.4M parameters), randn input
    resnet18  CIFAR ResNet-18: 3x32x32 images, 10 classes, 3x3 stem, no max-pool (~11.2M parameters)
    gpt       decoder-only transformer: vocab 8192, d_model 256, 4 pre-LN layers, 4 heads, context 128,
              untied output head (~7.4M parameters), next-token cross-entropy on random tokens
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("mlp", "resnet18", "gpt")
# per-rank batch when --batch/--batches is not given: compute within 2x of the allreduce at 1 Gbit/s
# (0.25-0.4 s a step on one thread here), the regime OSP is for
DEFAULT_BATCH = {"mlp": 512, "resnet18": 16, "gpt": 8}


# ------------------------------------------------------------------------------------------------
# MLP

def make_mlp(width: int = 2048):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 1000))


def mlp(width: int = 2048):
    def make_batch(batch, g):
        x = torch.randn(batch, 1024, generator=g)
        y = torch.randint(0, 1000, (batch,), generator=g)
        return x, y

    return make_mlp(width), make_batch, F.cross_entropy


# ------------------------------------------------------------------------------------------------
# ResNet-18, CIFAR variant

class BasicBlock(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Sequential()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    def __init__(self, num_classes: int = 10, blocks=(2, 2, 2, 2), widths=(64, 128, 256, 512)):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        layers, cin = [], widths[0]
        for i, (n, w) in enumerate(zip(blocks, widths)):
            stage = []
            for j in range(n):
                stage.append(BasicBlock(cin, w, 2 if i > 0 and j == 0 else 1))
                cin = w
            layers.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = layers
        self.fc = nn.Linear(cin, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layer4(self.layer3(self.layer2(self.layer1(out))))
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.fc(out)


def resnet18():
    torch.manual_seed(0)
    model = ResNet18()

    def make_batch(batch, g):
        x = torch.randn(batch, 3, 32, 32, generator=g)
        y = torch.randint(0, 10, (batch,), generator=g)
        return x, y

    return model, make_batch, F.cross_entropy


# ------------------------------------------------------------------------------------------------
# small GPT

class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, d // self.n_heads).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(out.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d_model: int, n_heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_heads)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(nn.Linear(d_model, 4 * d_model), nn.GELU(), nn.Linear(4 * d_model, d_model))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 8192, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, context: int = 128):
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(context, d_model)
        self.blocks = nn.Sequential(*[Block(d_model, n_heads) for _ in range(n_layers)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)  # untied: every parameter appears once
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)
                if getattr(m, "bias", None) is not None:
                    nn.init.zeros_(m.bias)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        return self.head(self.ln_f(self.blocks(x)))


def gpt(vocab: int = 8192, d_model: int = 256, n_layers: int = 4, n_heads: int = 4, context: int = 128):
    torch.manual_seed(0)
    model = GPT(vocab, d_model, n_layers, n_heads, context)

    def make_batch(batch, g):
        tokens = torch.randint(0, vocab, (batch, context + 1), generator=g)
        return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def loss_fn(logits, y):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    return model, make_batch, loss_fn


def build(name: str, width: int = 2048):
    """``(model, make_batch, loss_fn)`` of the model called ``name`` (one of MODELS)."""
    if name == "mlp":
        return mlp(width)
    if name == "resnet18":
        return resnet18()
    if name == "gpt":
        return gpt()
    raise ValueError(f"bench: unknown model {name!r}; choose from {', '.join(MODELS)}")
