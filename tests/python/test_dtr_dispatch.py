"""tidal.dtr's C++ interception (Note [DTR on a dispatch key] in
hooks/dtr/interceptor.h) against what it relies on in PyTorch: these are the
tests to run after a torch upgrade. References are independent: a logging
TorchDispatchMode for the ops, plain PyTorch without DTR for the values."""
import threading

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import tidal
from tidal import dtr

KiB = 1024


@pytest.fixture(autouse=True)
def off_afterwards():
    yield
    dtr.disable()
    dtr._set_after_op(None)


class _Log(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


def _block(seed=0, d=32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 4 * d), torch.nn.GELU(),
                               torch.nn.Dropout(0.1), torch.nn.Linear(4 * d, d))


def _step(model, x):
    torch.manual_seed(5)
    out = model(x)
    loss = F.cross_entropy(out, torch.arange(out.shape[0]) % out.shape[1])
    return torch.autograd.grad(loss, list(model.parameters()))


def test_the_key_is_free_and_the_interception_is_in_cpp():
    assert tidal._C.dtr.interception_status() == ""
    dtr.enable()
    assert dtr._mode == "cpp" and dtr._runtime.active
    assert tidal._C.dtr.interception_status() == ""  # our own fallback does not count


def test_dtr_sees_the_ops_a_logging_dispatch_mode_sees():
    """No op bypasses the key: a Python mode (one key above) and DTR see the
    same stream. (An op with a kernel of its own on DispatchKey::Fake would
    reach the mode and not DTR.)"""
    model, x = _block(), torch.randn(16, 32)
    seen = []
    dtr._set_after_op(lambda: seen.append(dtr._runtime.last_op))
    with dtr.enabled(eviction_threshold=1 << 40):
        log = _Log()
        with log:
            _step(model, x)
        under_log = list(seen)
        seen.clear()
        _step(model, x)
    assert len(log.names) > 30
    assert under_log == log.names
    # Without a Python mode, torch emits the same ops but for the detach it
    # adds for a mode when autograd saves an output (log_softmax's here).
    assert seen == [n for n in log.names if n != "aten.detach.default"]


@pytest.mark.parametrize("interception", ["cpp", "python"])
def test_forced_evictions_keep_gradients_bitwise(interception, monkeypatch):
    monkeypatch.setattr(dtr, "_interception", interception)
    model, x = _block(), torch.randn(64, 32)
    ref = _step(model, x)
    with dtr.enabled(eviction_threshold=40 * KiB, evictee_minimum_size=KiB):
        got = _step(model, x)
        s = dtr.stats()
        dtr._validate()
    assert s["evictions"] > 0 and s["recomputes"] > 0
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_interception_is_per_thread():
    x = torch.randn(64, 64)
    with dtr.enabled(evictee_minimum_size=KiB):
        out = {}
        t = threading.Thread(target=lambda: out.setdefault("y", x.sin()))
        t.start()
        t.join()
        mine = x.cos()
        assert dtr._runtime.lookup(out["y"]) == -1  # another thread's op: not DTR's
        assert dtr._runtime.lookup(mine) >= 0


def test_outside_keeps_tidal_bookkeeping_out():
    x = torch.randn(64, 64)
    with dtr.enabled(evictee_minimum_size=KiB):
        with dtr.outside():
            y = x.sin()
        z = x.cos()
        assert dtr._runtime.lookup(y) == -1 and dtr._runtime.lookup(z) >= 0


def test_coexists_with_autocast():
    model, x = _block(), torch.randn(64, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = _step(model, x)
        with dtr.enabled(eviction_threshold=24 * KiB, evictee_minimum_size=KiB):
            got = _step(model, x)
            assert dtr.stats()["recomputes"] > 0
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_coexists_with_a_user_dispatch_mode_inside():
    model, x = _block(), torch.randn(64, 32)
    ref = _step(model, x)
    with dtr.enabled(eviction_threshold=40 * KiB, evictee_minimum_size=KiB):
        log = _Log()
        with log:  # the user's mode sees the ops first, DTR below it
            got = _step(model, x)
        assert dtr.stats()["recomputes"] > 0 and len(log.names) > 30
    for a, b in zip(got, ref):
        assert torch.equal(a, b)


def test_coexists_with_torch_func():
    w = torch.randn(32, 32)
    x = torch.randn(64, 32)

    def f(w):
        h = x
        for _ in range(4):
            h = torch.tanh(h @ w)
        return h.square().sum()

    ref = torch.func.grad(f)(w)
    with dtr.enabled(eviction_threshold=24 * KiB, evictee_minimum_size=KiB):
        got = torch.func.grad(f)(w)
    assert torch.equal(got, ref)


def test_tidal_errors_keep_their_type_through_torch():
    x = torch.randn(256, 256)
    with pytest.raises(tidal.OutOfMemoryError, match="aten.mul.Tensor"):
        with dtr.enabled(eviction_threshold="300KiB", evictee_minimum_size="1MiB"):
            ys = [x * i for i in range(4)]  # noqa: F841
    assert not dtr.is_enabled()


def test_parameter_gradients_are_settled_as_they_are_made():
    """Note [Gradients are optimizer inputs]: every parameter's gradient,
    the tied embedding/head one included (it waits in autograd's buffer for
    its second half), leaves DTR's budget as soon as it is made, so a tight
    budget never evicts a gradient and replays the forward pass for it."""
    torch.manual_seed(0)
    emb = torch.nn.Embedding(512, 64)
    head = torch.nn.Linear(64, 512, bias=False)
    head.weight = emb.weight  # tied
    body = _block(d=64)
    params = list(emb.parameters()) + list(body.parameters())
    idx = torch.randint(0, 512, (8, 32))

    def step():
        torch.manual_seed(5)
        for p in params:
            p.grad = None
        logits = head(body(emb(idx)))
        F.cross_entropy(logits.reshape(-1, 512), idx.reshape(-1)).backward()
        return [p.grad.clone() for p in params]

    ref = step()
    with dtr.enabled(eviction_threshold=1 << 40, evictee_minimum_size=KiB):
        step()
        peak = dtr.stats()["peak_tracked_bytes"]
    with dtr.enabled(eviction_threshold=int(peak * 0.3), evictee_minimum_size=KiB):
        got = step()
        rt = dtr._runtime
        records = {r[0]: r for r in rt.records()}
        for p in params:
            rec = records[rt.lookup(p.grad)]
            assert rec[2] == "resident" and rec[5], (p.shape, rec)  # resident, external
        _, plans = rt.op_counters()
        assert dtr.stats()["evictions"] > 0
    assert plans["longest"] < 20, plans  # no gradient came back through the forward pass
    for a, b in zip(got, ref):
        assert torch.equal(a, b)
