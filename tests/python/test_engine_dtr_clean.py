"""One device budget, failing clean (issue 28), on the simulated device.

The budget is a promise: chunks plus every byte torch allocates while the
engine runs stay within it (Note [The simulated device's budget is a hard
limit] in hooks/host_allocation_counter.h, Note [Chunks in use and
activations share one budget] in runtime/tracer/memory_tracer.h). An out-of-memory
error from a DTR engine in forward or backward leaves the process as it was:
DTR intercepts nothing outside the engine's cycle (Note [DTR belongs to the
engine's cycle] in python/tidal/engine/dtr_link.py), the weights and
optimizer states are those of the last good step, and the same engine trains
the next, smaller batch. References: plain PyTorch with torch.optim.AdamW.
"""
import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal import dtr

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, train_tidal, within_budget  # noqa: E402
from engine_reference import assert_close, config, train_reference  # noqa: E402
from test_engine_dtr import gpt_budget  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

SEQ = 32


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")
    yield
    dtr.disable()


def dtr_engine(model, budget=None):
    """30% of the no-DTR activations of TinyGPT(d=64, seq=32) at batch 8."""
    cfg = config(budget=gpt_budget() if budget is None else budget)
    cfg["tidal"]["dtr"] = {"enabled": True, "evictee_minimum_size": 1024}
    return tidal.initialize(model, cfg)


def test_dtr_is_off_between_steps_and_plain_code_never_meets_it():
    torch.manual_seed(0)
    engine = dtr_engine(TinyGPT(d=64, seq=SEQ))
    seen = []
    hook = engine.module.blocks[0].register_forward_hook(lambda *a: seen.append(dtr.is_enabled()))
    train_tidal(engine, gpt_batches(2, seq=SEQ, batch=8))
    hook.remove()
    assert seen == [True, True]      # on inside the engine's forward
    assert not dtr.is_enabled()      # off after the step
    torch.randn(1500, 1500) @ torch.randn(1500, 1500)   # plain PyTorch: no threshold to meet
    with torch.no_grad():
        engine.eval()
        engine(*gpt_batches(1, seq=SEQ, batch=8)[0])
        engine.train()
    assert not dtr.is_enabled()      # a no_grad forward ends its own cycle


class _HugeBackward(torch.autograd.Function):
    """The identity, whose backward asks for a 64 MiB temporary."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g + torch.zeros(4096, 4096).sum()


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_an_out_of_memory_batch_leaves_the_last_good_step_and_the_next_batch_trains(where):
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=SEQ)
    model = copy.deepcopy(ref)
    good = gpt_batches(4, seq=SEQ, batch=8)
    ref_losses = train_reference(ref, good)
    engine = dtr_engine(model)
    losses = train_tidal(engine, good[:2])
    before = {k: v.clone() for k, v in engine.parameters_fp32().items()}
    with pytest.raises(tidal.OutOfMemoryError, match=r"ran out of the device budget|could not bring"):
        if where == "forward":
            # A batch too large for the budget even with DTR.
            engine(*gpt_batches(1, seq=SEQ, batch=256)[0])
        else:
            # A backward that needs far more than the budget in one op.
            engine.backward(_HugeBackward.apply(engine(*good[2])))
    gc.collect()
    assert not dtr.is_enabled()
    torch.randn(1500, 1500) @ torch.randn(1500, 1500)   # the process is as it was
    after = engine.parameters_fp32()
    for k, v in before.items():
        assert torch.equal(after[k], v), k            # the last good step's weights
    assert not engine._wiring.hooks.landed_params()         # no gradient of the failed batch waits
    losses += train_tidal(engine, good[2:])           # the same engine goes on
    assert_close(engine, ref, ref_losses, losses)
    within_budget(engine)


def test_a_dropped_engine_mid_cycle_leaves_no_session():
    torch.manual_seed(0)
    engine = dtr_engine(TinyGPT(d=64, seq=SEQ))
    x, y = gpt_batches(1, seq=SEQ, batch=8)[0]
    loss = engine(x, y)
    assert dtr.is_enabled()
    del engine, loss
    gc.collect()
    assert not dtr.is_enabled()
    torch.randn(1500, 1500) @ torch.randn(1500, 1500)


def test_fits_are_monotonic_and_every_peak_is_within_the_budget():
    # If a batch trains at a budget, every smaller one does; each run's
    # device use at its worst moment (chunks + every counted byte together)
    # is within the budget (within_budget), and no overrun is counted. The
    # batches go past what fits (batch 8 does with DTR, recomputing; 64
    # allocates single tensors of more than half the budget), so the order
    # is tested on both sides of the edge, not only where everything fits.
    fits, recomputes = {}, {}
    for batch in (1, 2, 4, 8, 16, 32, 64):
        torch.manual_seed(0)
        engine = dtr_engine(TinyGPT(d=64, seq=SEQ))
        try:
            train_tidal(engine, gpt_batches(2, seq=SEQ, batch=batch))
            fits[batch] = True
            within_budget(engine)
            recomputes[batch] = engine.memory_report()["dtr"]["recomputes"]
        except tidal.OutOfMemoryError:
            fits[batch] = False
        del engine
        gc.collect()
    trained = [b for b, ok in fits.items() if ok]
    assert trained and all(fits[b] for b in fits if b <= max(trained)), fits
    assert not all(fits.values()), fits           # some batch does not fit
    assert recomputes[max(trained)] > 0, recomputes  # the largest that fits needed DTR
