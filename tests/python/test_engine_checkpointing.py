"""Activation checkpointing a script turns on itself, with chunks moving, against
plain PyTorch + torch.optim.AdamW (Note [A recompute inside backward] in
hooks/module_hooks.cpp).

Non-reentrant checkpointing (torch's recommended mode, and Hugging Face's
gradient_checkpointing_enable({"use_reentrant": False})) keeps what its
recompute makes for the segment's backward, views of the parameters' slots
among them; when the engine let those parameters go after the recompute's
forward, their chunks moved and the backward read moved memory: gradients off
by about 2x the learning rate after one step, without an error. Each case here
trains three steps at a budget where chunks move and at one where all fits,
reentrant and not, with torch's early stop on and off, and under DTR. (tidal's
CPU Adam and torch's AdamW round differently: 5e-5 apart at most here; the bug
was 0.06.)
"""
import copy

import pytest
import torch
import torch.utils.checkpoint as cp
import transformers

import tidal

LR = 1e-2
BUDGETS = {"chunks-move": "160KiB", "all-fits": 0}


class Checkpointed(torch.nn.Module):
    """An input layer, then layers each checkpointed with a LayerNorm shared by
    all of them (a parameter in every segment), then an MSE loss."""

    def __init__(self, reentrant, width=64, depth=6):
        super().__init__()
        self.reentrant = reentrant
        self.inp = torch.nn.Linear(width, width)
        self.norm = torch.nn.LayerNorm(width)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(width, width) for _ in range(depth))

    def forward(self, x, y):
        x = self.inp(x)
        for layer in self.layers:
            x = cp.checkpoint(lambda t, layer=layer: torch.tanh(layer(self.norm(t))), x,
                              use_reentrant=self.reentrant)
        return torch.nn.functional.mse_loss(x, y)


def _config(budget, **tidal_keys):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
            "tidal": {"device": "sim", "chunk_size": "16KiB", "device_memory_budget": budget,
                      "device_margin": "4KiB", "simulated_allocator": "exact", **tidal_keys}}


def _train_both(model, budget, batches, call, **tidal_keys):
    ref = copy.deepcopy(model)
    engine = tidal.initialize(model, _config(budget, **tidal_keys))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.0)
    for batch in batches:
        loss = call(engine, batch)
        engine.backward(loss)
        engine.step()
        call(ref, batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    got = engine.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(got[k].float(), v.float(), rtol=1e-4, atol=5e-5,
                                   msg=lambda m, k=k: f"{k}: {m}")
    return engine


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
@pytest.mark.parametrize("early_stop", [True, False], ids=["early-stop", "no-early-stop"])
@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_torch_checkpoint_with_chunks_moving_matches_plain_pytorch(reentrant, early_stop, budget):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(3)]
    with cp.set_checkpoint_early_stop(early_stop):
        engine = _train_both(Checkpointed(reentrant), budget, batches, lambda m, b: m(*b))
    if budget:
        assert engine.memory_report()["evictions"] > 0


def test_non_reentrant_checkpoint_under_dtr_matches_plain_pytorch():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(2)
    batches = [(torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g)) for _ in range(3)]
    engine = _train_both(Checkpointed(False), BUDGETS["chunks-move"], batches, lambda m, b: m(*b),
                         dtr={"enabled": True})
    assert engine.memory_report()["evictions"] > 0


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
def test_hugging_face_gradient_checkpointing_with_chunks_moving(reentrant):
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    model.gradient_checkpointing_enable({"use_reentrant": reentrant})
    model.train()
    g = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(3):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        batches.append({"input_ids": ids, "labels": ids})
    engine = _train_both(model, "384KiB", batches, lambda m, b: m(**b).loss)
    assert engine.memory_report()["evictions"] > 0
