"""CPU Adam during backward (Note [CPU Adam during backward] in
python/tidal/engine/overlap.py), on the simulated device with the states on
the host: the weights are those of the engine without overlap, bit for bit,
and torch.optim.AdamW's within the engine's tolerance; chunks are updated
while backward goes on; what the config refuses is named; an error in
backward releases the pins and the engine trains on."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, train_tidal, within_budget  # noqa: E402
from test_engine import assert_close, config, train_reference  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def overlap_config(overlap, precision="fp32"):
    # hybrid_adam off: every chunk is updated on the host, by CPU Adam.
    cfg = config(budget="64MiB", hybrid_adam=False, overlap_step=overlap)
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_updates_during_backward_give_the_weights_of_the_step(precision):
    batches = gpt_batches(6)
    masters = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(overlap, precision))
        train_tidal(engine, batches)
        opt = engine.memory_report()["optimizer"]
        if overlap:
            # Every chunk but those holding a tensor whose gradient lands last
            # (the tied embedding's) was updated while backward went on.
            assert opt["chunks_updated_during_backward"] > 0
            assert opt["overlapped_adam_seconds"] > 0
        else:
            assert opt["chunks_updated_during_backward"] == 0 and opt["overlapped_adam_seconds"] == 0
            assert opt["exposed_adam_seconds"] > 0
        within_budget(engine)
        masters[overlap] = engine.parameters_fp32()
    for name, want in masters[False].items():
        assert torch.equal(masters[True][name], want), name


def test_against_adamw():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(8)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, overlap_config(True))
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)
    within_budget(engine)


@pytest.mark.parametrize("key, value, named", [
    ("gradient_clipping", 1.0, "gradient_clipping is 1"),
    ("fp16", {"enabled": True}, "fp16 is enabled"),
    ("gradient_accumulation_steps", 2, "gradient_accumulation_steps is 2"),
])
def test_what_needs_every_gradient_first_is_refused(key, value, named):
    cfg = overlap_config(True)
    cfg[key] = value
    with pytest.raises(tidal.ConfigError, match=f"tidal.overlap_step.*{named}"):
        tidal.initialize(TinyGPT(d=64, seq=8), cfg)


@pytest.mark.parametrize("block", [{"enabled": True}, {"evictee_minimum_size": 4096}])
def test_with_dtr_is_refused(block):
    # A dtr block without "enabled" turns DTR on too (tidal.dtr.config_enables).
    cfg = overlap_config(True)
    cfg["tidal"]["dtr"] = block
    with pytest.raises(tidal.ConfigError, match="tidal.overlap_step.*tidal.dtr is enabled"):
        tidal.initialize(TinyGPT(d=64, seq=8), cfg)


def test_dtr_turned_on_by_hand_updates_nothing_during_backward():
    """A replay in backward could read updated weights: with tidal.dtr on by
    hand every chunk waits for engine.step(), and the weights are those of
    the engine without overlap."""
    batches = gpt_batches(3)
    masters = {}
    for overlap in (False, True):
        torch.manual_seed(0)
        engine = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(overlap))
        with tidal.dtr.enabled(eviction_threshold="1GiB"):
            train_tidal(engine, batches)
        assert engine.memory_report()["optimizer"]["chunks_updated_during_backward"] == 0
        within_budget(engine)
        masters[overlap] = engine.parameters_fp32()
    for name, want in masters[False].items():
        assert torch.equal(masters[True][name], want), name


class _SharedInsideCheckpoint(torch.nn.Module):
    """One weight used outside and inside a reentrant checkpoint: its
    gradient lands twice in one backward (once per autograd graph task)."""

    def __init__(self):
        super().__init__()
        self.shared = torch.nn.Linear(64, 64)
        self.other = torch.nn.Linear(64, 64)

    def forward(self, x, y):
        h = self.shared(x)
        h = torch.utils.checkpoint.checkpoint(lambda t: self.shared(torch.tanh(t)), h, use_reentrant=True)
        return torch.nn.functional.mse_loss(self.other(h), y)


def test_a_second_use_after_its_chunks_update_started_fails_loudly():
    """Never silently wrong weights: the chunk's master is in use by its
    update, so the second use in backward fails, naming the tensor."""
    torch.manual_seed(0)
    engine = tidal.initialize(_SharedInsideCheckpoint(), overlap_config(True))
    x, y = torch.randn(4, 64), torch.randn(4, 64)
    with pytest.raises(Exception, match="shared.weight.*already in use"):
        engine.backward(engine(x, y))


def test_a_forward_between_backward_and_step_waits_and_the_next_steps_train():
    # An evaluation between backward and step waits for the updates running
    # (their pins go) and sees the weights they wrote; the step then updates
    # the rest, and training goes on as without the evaluation.
    batches = gpt_batches(4)
    torch.manual_seed(0)
    plain = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(True))
    train_tidal(plain, batches)
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(True))
    for x, y in batches:
        engine.backward(engine(x, y))
        with torch.no_grad():
            engine.eval()
            assert torch.isfinite(engine(x, y))
            engine.train()
        engine.step()
    within_budget(engine)
    want = plain.parameters_fp32()
    for name, got in engine.parameters_fp32().items():
        assert torch.equal(got, want[name]), name


def test_a_failed_backward_releases_the_pins_and_the_engine_goes_on():
    batches = gpt_batches(4)
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(True))
    train_tidal(engine, batches[:1])
    x, y = batches[1]
    # Late in backward (the first block's), after chunks of later blocks were launched.
    boom = engine.module.blocks[0].register_full_backward_hook(
        lambda *a: (_ for _ in ()).throw(RuntimeError("boom in backward")))
    loss = engine(x, y)
    launched = engine.memory_report()["optimizer"]["chunks_updated_during_backward"]
    with pytest.raises(RuntimeError, match="boom in backward"):
        engine.backward(loss)
    boom.remove()
    assert engine.memory_report()["optimizer"]["chunks_updated_during_backward"] > launched
    losses = train_tidal(engine, batches[2:])
    assert all(torch.isfinite(torch.tensor(losses)))
    within_budget(engine)


def test_an_engine_dropped_after_backward_waits_for_its_updates_and_goes():
    # The worker reads chunk memory: a collected engine waits for it before
    # its chunks go (weakref.finalize), and nothing of the engine stays.
    import gc
    import weakref

    batches = gpt_batches(2)
    torch.manual_seed(0)
    engine = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(True))
    train_tidal(engine, batches[:1])
    x, y = batches[1]
    engine.backward(engine(x, y))
    assert engine._overlap._jobs  # updates launched during backward, not waited for
    gone = weakref.ref(engine)
    del engine
    gc.collect()
    assert gone() is None
    torch.manual_seed(0)
    again = tidal.initialize(TinyGPT(d=64, seq=8), overlap_config(True))
    assert all(torch.isfinite(torch.tensor(train_tidal(again, batches))))
    within_budget(again)
