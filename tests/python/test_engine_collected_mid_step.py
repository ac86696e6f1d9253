"""A dropped engine collected in the middle of another engine's step changes
nothing of it (simulated device; Note [One engine's window is its own] in
hooks/host_allocation_counter.h).

The cycle collector runs wherever an allocation trips it, so in a script (or
a test suite) that made engines before, it can run inside a live engine's
forward. The reference is the same run with nothing collected: its measured
peaks, its losses and its weights.
"""
import gc
import sys
from pathlib import Path

import pytest
import torch

import tidal
from tidal import _C
from tidal.models.gpt import TinyGPT

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, measured_budget, train_tidal  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")
    gc.collect()
    gc.disable()  # (the tests say where a collection runs)
    yield
    gc.enable()


def model():
    torch.manual_seed(0)
    return TinyGPT(d=64, seq=8, layers=4)


_BUDGET: list = []


def config():
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 2e-3}},
           "tidal": {"chunk_size": 16384, "device_margin": 1024, "overlap_step": False}}
    if not _BUDGET:
        _BUDGET.append(measured_budget(model(), cfg, gpt_batches(2)))
    cfg["tidal"]["device_memory_budget"] = _BUDGET[0]
    return cfg


def dropped_engine():
    """An engine that trained a step and was dropped: cycle garbage until the
    collector runs."""
    e = tidal.initialize(model(), config())
    train_tidal(e, gpt_batches(1))
    del e


class TeardownThatAllocates:
    """Garbage whose finalizer allocates and keeps what it allocated, as a
    dropped engine's teardown may (weights given back to its model)."""
    kept: list = []

    def __init__(self):
        self.cycle = self

    def __del__(self):
        TeardownThatAllocates.kept.append(torch.zeros(64 * 1024))  # 256 KiB


def run(collect_in=None, probe_in=None):
    """Two steps; with `collect_in`, the collector runs once at that module's
    forward in step 1; `probe_in(module)` runs at that module's forward in
    step 1, after it."""
    engine = tidal.initialize(model(), config())
    hooks = []
    done = []
    if collect_in is not None:
        module = dict(engine.named_modules())[collect_in]

        def collect(_m, _args):
            if not done:
                done.append(gc.collect())
        hooks.append(module.register_forward_pre_hook(collect))
    if probe_in is not None:
        name, probe = probe_in
        module = dict(engine.named_modules())[name]
        hooks.append(module.register_forward_pre_hook(lambda m, _a: probe(engine) if len(done) == 1 else None))
    losses = train_tidal(engine, gpt_batches(1))
    for h in hooks:
        h.remove()
    peak1 = engine.memory_report()["peak_nonchunk_device_bytes"]
    losses += train_tidal(engine, gpt_batches(2)[1:])
    report = engine.memory_report()
    weights = [p.detach().clone() for p in engine.parameters_fp32().values()]
    engine.remove_hooks()
    return losses, peak1, report, weights, done


def assert_same(got, ref):
    losses, peak1, report, weights, _ = got
    r_losses, r_peak1, r_report, r_weights, _ = ref
    assert peak1 == r_peak1, "the step's non-chunk peak moved with the collection"
    assert report["peak_nonchunk_device_bytes"] == r_report["peak_nonchunk_device_bytes"]
    assert report["budget_overruns"] == r_report["budget_overruns"] == 0
    assert losses == r_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, r_weights))


@pytest.mark.parametrize("where", ["blocks.0", "blocks.2", "blocks.3.out"])
def test_a_dropped_engine_collected_inside_a_forward_leaves_its_count_and_limit_running(where):
    ref = run()
    dropped_engine()
    seen = {}

    def probe(engine):
        seen["counting"] = _C.chunks.host_allocation_counting()
        # The limit is still the live engine's: an allocation past what the
        # budget leaves beside the chunks fails, as it did before.
        with pytest.raises(torch.OutOfMemoryError, match="tidal \\(simulated device\\)"):
            torch.empty(engine.store.device_budget, dtype=torch.uint8)

    got = run(collect_in=where, probe_in=("ln_f", probe))
    assert got[4][0] > 0, "the collector found the dropped engine"
    assert seen == {"counting": True}
    assert_same(got, ref)


def test_what_a_finalizer_allocates_during_a_collection_is_not_the_live_engines():
    ref = run()
    TeardownThatAllocates()
    try:
        got = run(collect_in="blocks.1")
        assert len(TeardownThatAllocates.kept) == 1, "the finalizer ran inside the forward"
        assert_same(got, ref)
    finally:
        TeardownThatAllocates.kept.clear()
