"""Note [Records, not dicts] (python/csrc/record.h): the structs the binding
hands to Python are read-only classes whose fields are attributes, and they
read as the dicts they replaced; the Python API gives users plain dicts."""
import json
import os
import pickle

import pytest
import torch

import tidal
from tidal import _C


def _records():
    device = tidal.get_device()
    runtime = _C.dtr.Runtime(eviction_threshold=1 << 20, evictee_minimum_size=1024, enable_sqrt_sampling=False)
    model = _C.CachingAllocatorModel()
    model.allocate(5 << 20)
    return [device.info(), device.memory_stats(), _C.host_memory_stats(), runtime.stats(), model.use(),
            _C.chunks.host_allocation_counts(), _C.chunks.host_allocation_model_use(), _C.chunks.cuda_room_counts()]


def _scheduler_stats():
    """A small engine's chunk scheduler counters, after one step."""
    tidal.set_device("sim", capacity="1GiB")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    engine = tidal.initialize(model, {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                      "tidal": {"chunk_size": 4096, "device_memory_budget": "64MiB"}})
    x = torch.randn(8, 16)
    engine.backward(engine(x).square().mean())
    engine.step()
    return engine, engine.chunks.stats()


@pytest.mark.parametrize("record", _records(), ids=lambda r: type(r).__name__)
def test_a_record_reads_as_the_dict_it_replaced(record):
    as_dict = dict(record)
    assert as_dict and all(isinstance(k, str) for k in as_dict)
    assert list(record) == list(as_dict) == list(record.keys())
    assert len(record) == len(as_dict)
    for key, value in as_dict.items():
        assert record[key] == value == getattr(record, key)
        assert key in record
    assert record == as_dict and as_dict == record
    assert dict(record.items()) == as_dict and list(record.values()) == list(as_dict.values())
    assert {**record} == as_dict
    assert "no such field" not in record and record.get("no such field", 7) == 7
    with pytest.raises(KeyError):
        record["no such field"]
    with pytest.raises(AttributeError):
        setattr(record, next(iter(as_dict)), 0)  # read-only
    assert repr(as_dict) in repr(record)


def test_the_scheduler_stats_read_as_the_dict_they_replaced():
    engine, stats = _scheduler_stats()
    test_a_record_reads_as_the_dict_it_replaced(stats)
    # The keys callers read: one per counter, and the per-space arrays as one key per space.
    for space in ("host", "device", "disk"):
        for prefix in ("resident_bytes_", "peak_resident_bytes_", "held_bytes_", "budget_bytes_"):
            assert prefix + space in stats
    assert stats.steps == stats["steps"] == 1 and stats.accesses > 0
    assert stats["held_bytes_device"] == engine.chunks.held_bytes(_C.chunks.MemorySpace.DEVICE)
    report = engine.memory_report()
    assert type(report["scheduler"]) is dict and report["scheduler"] == stats
    json.dumps(report["scheduler"])
    engine.remove_hooks()


def test_the_nvme_tiers_facts_read_as_the_dict_they_replaced(tmp_path):
    tidal.set_device("sim", capacity="1GiB")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 4))
    engine = tidal.initialize(model, {
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "zero_optimization": {"offload_optimizer": {"device": "nvme", "nvme_path": str(tmp_path)}},
        "tidal": {"chunk_size": 4096, "device_memory_budget": "64MiB"}})
    disk = engine.chunks.disk
    assert type(disk).__name__ == "DiskInfo"
    test_a_record_reads_as_the_dict_it_replaced(disk)
    assert os.path.dirname(disk.path) == str(tmp_path) and disk["path"] == disk.path
    assert disk.failure is None and disk.removed_stale == [] and disk.budget_bytes > 0
    assert engine.memory_report()["nvme"]["path"] == disk.path
    engine.remove_hooks()


def test_the_user_api_gives_plain_dicts():
    stats = tidal.stats()
    assert type(stats["host"]) is dict and type(stats["device"]) is dict
    info = tidal.device_info()
    assert type(info) is dict and info["backend"] == tidal.get_device().info().backend
    assert type(tidal.dtr.stats()) is dict
    json.dumps([stats, info, tidal.dtr.stats()])
    pickle.dumps([stats, info])


def test_a_record_is_a_snapshot():
    device = tidal.get_device()
    before = device.memory_stats()
    buf = device.allocate(1 << 20)
    after = device.memory_stats()
    assert after.in_use == before.in_use + (1 << 20)
    assert before != after
    del buf
