"""The step of a chunk in one call (Note [The step of a chunk in one call] in
hooks/chunk_step.h), on the simulated device: engine.step() makes one binding
call per chunk it updates, on the host and on the device, and a failed call
releases what it pinned, so the engine goes on. The math is checked against
torch.optim.AdamW by tests/python/test_engine.py (both device kernels, groups,
bf16 moments, accumulation) and test_param_groups.py."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal import _C

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, train_tidal, within_budget  # noqa: E402
from engine_reference import assert_close, config, train_reference  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


class Counting:
    """The engine's Chunks object with every method call counted by name."""

    def __init__(self, chunks):
        self.inner, self.calls = chunks, {}

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*a, **k):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*a, **k)
        return call


@pytest.mark.parametrize("hybrid", [True, False])
def test_the_step_is_one_binding_call_per_chunk(hybrid):
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(4)
    ref_losses = train_reference(ref, batches)
    # overlap_step off: this counts the calls of the step's own updates (with
    # it on, the host chunks are updated during backward, test_step_overlap.py).
    engine = tidal.initialize(model, config(hybrid_adam=hybrid, budget="64MiB", overlap_step=False))
    losses = train_tidal(engine, batches[:3])
    x, y = batches[3]
    loss = engine(x, y)
    engine.backward(loss)
    losses.append(loss.item())
    counting = Counting(engine.chunks)
    r0 = engine.memory_report()
    engine.store.chunks = counting  # (engine.chunks is the store's)
    try:
        engine.step()
    finally:
        engine.store.chunks = counting.inner
    r1 = engine.memory_report()
    device = r1["adam_chunks_on_device"] - r0["adam_chunks_on_device"]
    host = r1["adam_chunks_on_host"] - r0["adam_chunks_on_host"]
    assert (device > 0) == hybrid and (host > 0) != hybrid, (device, host)
    assert counting.calls.pop("step_chunk") == device + host
    # Besides: the step's bookkeeping, once per step, never per chunk.
    assert sum(counting.calls.values()) <= 4, counting.calls
    assert_close(engine, ref, ref_losses, losses)
    within_budget(engine)


def test_a_failed_chunk_step_releases_its_pins_and_the_engine_goes_on():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(3)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, config(budget="64MiB"))
    losses = train_tidal(engine, batches[:1])
    records = engine.store.records
    a = records[0]
    b = next(r for r in records if r.chunk != a.chunk)
    # A group naming a tensor of another chunk: refused after the pins were taken.
    with pytest.raises(ValueError, match=f"tensor {b.id} is in chunk {b.chunk}, not {a.chunk}"):
        engine.chunks.step_chunk(a.chunk, [(1e-3, 0.9, 0.999, 1e-8, 0.0, [a.id, b.id], [1, 1])],
                                 adamw_mode=True, bias_correction=True, grad_scale=1.0, use_sums=False,
                                 prefer_device=True, host_short=False, device_simd=True)
    for kind in (_C.chunks.ChunkKind.PARAM16, _C.chunks.ChunkKind.PARAM32, _C.chunks.ChunkKind.MOMENTUM,
                 _C.chunks.ChunkKind.VARIANCE):
        assert engine.chunks.state(a.id, kind) != _C.chunks.TensorState.COMPUTE, kind
    losses += train_tidal(engine, batches[1:])
    assert_close(engine, ref, ref_losses, losses)
    within_budget(engine)


def test_both_thread_pools_train_bitwise_alike_and_like_adamw():
    """tidal.cpu_adam_pool (Note [Whose threads run the update] in
    cpu_adam/adam.h): torch's intra-op threads and oneTBB's run the same
    blocks, so the engine's weights are bitwise equal, and AdamW's within
    1e-5; a pool tidal does not know is a ConfigError naming it."""
    torch.manual_seed(0)
    # 805K parameters in chunks of 512K elements (1 MiB of 16-bit): each
    # chunk's update spans several of cpu_adam's 32K-element blocks, so it
    # goes to the pool (below two blocks it runs on the calling thread).
    ref = TinyGPT(d=128, seq=8)
    assert sum(p.numel() for p in ref.parameters()) > 16 * _C.cpu_adam.block_elements
    batches = gpt_batches(3)
    engines, losses = {}, {}
    for pool in ("torch", "onetbb"):
        engines[pool] = tidal.initialize(copy.deepcopy(ref), config(budget="64MiB", chunk="1MiB",
                                                                    cpu_adam_pool=pool))
        losses[pool] = train_tidal(engines[pool], batches)
        within_budget(engines[pool])
    assert losses["torch"] == losses["onetbb"]
    got, other = engines["torch"].parameters_fp32(), engines["onetbb"].parameters_fp32()
    assert got.keys() == other.keys()
    for name in got:
        assert torch.equal(got[name], other[name]), name
    assert_close(engines["torch"], ref, train_reference(ref, batches), losses["torch"])
    with pytest.raises(tidal.ConfigError, match="cpu_adam_pool.*'tbb'"):
        tidal.initialize(TinyGPT(d=64, seq=8), config(cpu_adam_pool="tbb"))
