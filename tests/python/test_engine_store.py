"""ParamStore's ways to a slot for the rest of the engine (python/tidal/engine/store.py,
Note [The Python package's layers] in tests/cpp/check_layers.py): pin() holds a
record's chunks beyond a block and gives back what it pinned when it fails part
way; kind_dtypes() and in_use() read without leaving a slot in use."""
from __future__ import annotations

import pytest
import torch

import tidal
from tidal.engine.store import HOLD, HOST, MOMENTUM, PARAM16, PARAM32, VARIANCE

KINDS = (PARAM16, PARAM32, MOMENTUM, VARIANCE)


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def _store(precision="fp32", moments="fp32"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    cfg = {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "tidal": {"chunk_size": 16384, "device_memory_budget": "600KiB", "device_margin": 1024,
                     "overlap_step": False}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    if moments == "bf16":
        cfg["tidal"]["optimizer_state_dtype"] = "bf16"
    engine = tidal.initialize(model, cfg)
    return engine, engine.store


def _states(store, record):
    return [store.chunks.state(record.id, k) for k in KINDS]


def test_a_pin_holds_the_chunks_on_the_host_until_released():
    engine, store = _store()
    first, other = store.records[0], store.records[1]
    assert first.chunk == other.chunk
    pin = store.pin(first, KINDS, HOST)
    for kind in KINDS:
        assert store.in_use([first], kind)
        assert store.chunks.chunk_space(first.chunk, kind) == HOST
        # The record's slots hold the chunk: its other tensors stay idle.
        assert not store.in_use([other], kind)
    pin.release()
    assert _states(store, first) == [HOLD] * 4
    assert not any(store.in_use(store.records, k) for k in KINDS)
    pin.release()  # a second release gives back nothing more
    assert _states(store, first) == [HOLD] * 4


def test_a_pin_that_fails_part_way_releases_what_it_pinned_and_raises():
    engine, store = _store()
    r = store.records[0]
    held = store.pin(r, (PARAM32,), HOST)
    with pytest.raises(ValueError, match="already in use"):
        store.pin(r, (MOMENTUM, VARIANCE, PARAM32), HOST)
    assert store.chunks.state(r.id, MOMENTUM) == HOLD
    assert store.chunks.state(r.id, VARIANCE) == HOLD
    assert store.in_use([r], PARAM32)  # the other pin's, untouched
    held.release()
    assert _states(store, r) == [HOLD] * 4


@pytest.mark.parametrize("precision, moments", [("fp32", "fp32"), ("bf16", "fp32"), ("bf16", "bf16"),
                                                ("fp16", "fp32")])
def test_kind_dtypes_are_the_slots_and_access_nothing(precision, moments):
    engine, store = _store(precision, moments)
    r = store.records[0]
    accesses = store.chunks.stats()["accesses"]
    got = store.kind_dtypes(KINDS)
    assert store.chunks.stats()["accesses"] == accesses  # (an access is an entry in the trace)
    want = []
    for kind in KINDS:  # (what an access of each slot finds)
        with store.slots(r, (kind,), HOST) as (view,):
            want.append(view.dtype)
    assert got == want
    assert _states(store, r) == [HOLD] * 4
