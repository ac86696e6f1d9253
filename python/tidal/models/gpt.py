"""Small GPT, ResNet and MLP models (torch.nn, random init, no downloads): the
main job, the engine tests and the benchmarks use them."""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

# GPT shapes, name: (layers, hidden, heads, seq, vocab), of TinyGPT (a GPT-2
# model). Parameters ~ 12 * layers * hidden^2. The one table of them: tidal-train,
# tidal.estimate and the benchmarks read it here.
PRESETS = {  # tidal-train --preset
    "nano": (2, 64, 4, 64, 256),          # --quick
    "tiny": (4, 128, 4, 64, 256),         # the simulated-device default
    "gpt-125m": (12, 768, 12, 1024, 50304),
    "gpt-350m": (24, 1024, 16, 1024, 50304),
    "gpt-1.3b": (24, 2048, 16, 1024, 50304),
    "gpt-2.7b": (32, 2560, 32, 1024, 50304),
    "gpt-4b": (36, 3072, 24, 1024, 50304),
    "gpt-6.7b": (32, 4096, 32, 1024, 50304),
    "gpt-13b": (40, 5120, 40, 1024, 50304),
    "gpt-20b": (44, 6144, 64, 1024, 50304),
    "gpt-30b": (48, 7168, 56, 1024, 50304),
}
# Shapes beyond the presets, for the largest-model search (benchmarks/engine_gpu.py):
# no tidal-train preset, so they train through tidal-train --hf-config with a GPT-2
# config (TinyGPT blocks, the same model).
BEYOND_PRESETS = {
    "gpt-8b": (40, 4096, 32, 1024, 50304),
    "gpt-10b": (48, 4096, 32, 1024, 50304),
    "gpt-14b": (44, 5120, 40, 1024, 50304),
    "gpt-16b": (48, 5120, 40, 1024, 50304),
    # Between 16b (0.75 of an H200 box's (host + device) / 14 B) and 20b (more than all of
    # it): tidal.estimate puts the 85% goal at about 17.3B there.
    "gpt-17b": (54, 5120, 40, 1024, 50304),
    "gpt-18b": (56, 5120, 40, 1024, 50304),
    "quick-gpt2": (2, 96, 4, 64, 256),  # engine_gpu.py --quick: exercises the --hf-config route
}
SHAPES = {**PRESETS, **BEYOND_PRESETS}


class Block(nn.Module):
    """A GPT-2 block: pre-LN causal self-attention and a 4x GELU MLP, each
    added to the residual, with dropout on both branches.

    attention: "sdpa" (torch's fused scaled_dot_product_attention) or
    "explicit": the masked softmax written out as matmuls, with dropout on the
    attention probabilities too, so that DTR and recompute see (and may
    evict, replay or offload) each of its tensors; the DTR benchmark and the
    recompute tests use it. qkv_bias: a bias on the query/key/value
    projection (GPT-2 has one; off by default, see below).
    """

    def __init__(self, d, heads, dropout=0.0, qkv_bias=False, attention="sdpa"):
        super().__init__()
        if attention not in ("sdpa", "explicit"):
            raise ValueError(f"Block: attention must be 'sdpa' or 'explicit', got {attention!r}")
        self.ln1 = nn.LayerNorm(d)
        # No qkv bias by default: the key bias has a gradient of exactly zero
        # in exact arithmetic (softmax ignores a shift), so Adam turns its
        # rounding noise into lr-sized steps that no two implementations share.
        self.qkv = nn.Linear(d, 3 * d, bias=qkv_bias)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)
        self.heads = heads
        self.attention = attention
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        if self.attention == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
            mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
            y = self.drop(att.masked_fill(~mask, float("-inf")).softmax(-1)) @ v
        y = y.transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=96, d=32, layers=4, heads=4, seq=16, tied=True, dropout=0.0):
        super().__init__()
        # GPT-2's embedding scale (std 0.02), so the tied head starts with small
        # logits. Passed at construction, not set afterwards: tidal.init_context
        # registers a module's parameters when its __init__ returns.
        self.wte = nn.Embedding(vocab, d, _weight=torch.randn(vocab, d) * 0.02)
        self.wpe = nn.Embedding(seq, d, _weight=torch.randn(seq, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        # Tied: the head's own weight is never materialised (a meta tensor,
        # replaced at once), so tidal.init_context keeps no dead copy of it.
        self.lm_head = nn.Linear(d, vocab, bias=False, device="meta" if tied else None)
        if tied:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx, targets=None):
        t = idx.shape[1]
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            x = blk(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


class TinyResNet(nn.Module):
    def __init__(self, width=8, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn0 = nn.BatchNorm2d(width)
        self.c1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.c2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x, y=None):
        x = F.relu(self.bn0(self.stem(x)))
        x = F.relu(x + self.bn2(self.c2(F.relu(self.bn1(self.c1(x))))))
        logits = self.head(x.mean((2, 3)))
        return logits if y is None else F.cross_entropy(logits, y)


class TanhChain(nn.Module):
    """`depth` square Linear layers with tanh and an MSE loss (forward(x, y)):
    many modules of one size, and smooth, so a last-bit difference between two
    Adam implementations flips no ReLU. benchmarks/engine_overhead.py times
    the hooks on it; the engine tests train it against torch's optimizers."""

    def __init__(self, width=32, depth=6):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return F.mse_loss(x, y)
