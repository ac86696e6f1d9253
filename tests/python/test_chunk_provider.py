"""Chunk memory from torch's allocator (Note [Chunk memory and torch's caching
allocator] in hooks/torch_memory_provider.h), run on the simulated device.

On CUDA the store installs torch's caching allocator as the device's memory
provider; here the CPU stand-in (tidal._C.torch_cpu_memory_provider) plays its
part: chunk blocks come from torch's CPU allocator and count in the host
allocation counter, as chunk blocks count in torch.cuda.memory_allocated() on
a GPU. The tests check that every chunk block goes through the provider and
back, that the provider's non-chunk peak is exact across chunk-block calls
(against the counter's own figures), that the engine's tracer subtracts the
chunk blocks (against a run whose chunk blocks the counter never sees), and
that training still matches torch.optim.AdamW.
"""
import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal import _C

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, measured_budget, train_tidal  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

LR = 2e-3
MiB = 1 << 20


@pytest.fixture(autouse=True)
def simulated_device():
    device = tidal.set_device("sim", capacity="1GiB")
    yield device
    device.set_memory_provider(None)


def config(budget, chunk=16384):
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "tidal": {"chunk_size": chunk, "device_memory_budget": budget, "device_margin": 1024}}


def counted(fn):
    """Runs fn with the host allocation counter on; returns its live-byte delta."""
    was = _C.chunks.host_allocation_counting()
    _C.chunks.set_host_allocation_counting(True)
    try:
        before = _C.chunks.host_allocation_counts()["live_bytes"]
        out = fn()
        return out, _C.chunks.host_allocation_counts()["live_bytes"] - before
    finally:
        _C.chunks.set_host_allocation_counting(was)


def test_the_cuda_provider_needs_a_cuda_build_of_torch():
    if torch.version.cuda is not None:
        pytest.skip("torch is a CUDA build here")
    with pytest.raises(NotImplementedError, match="libc10_cuda.so"):
        _C.torch_cuda_memory_provider(0, 0)


def test_device_blocks_go_through_the_provider_and_count_like_torch_tensors(simulated_device):
    device = simulated_device
    provider = _C.torch_cpu_memory_provider()
    device.set_memory_provider(provider)
    assert isinstance(device.memory_provider(), _C.TorchMemoryProvider)
    before = _C.chunks.host_allocation_counts()["live_bytes"]
    # Counted although counting is off, as torch counts every CUDA block.
    assert not _C.chunks.host_allocation_counting()
    blocks = [device.allocate(s) for s in (MiB, 3 * MiB + 5)]
    counter_delta = _C.chunks.host_allocation_counts()["live_bytes"] - before
    assert counter_delta == provider.held_bytes()
    assert provider.held_bytes() >= 4 * MiB + 5
    assert provider.held_blocks() == 2
    assert device.memory_stats()["provided"] == 4 * MiB + 5
    assert device.memory_stats()["in_use"] == 4 * MiB + 5
    del blocks
    assert provider.held_bytes() == 0 and provider.held_blocks() == 0
    assert _C.chunks.host_allocation_counts()["live_bytes"] == before
    assert (provider.allocations(), provider.frees()) == (2, 2)
    assert device.memory_stats()["provided"] == 0


def test_the_non_chunk_peak_is_exact_across_chunk_block_calls(simulated_device):
    """Each chunk-block call restarts the counter's peak: the provider keeps
    the non-chunk peak of the interval before (Note [Chunk memory and torch's
    caching allocator])."""
    device = simulated_device
    provider = _C.torch_cpu_memory_provider()
    device.set_memory_provider(provider)
    base = provider.other_bytes()

    # A tensor's peak, then a chunk block: the block's call must not lose it.
    provider.reset_window()
    t, t_bytes = counted(lambda: torch.empty(50_000, dtype=torch.uint8))
    assert t_bytes >= 50_000
    del t
    block = device.allocate(2 * MiB)
    assert provider.other_bytes() == base
    assert provider.other_peak_bytes() == base + t_bytes

    # A tensor's peak while the block is held, then the block goes: the
    # block's bytes are not the tensor's.
    provider.reset_window()
    t, t_bytes = counted(lambda: torch.empty(70_000, dtype=torch.uint8))
    assert provider.other_bytes() == base + t_bytes
    del t
    del block
    assert provider.other_peak_bytes() == base + t_bytes

    # A new window starts from what is live now.
    provider.reset_window()
    assert provider.other_peak_bytes() == base


