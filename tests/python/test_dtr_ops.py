"""DTR on every op: models whose kernels have workspaces, undefined inputs or
outputs and several outputs (the oneDNN RNN, fused attention, batch norm's
saved statistics) train under DTR with evictions forced, bit for bit equal to
the same training in plain PyTorch, with both interceptions (C++ on a dispatch
key, and the Python TorchDispatchMode)."""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tidal.dtr as dtr


@pytest.fixture(autouse=True)
def _dtr_off():
    saved = {k: getattr(dtr, k) for k in ("eviction_threshold", "evictee_minimum_size",
                                          "enable_sqrt_sampling", "scorer", "max_recompute_ratio")}
    dtr.disable()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # replays must match bitwise: same kernels, same threads
    yield
    dtr.disable()
    dtr._set_after_op(None)
    dtr.configure(**saved)
    torch.set_num_threads(threads)


@pytest.fixture(params=["cpp", "python"])
def interception(request, monkeypatch):
    monkeypatch.setattr(dtr, "_interception", request.param)
    return request.param


# --------------------------------------------------------------------------- models

class Lstm(nn.Module):
    """Multi-layer bidirectional LSTM: aten.mkldnn_rnn_layer on a CPU with oneDNN
    (four outputs, one a workspace; its backward takes undefined gradients)."""

    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(16, 32, num_layers=2, bidirectional=True)
        self.head = nn.Linear(64, 5)

    def forward(self, x):
        out, (h, c) = self.rnn(x)
        return self.head(out).square().mean() + h.square().mean()


class Gru(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(16, 32, num_layers=2, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        out, _ = self.rnn(x.transpose(0, 1))
        return self.head(out).square().mean()


class Attention(nn.Module):
    """F.scaled_dot_product_attention: _scaled_dot_product_flash_attention_for_cpu
    (output and logsumexp); with dropout, the math path and its random mask."""

    def __init__(self, dropout=0.0, causal=False, mask=False):
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)
        self.dropout, self.causal, self.mask = dropout, causal, mask

    def forward(self, x):
        t, b, _ = x.shape
        q, k, v = self.qkv(x.transpose(0, 1)).reshape(b, t, 3, 2, 8).permute(2, 0, 3, 1, 4)
        # A float mask made in forward (tracked, evicted): the kernel's keyword-only attn_mask.
        mask = (x[:, :, :1].transpose(0, 1) * x[:, :, 1:2].permute(1, 2, 0)).unsqueeze(1) if self.mask else None
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=self.dropout, is_causal=self.causal)
        return self.out(y.transpose(1, 2).reshape(b, t, 16)).square().mean()


class ConvBn(nn.Module):
    """nn.BatchNorm2d in training: native_batch_norm (saved mean and invstd, running
    statistics updated in place), conv, relu in place."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(inplace=True),
                                  nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())

    def forward(self, x):
        return self.body(x.transpose(0, 1).unsqueeze(1)).square().mean()


MODELS = {
    "lstm": Lstm,
    "gru": Gru,
    "sdpa": Attention,
    "sdpa_causal_dropout": lambda: Attention(dropout=0.3, causal=True),
    "sdpa_float_mask": lambda: Attention(mask=True),
    "batchnorm2d": ConvBn,
}


def train(model, xs, steps=3):
    """Losses, gradients, then weights and buffers after `steps` SGD steps with momentum."""
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    out = []
    for step in range(steps):
        torch.manual_seed(100 + step)  # dropout draws the same mask with and without DTR
        opt.zero_grad(set_to_none=True)
        loss = model(xs[step])
        loss.backward()
        with torch.no_grad():  # copies DTR does not track (Note [What DTR tracks])
            out.append(loss.clone())
            out.extend(p.grad.clone() for p in model.parameters())
        del loss
        opt.step()
    out.extend(t.detach().clone() for t in model.state_dict().values())
    return out


def peak_tracked(model, xs):
    """The peak of tracked bytes of `train` with no threshold (on a copy)."""
    with dtr.enabled(eviction_threshold=1 << 40, evictee_minimum_size=1):
        train(copy.deepcopy(model), xs)
        return dtr.stats()["peak_tracked_bytes"]


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("force", ["evict_all", "threshold"])
def test_models_train_bitwise_with_evictions_forced(name, force, interception):
    """force="evict_all": every op's results are evicted as soon as it returns,
    so every read of an activation (forward or backward) replays it;
    "threshold": a threshold of half the peak, the budget path (evictions
    between the steps of a regeneration too)."""
    torch.manual_seed(0)
    model = MODELS[name]()
    twin = copy.deepcopy(model)
    xs = [torch.randn(10, 4, 16) for _ in range(3)]
    ref = train(twin, xs)
    threshold = 1 << 40 if force == "evict_all" else peak_tracked(model, xs) // 2
    # Evicting everything after every op replays on purpose what a budget never would.
    ratio = 0 if force == "evict_all" else None
    with dtr.enabled(eviction_threshold=threshold, evictee_minimum_size=1, max_recompute_ratio=ratio):
        if force == "evict_all":
            dtr._set_after_op(dtr._evict_all)
        got = train(model, xs)
        dtr._set_after_op(None)
        s = dtr.stats()
        dtr._validate()
    assert s["evictions"] > 0 and s["recomputes"] > 0, s
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{name}: tensor {i} differs"


def test_batch_norm_made_under_dtr_trains_bitwise(interception):
    """A model built while DTR is on (the two-line switch before the model):
    its running statistics are tracked, and native_batch_norm writes them
    without declaring it (not an input of the op); evicted, they must come back
    before the op writes into them."""
    xs = [torch.randn(10, 4, 16) for _ in range(3)]
    torch.manual_seed(0)
    ref = train(ConvBn(), xs)
    with dtr.enabled(eviction_threshold=1 << 40, evictee_minimum_size=1, max_recompute_ratio=0):
        dtr._set_after_op(dtr._evict_all)
        torch.manual_seed(0)
        model = ConvBn()
        got = train(model, xs)
        dtr._set_after_op(None)
        s = dtr.stats()
        dtr._validate()
    assert s["evictions"] > 0 and s["recomputes"] > 0, s
    assert len(got) == len(ref)
    for i, (a, b) in enumerate(zip(got, ref)):
        assert a.dtype == b.dtype and torch.equal(a, b), f"tensor {i} differs"
