"""The hooks torch calls are C++ objects (Note [Hooks torch calls into C++] in
python/csrc/hook_callables.cpp); where only Python can do the work they take
the engine's Python methods. Each test trains against plain PyTorch + AdamW
(test_engine's reference) or checks what reaches the caller."""
import copy
import gc
import sys
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tidal
from tidal._C.chunks import MemorySpace
from tidal.engine.hook_wiring import HookWiring

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, train_tidal  # noqa: E402
from engine_reference import assert_close, config, fitted, train_reference  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402


def hook_types(model):
    m = model.blocks[0].qkv
    return ([type(h).__name__ for h in m._forward_pre_hooks.values()],
            [type(h).__name__ for h in m._forward_hooks.values()],
            [type(h).__name__ for h in m.weight._post_accumulate_grad_hooks.values()])


def test_the_hooks_are_cpp_callables_with_and_without_dtr_in_the_config():
    model = TinyGPT(d=64, seq=8)
    engine = tidal.initialize(model, config(overlap_step=False))
    assert hook_types(model) == (["ForwardPreHook"], ["ForwardPostHook"], ["GradHook"])
    engine.remove_hooks()
    # tidal.overlap_step (on by default) adds one Python hook per parameter
    # after the landing: it counts the chunk's gradients and starts its update
    # (Note [CPU Adam during backward]); not yet a C++ callable.
    model = TinyGPT(d=64, seq=8)
    engine = tidal.initialize(model, config())
    assert hook_types(model) == (["ForwardPreHook"], ["ForwardPostHook"], ["GradHook", "function"])
    engine.remove_hooks()
    model = TinyGPT(d=64, seq=8)
    cfg = config()
    cfg["tidal"]["dtr"] = {"enabled": True}
    try:
        engine = tidal.initialize(model, cfg)
        # DTR intercepts in C++ (no Python dispatch mode), so the C++ hooks
        # run; they keep the engine's ops out of DTR and ModuleHooks sets
        # DTR's threshold from the chunks held on the device.
        assert hook_types(model) == (["ForwardPreHook"], ["ForwardPostHook"], ["GradHook"])
        store = engine.store
        held = engine.chunks.held_bytes(MemorySpace.DEVICE)
        assert engine._wiring.hooks.dtr_threshold() == store.device_budget - store.margin - held
        engine.remove_hooks()
    finally:
        tidal.dtr.disable()


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_under_a_dispatch_mode_the_hooks_take_the_python_path_and_train_the_same(monkeypatch):
    calls = {"pre_forward": 0, "post_forward": 0, "grad_ready": 0}
    for name in calls:
        method = getattr(HookWiring, name)

        def counted(self, *args, _method=method, _name=name):
            calls[_name] += 1
            return _method(self, *args)
        monkeypatch.setattr(HookWiring, name, counted)
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(4)
    ref_losses = train_reference(ref, batches)
    engine = tidal.initialize(model, fitted(config(), model, batches))
    losses = train_tidal(engine, batches[:2])   # no mode: the C++ callables alone
    assert calls == {"pre_forward": 0, "post_forward": 0, "grad_ready": 0}
    mode = CountOps()
    with mode:
        losses += train_tidal(engine, batches[2:])
    assert mode.ops > 0
    modules = len(engine._params.module_list)
    assert calls["pre_forward"] == calls["post_forward"] == 2 * modules
    assert calls["grad_ready"] == 2 * len({id(r.param) for r in engine.records if r.trainable})
    assert_close(engine, ref, ref_losses, losses)


def test_outputs_of_every_shape_are_marked_by_cpp_or_by_python():
    # A tensor, a tuple or list of tensors and plain values: C++ marks them; a
    # dict or a nested tuple goes to the engine's Python wrap_outputs. Each
    # marked output's gradient attaches the module's parameters for backward.
    model = TinyGPT(d=64, seq=8)
    engine = tidal.initialize(model, config())
    wrapped = []

    def wrap(module, output):
        wrapped.append(type(output).__name__)
        return output
    qkv = engine._params.module_index[model.blocks[0].qkv]
    records = engine._params.module_records[model.blocks[0].qkv]
    post = engine._wiring.hooks.forward_post_hook(qkv, lambda *a: None, wrap, lambda i, e: None)
    leaf = torch.randn(3, requires_grad=True)
    a, b = leaf * 2, leaf * 3
    for output in (a, (a, None, 1, 2.0), [a, b]):
        assert post(None, (), output) is None
    assert wrapped == []
    for output in ({"a": a}, ((a,), b)):
        assert post(None, (), output) is output
    assert wrapped == ["dict", "tuple"]
    # The C++ hook on `b` runs qkv's backward pre-hook: its parameters are
    # attached (for backward) when the gradient of b is ready.
    assert not any(engine._wiring.is_attached(r) for r in records)
    seen = []
    b.register_hook(lambda g: seen.append([engine._wiring.is_attached(r) for r in records]))
    b.sum().backward()
    assert records and seen == [[True] * len(records)]
    engine._wiring.hooks.end_backward()
    assert not any(engine._wiring.is_attached(r) for r in records)


def test_a_dropped_engine_with_a_kept_model_stays_alive_through_its_module_hooks():
    # Module hooks hold the engine strongly (as bound methods did), and show
    # it to the garbage collector: a kept model keeps its engine; dropping both
    # frees it.
    model = TinyGPT(d=64, seq=8)
    engine = tidal.initialize(model, config())
    train_tidal(engine, gpt_batches(1))
    ref = weakref.ref(engine)
    del engine
    gc.collect()
    assert ref() is not None
    loss = model(*gpt_batches(1)[0])   # the hooks still attach the parameters
    assert torch.isfinite(loss)
    ref().backward(loss)
    ref().step()
    del model, loss
    gc.collect()
    assert ref() is None
