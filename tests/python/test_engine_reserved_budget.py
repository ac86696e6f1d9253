"""One budget for every device byte, on the simulated device as on a GPU (Note
[Who owns a device byte] in runtime/memory/caching_allocator_model.h).

With tidal.simulated_allocator "torch_caching" the simulated device places its
non-chunk allocations by torch's CUDA caching allocator's rules (checked
against torch's own allocator on a GPU: tests/python/test_cuda_room.py) and
holds the budget in the bytes they reserve, so it fails where a GPU fails:

* the H200's failure shape: chunks planned to the edge of the budget in
  allocated bytes, activations in 1-10 MiB pieces that split 20 MiB segments.
  Without room made on a miss (tidal.room_on_miss off: what the GPU had) the
  backward runs out of memory with bytes reserved but unallocated; with it the
  same run trains, its losses those of torch.optim.AdamW, its reserved peak
  within the budget and no overrun;
* a fragmentation torture: batch and sequence length change every step, with
  DTR off and on, 200 steps, where tidal.estimate says the largest shape fits.
"""
import copy
import gc

import pytest
import torch

import tidal
from tidal.models.gpt import TinyGPT

MiB = 1 << 20


def _config(budget, room=True, **tidal_keys):
    return {"train_micro_batch_size_per_gpu": 8, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "tidal": {"device": "sim", "chunk_size": "1MiB", "device_memory_budget": budget,
                      "simulated_allocator": "torch_caching", "room_on_miss": room, **tidal_keys}}


def _batches(n, vocab, shapes, seed=1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        b, s = shapes(i)
        out.append((torch.randint(0, vocab, (b, s), generator=g), torch.randint(0, vocab, (b, s), generator=g)))
    return out


def _reference_losses(model, batches, lr=1e-3, weight_decay=0.01):
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _made_room():
    """Misses on which the model's room maker freed something (process-wide count)."""
    return tidal._C.chunks.host_allocation_model_use()["made_room"]


def _held_to_budget(report):
    assert report["simulated_allocator"] == "torch_caching"
    assert report["budget_overruns"] == 0, report
    assert 0 < report["peak_reserved_device_bytes"] <= report["device_budget"], report


def test_the_h200_failure_shape_fails_without_room_and_trains_with_it():
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=256, layers=4, heads=4, seq=256)
    batches = _batches(4, 512, lambda i: (8, 256))
    budget = 200 * MiB

    # What the GPU had: the plan in allocated bytes, nothing to make room on a miss.
    def without_room():
        engine = tidal.initialize(copy.deepcopy(model), _config(budget, room=False))
        try:
            for x, y in batches:
                loss = engine(x, y)
                engine.backward(loss)
                engine.step()
        except tidal.OutOfMemoryError as e:
            return str(e)  # (the engine, its tensors and the traceback go with this frame)
        return None

    error = without_room()
    gc.collect()
    assert error is not None and "reserved but unallocated" in error, error

    engine = tidal.initialize(copy.deepcopy(model), _config(budget))
    made = _made_room()
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report = engine.memory_report()
    _held_to_budget(report)
    assert _made_room() > made, report["room_on_cache_miss"]
    assert report["evictions"] > 0
    # The chunks that made room came back: the numbers are plain PyTorch's.
    assert losses == pytest.approx(_reference_losses(model, batches), rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("dtr", [False, True], ids=["dtr-off", "dtr-on"])
def test_shapes_changing_every_step_stay_within_the_reserved_budget(dtr):
    torch.manual_seed(0)
    vocab, seq = 256, 128
    model = TinyGPT(vocab=vocab, d=128, layers=3, heads=4, seq=seq)
    g = torch.Generator().manual_seed(7)
    sizes = [(int(torch.randint(1, 9, (1,), generator=g)), int(torch.randint(8, seq + 1, (1,), generator=g)))
             for _ in range(200)]
    batches = _batches(200, vocab, lambda i: sizes[i])
    budget = 36 * MiB  # (below the 48 MiB the largest shape reserves without moving chunks)
    keys = {"dtr": {"enabled": True}} if dtr else {}
    cfg = _config(budget, **keys)
    # The estimate says the largest shape fits this budget ...
    est = tidal.estimate(TinyGPT(vocab=vocab, d=128, layers=3, heads=4, seq=seq).to("meta"), cfg,
                         micro_batch=8, seq=seq, device_memory=8 << 30, host_memory=8 << 30)
    assert est["fits"], est
    # ... so every step trains, within it in reserved bytes.
    engine = tidal.initialize(copy.deepcopy(model), cfg)
    made = _made_room()
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        assert torch.isfinite(loss)
    report = engine.memory_report()
    _held_to_budget(report)
    assert report["steps"] == 200
    # The budget bound: chunks moved, and misses made room.
    assert report["evictions"] > 0
    assert _made_room() > made