def train_reference(model, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    return losses


def run_engine(model, cfg, batches, provider):
    """Trains `model` under tidal on a fresh simulated device; returns the
    engine, its losses, and the tracer's (hook, non-chunk peak) per trace
    point of each step. (Not the chunk bytes held at each point: those count
    the blocks of chunks a lowering evicted whose copies were still running,
    which timing decides: Note [Blocks leaving over a lowered budget] in
    runtime/scheduler/chunk_scheduler.h.)"""
    device = tidal.set_device("sim", capacity="1GiB")
    if provider is not None:
        device.set_memory_provider(provider)
    engine = tidal.initialize(model, copy.deepcopy(cfg))
    losses, timelines = [], []
    for batch in batches:
        losses += train_tidal(engine, [batch])
        timelines.append([(hook, peak) for _, hook, _, peak, _ in engine.memory_timeline()])
    return engine, losses, timelines


def test_engine_with_chunk_blocks_from_torch_matches_adamw_and_traces_the_same_memory():
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    batches = gpt_batches(12)
    cfg = config(budget=0)
    # (Without the step overlap: with it, when CPU Adam's worker finishes a
    # chunk decides when its weights go up during backward (Note [Weights up
    # as they are updated] in tidal/engine/overlap.py), so the chunk bytes at
    # a trace point differ between two runs by timing alone; what this test
    # compares is what the tracer counts with and without the provider.)
    cfg["tidal"]["overlap_step"] = False
    cfg["tidal"]["device_memory_budget"] = measured_budget(copy.deepcopy(ref), cfg, batches)
    ref_model = copy.deepcopy(ref)
    ref_losses = train_reference(ref_model, batches)

    # Without a provider the counter never sees chunk blocks (they are in the
    # simulated arena): its non-chunk peaks are the independent count.
    # (The cycle collector stays off while both run: earlier tests' garbage
    # collected in one run's step, finalizers that allocate included, would be
    # that run's allocations; the two traces compare the chunk blocks' share.)
    gc.collect()
    gc.disable()
    try:
        plain, plain_losses, plain_trace = run_engine(copy.deepcopy(ref), cfg, batches, None)
        plain.remove_hooks()
        provider = _C.torch_cpu_memory_provider()
        engine, losses, trace = run_engine(copy.deepcopy(ref), cfg, batches, provider)
    finally:
        gc.enable()
    device = engine.store.device

    # Chunk blocks came from the provider, all of them, and they are counted.
    report = engine.memory_report()
    assert report["evictions"] > 0, "the budget must make chunks move"
    assert provider.allocations() > 0
    assert device.memory_stats()["provided"] == device.memory_stats()["in_use"] > 0
    assert provider.held_blocks() == device.memory_stats()["live_allocations"]

    # The tracer subtracts them: the same non-chunk peaks at every trace
    # point, hence the same budgets, as the run whose counter never saw a
    # chunk block.
    assert len(trace) == len(plain_trace)
    for step, (got, want) in enumerate(zip(trace, plain_trace)):
        assert got == want, f"step {step}: tracer differs from the run without provider"
    assert report["peak_nonchunk_device_bytes"] == plain.memory_report()["peak_nonchunk_device_bytes"]

    # Training is unchanged: torch.optim.AdamW within 1e-5.
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    assert losses == plain_losses
    weights = engine.parameters_fp32()
    for name, p in ref_model.named_parameters():
        err = (weights[name] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{name}: relative L2 error {err:.3g}"

    # When the engine goes, every chunk block goes back through the provider.
    engine.remove_hooks()
    del engine, plain
    gc.collect()
    assert provider.held_bytes() == 0 and provider.held_blocks() == 0
    assert provider.frees() == provider.allocations()
    assert device.memory_stats()["provided"] == 0


def test_the_store_installs_no_provider_on_the_simulated_device(simulated_device):
    torch.manual_seed(0)
    model = TinyGPT(d=32, seq=8, layers=1)
    engine = tidal.initialize(model, config(budget=0))
    train_tidal(engine, gpt_batches(1))
    assert simulated_device.memory_provider() is None
    assert simulated_device.memory_stats()["provided"] == 0
    engine.remove_hooks()
