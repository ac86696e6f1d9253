"""Recompute inside the training engine: the config's activation_checkpointing
(and tidal.recompute) block applies static segments, "auto" segments, named
checkpoints and recompute-offload to the model tidal.initialize trains.

References: plain PyTorch + torch.optim.AdamW (losses and weights within 1e-5
in fp32), and the engine without recompute, which does the same math: bit for
bit equal. The device budget is measured on this machine and makes chunks
move, also between a segment's recompute and its backward (the engine's
parameter aliases keep what the recompute saved valid across moves).
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, measured_budget, train_tidal, within_budget, raw_numel  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

LR = 2e-3


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(**extra):
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "tidal": {"chunk_size": 16384, "device_margin": 1024, "hybrid_adam": False}}
    cfg.update(extra)
    return cfg


def model():
    torch.manual_seed(0)
    return TinyGPT(d=64, seq=16, layers=4, dropout=0.1)


PLANS = {
    "one segment per block": {"activation_checkpointing": {},
                              "tidal_recompute": {"checkpoints": ["blocks.0", "blocks.1", "blocks.2",
                                                                  "blocks.3"]}},
    "auto, 2 segments": {"activation_checkpointing": {"number_checkpoints": 2}},
    "named runs of blocks": {"activation_checkpointing": {},
                             "tidal_recompute": {"checkpoints": [["blocks.0", "blocks.1"],
                                                                 ["blocks.2", "blocks.3"]]}},
    "offload": {"activation_checkpointing": {"cpu_checkpointing": True, "number_checkpoints": 4}},
}


def with_plan(cfg, plan):
    cfg = copy.deepcopy(cfg)
    cfg["activation_checkpointing"] = plan["activation_checkpointing"]
    if "tidal_recompute" in plan:
        cfg["tidal"]["recompute"] = plan["tidal_recompute"]
    return cfg


def run(cfg, batches):
    torch.manual_seed(5)   # dropout: both runs draw the same masks
    engine = tidal.initialize(model(), cfg)
    losses = train_tidal(engine, batches)
    return engine, losses


@pytest.mark.parametrize("plan", list(PLANS))
def test_recompute_under_the_engine_is_bitwise_the_engine_without_it(plan):
    batches = gpt_batches(6, seq=16, batch=4)
    base = config()
    base["tidal"]["device_memory_budget"] = measured_budget(model(), base, batches, chunk_share=0.3)
    plain_engine, plain_losses = run(base, batches)
    cfg = with_plan(config(), PLANS[plan])
    cfg["tidal"]["device_memory_budget"] = measured_budget(model(), cfg, batches, chunk_share=0.3)
    engine, losses = run(cfg, batches)
    assert engine.recompute_plan is not None
    assert engine.recompute_plan.stats()["recomputes"] > 0
    assert losses == plain_losses
    got, want = engine.parameters_fp32(), plain_engine.parameters_fp32()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    report = engine.memory_report()
    assert report["evictions"] > 0
    assert report["peak_chunk_device_bytes"] <= report["device_budget"] - report["device_margin"]


def test_recompute_under_the_engine_matches_adamw():
    batches = gpt_batches(6, seq=16, batch=4)
    ref = model()
    ref.eval()   # no dropout: torch's and the engine's RNG use differ otherwise
    for m in ref.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    tidal_model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref.train()
    ref_losses = []
    for x, y in batches:
        loss = ref(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    cfg = with_plan(config(), PLANS["auto, 2 segments"])
    cfg["tidal"]["device_memory_budget"] = measured_budget(tidal_model, cfg, batches, chunk_share=0.3)
    engine = tidal.initialize(tidal_model, cfg)
    losses = train_tidal(engine, batches)
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    weights = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        err = (weights[name] - p.detach()).norm() / p.detach().norm()
        assert err <= 1e-5, f"{name}: relative L2 error {err:.3g}"


def test_recompute_gives_the_chunks_the_activation_memory_it_saves():
    """At the same device budget, recompute lowers the non-chunk peak the
    tracer measures, and the chunks get that room: fewer bytes move."""
    batches = gpt_batches(5, seq=16, batch=8)
    base = config()
    # Little slack over the measured activations: with it the 16-bit chunks
    # (860 KiB) cannot all stay beside plain's activations, and must move.
    base["tidal"]["device_memory_budget"] = measured_budget(model(), base, batches, chunk_share=0.3, slack=1.1)
    plain, _ = run(base, batches)
    engine, _ = run(with_plan(base, PLANS["one segment per block"]), batches)
    p, r = plain.memory_report(), engine.memory_report()
    within_budget(plain)
    within_budget(engine)
    assert r["peak_nonchunk_device_bytes"] < p["peak_nonchunk_device_bytes"]
    # The chunk budget at the tightest trace point grows by what recompute saves.
    def tightest(e):
        return min(budget - e.store.margin - peak for _, _, _, peak, budget in e.memory_timeline())
    saved = p["peak_nonchunk_device_bytes"] - r["peak_nonchunk_device_bytes"]
    assert tightest(engine) - tightest(plain) >= saved // 2
    moved = lambda rep: rep["bytes_host_to_device_last_step"] + rep["bytes_device_to_host_last_step"]  # noqa: E731
    assert moved(r) < moved(p)


def test_a_bad_checkpoint_name_fails_before_anything_moves_into_chunks():
    m = model()
    cfg = config(activation_checkpointing={})
    cfg["tidal"]["recompute"] = {"checkpoints": ["blocks.9"]}
    with pytest.raises(tidal.ConfigError, match=r"tidal\.recompute\.checkpoints.*'blocks\.9'"):
        tidal.initialize(m, cfg)
    # The model is as it was: ordinary parameters, forwards not wrapped.
    assert all(raw_numel(p) > 0 for p in m.parameters())
    assert "forward" not in m.blocks[0].__dict__
