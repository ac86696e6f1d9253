"""Host memory is not the ceiling (Note [One place per chunk] in
runtime/scheduler/chunk_scheduler.h): a chunk lives in one place at a time,
so a model whose states exceed the host budget alone trains in host + device,
chunks on the device give their host memory back, and a model too large for
both is a clear error that says how large a model fits.

Budgets come from a probe run on this machine (engine_helpers.measured_budget's
approach), not from constants."""
import copy
import gc
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal._C.chunks import ChunkKind

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, train_tidal  # noqa: E402
from engine_reference import assert_close, train_reference  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

LR = 2e-3
CHUNK = 8192
MARGIN = 4096


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(device_budget=0, host_budget=0, **tidal_keys):
    t = {"chunk_size": CHUNK, "device_memory_budget": device_budget, "device_margin": MARGIN,
         "host_memory_budget": host_budget}
    t.update(tidal_keys)
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
            "tidal": t}


def make_model():
    return TinyGPT(vocab=96, d=64, layers=3, heads=4, seq=16)


def chunk_bytes(engine):
    """(all chunk bytes with a payload, 16-bit chunk bytes) after registration."""
    s = engine.chunks.stats()
    c = engine.chunks
    c16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
    return s["resident_bytes_host"] + s["resident_bytes_device"], c16


def probe(model, batches):
    """State bytes S, 16-bit chunk bytes C and the non-chunk peak N of two
    steps with the whole device and an unlimited host."""
    engine = tidal.initialize(copy.deepcopy(model), config())
    try:
        state, c16 = chunk_bytes(engine)
        train_tidal(engine, batches[:2])
        return state, c16, engine.memory_report()["peak_nonchunk_device_bytes"]
    finally:
        engine.remove_hooks()


def test_a_model_larger_than_the_host_budget_trains_in_host_plus_device():
    torch.manual_seed(0)
    ref = make_model()
    batches = gpt_batches(8, vocab=96, seq=16, batch=4)
    state, c16, nonchunk = probe(ref, batches)
    # Neither memory alone holds the state: half of it on the host, and on the
    # device the other half plus a quarter of the 16-bit chunks to work in.
    host = state // 2
    device_room = state - host + c16 // 4 + 4 * 2 * CHUNK
    budget = MARGIN + int(1.25 * nonchunk) + device_room
    assert host < state and device_room < state, (host, device_room, state)

    model = copy.deepcopy(ref)
    ref_losses = train_reference(ref, batches)
    baseline_host = tidal._C.host_memory_stats()["allocated"]
    engine = tidal.initialize(model, config(budget, host))
    losses = train_tidal(engine, batches)
    assert_close(engine, ref, ref_losses, losses)

    report = engine.memory_report()
    assert report["chunk_spills_to_device"] > 0
    assert report["peak_chunk_host_bytes"] <= host
    assert report["peak_device_bytes"] <= budget, report
    assert report["budget_overruns"] == 0
    assert report["host_chunk_capacity_bytes"] <= host
    # What the process really holds for chunk payloads is within the host budget.
    assert tidal._C.host_memory_stats()["allocated"] - baseline_host <= host
    # The masters that live on the device are updated there.
    assert report["adam_chunks_on_device"] > 0
    # The estimate counts both memories: more than the host alone holds.
    assert report["largest_model_params"] * report["state_bytes_per_param"] > host


def test_chunks_moved_to_the_device_give_their_host_memory_back():
    torch.manual_seed(0)
    model = make_model()
    gc.collect()  # an earlier test's engine freed in the middle would skew the deltas
    baseline = tidal._C.host_memory_stats()["allocated"]
    engine = tidal.initialize(model, config(hybrid_adam=True))
    state, c16 = chunk_bytes(engine)
    registered = tidal._C.host_memory_stats()["allocated"] - baseline
    assert registered >= state  # every chunk starts on the host
    train_tidal(engine, gpt_batches(3, vocab=96, seq=16, batch=4))
    s = engine.chunks.stats()
    on_device = s["resident_bytes_device"]
    assert on_device >= c16  # the 16-bit chunks and (hybrid Adam) optimizer chunks
    # Host memory: the chunks still there plus at most a few cached blocks
    # (4; a tensor larger than a chunk has a larger, dedicated one), not the
    # whole state.
    c = engine.chunks
    block = max(c.chunk_capacity_bytes(i, k) for i in range(c.num_chunks)
                for k in (ChunkKind.PARAM16, ChunkKind.PARAM32, ChunkKind.MOMENTUM, ChunkKind.VARIANCE))
    now = tidal._C.host_memory_stats()["allocated"] - baseline
    assert now <= s["resident_bytes_host"] + 4 * block, (now, s)
    assert now < registered - on_device + 4 * block + 1


def test_a_model_too_large_for_host_plus_device_names_both_budgets():
    torch.manual_seed(0)
    model = make_model()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    state = 16 * sum(p.numel() for p in model.parameters())
    with pytest.raises(tidal.OutOfMemoryError) as info:
        tidal.initialize(model, config(device_budget=MARGIN + state // 8, host_budget=state // 4))
    message = str(info.value)
    assert "do not fit in host + device memory" in message
    assert "tidal.host_memory_budget" in message and "tidal.device_memory_budget" in message
    assert "room for at most about" in message
    # Nothing lost: the model keeps its values.
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
