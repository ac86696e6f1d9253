"""Chunks that a trace point's lowered budget evicts in every steady step
(Note [Blocks leaving over a lowered budget] in
runtime/scheduler/chunk_scheduler.h): step_overlap_clip's GPT (vocab 8192,
d 256, 8 layers, 1 MiB chunks, room for a quarter of the 16-bit chunks
beside the measured activation peak: about 48 MiB) on a simulated link
slow enough (200 MB/s) that every copy down is still running when the
lowering returns. The lowering no longer waits for those copies: it leaves
the evicted chunks' blocks cached over the budget until an activation or a
chunk needs their room, and a prefetch that finds only those blocks to free
stops instead of waiting for them (Note [Prefetch]). Before, the lowering
freed each block at once, waiting on the hook's thread for its copy (issue
52: 12 of the 16 evictions of a steady step waited, on the default link),
and a prefetch right after it waited for the same copies.

The reference is the same model trained where everything fits: nothing
moves there, so the losses and weights must be the same bits.
"""
import copy

import pytest
import torch

import tidal
from tidal._C.chunks import ChunkKind
from tidal.models.gpt import TinyGPT

from engine_helpers import gpt_batches, train_tidal, within_budget

VOCAB, D, LAYERS, SEQ, BATCH = 8192, 256, 8, 64, 4
STEPS, STEADY = 8, 3
COUNTERS = ("evictions", "bytes_left_leaving", "prefetches_put_off", "prefetch_hits", "misses",
            "bytes_host_to_device", "bytes_device_to_host")


def config(budget):
    t = {"chunk_size": "1MiB", "device_memory_budget": budget}
    if budget:
        t["device_margin"] = budget // 20
    return {"train_micro_batch_size_per_gpu": BATCH, "gradient_clipping": 1.0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "tidal": t}


def train(engine, batches):
    """Losses, and the scheduler's counters after each step."""
    losses, counters = [], []
    for batch in batches:
        losses += train_tidal(engine, [batch])
        s = engine.chunks.stats()
        counters.append({k: s[k] for k in COUNTERS})
    return losses, counters


@pytest.fixture
def model_and_batches():
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d=D, layers=LAYERS, heads=4, seq=SEQ)
    return model, gpt_batches(STEPS, vocab=VOCAB, seq=SEQ, batch=BATCH)


def test_chunks_evicted_at_a_trace_point_leave_their_blocks_to_whoever_needs_the_room(model_and_batches):
    model, batches = model_and_batches
    tidal.set_device("sim", capacity="8GiB")
    fits = tidal.initialize(copy.deepcopy(model), config(0))
    ref_losses, _ = train(fits, batches)
    ref_weights = fits.parameters_fp32()
    # The budget from what this run measured: beside the activation peak,
    # chunk room for a quarter of the 16-bit chunks (the margin a twentieth),
    # so the chunks that fit while the activations are small leave at the
    # trace points where they grow, in every step.
    activations = fits.memory_report()["peak_nonchunk_device_bytes"]
    c = fits.chunks
    p16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
    budget = int((activations + p16 // 4) / 0.95)
    fits.remove_hooks()

    tidal.set_device("sim", capacity="8GiB", bandwidth="200MB/s")
    engine = tidal.initialize(copy.deepcopy(model), config(budget))
    losses, counters = train(engine, batches)
    assert losses == ref_losses  # bitwise: copies change no bits
    weights = engine.parameters_fp32()
    assert all(torch.equal(weights[n], ref_weights[n]) for n in ref_weights)
    within_budget(engine)

    steady = [{k: b[k] - a[k] for k in COUNTERS} for a, b in zip(counters[-STEADY - 1:], counters[-STEADY:])]
    for step in steady:
        # The path fires: every steady step evicts at its trace points, and
        # the lowerings leave blocks still being copied out of.
        assert step["evictions"] > 0 and step["bytes_left_leaving"] > 0, step
        copies = step["prefetch_hits"] + step["misses"]
        assert copies > 0 and step["prefetch_hits"] >= 0.9 * copies, step
    # A prefetch found only those blocks to free, and stopped instead of
    # waiting for their copies.
    assert sum(step["prefetches_put_off"] for step in steady) > 0, steady
