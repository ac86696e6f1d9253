"""What the CPU Adam tests share: the kernel-target fixture, the parameter
sets and their gradients, bitwise and elementwise comparisons."""
import os
import threading
import time
from pathlib import Path

import pytest
import torch

import tidal  # noqa: F401  -- loads torch, then tidal._C
from tidal import _C

ROOT = Path(__file__).resolve().parents[2]
TARGETS = _C.cpu_adam.available_targets()
# Subprocesses import this checkout's tidal, keeping the caller's path after it.
SUBPROCESS_PYTHONPATH = os.pathsep.join(
    [str(ROOT / "python")] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))
HYPER = dict(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.05)
SHAPES = [(37,), (8, 13), (1,), (), (3, 5, 7), (4099,)]
# fp32 kernels do torch's operations in torch's order (no FMA); what remains
# is a few ulps per step (torch's lerp uses FMA), compounded over 100 steps.
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture
def target(request):
    """Selects a kernel target for the test and restores the previous one."""
    previous = _C.cpu_adam.target()
    _C.cpu_adam.set_target(request.param)
    try:
        yield request.param
    finally:
        _C.cpu_adam.set_target(previous)


def same_bits(a, b):
    """Bitwise equality (torch.equal is False for NaN == NaN)."""
    return a.dtype == b.dtype and torch.equal(a.reshape(-1).view(torch.uint8),
                                              b.reshape(-1).view(torch.uint8))


def make_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=gen) for s in SHAPES]


def twin_params(seed=0):
    base = make_params(seed)
    ours = [torch.nn.Parameter(t.clone()) for t in base]
    theirs = [torch.nn.Parameter(t.clone()) for t in base]
    return ours, theirs


def set_grads(gen, *param_lists, scale=1.0):
    for ps in zip(*param_lists):
        g = torch.randn(ps[0].shape, generator=gen) * scale
        for p in ps:
            p.grad = g.clone()


def assert_states_close(ours, theirs, opt, ref):
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL)
        sa, sb = opt.state[a], ref.state[b]
        assert float(sa["step"]) == float(sb["step"])
        torch.testing.assert_close(sa["exp_avg"], sb["exp_avg"], rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(sa["exp_avg_sq"], sb["exp_avg_sq"], rtol=RTOL, atol=ATOL)


def assert_ticks_while_stepping(one, one_step: float):
    """Runs `one()` on another thread for about 0.3 s (steps of `one_step`
    seconds) while this thread ticks every millisecond: a call that released
    the GIL lets it tick about once per ms; one that held it, at most about
    twice per call."""
    steps = max(3, int(0.3 / max(one_step, 1e-4)))
    done = threading.Event()

    def worker():
        for _ in range(steps):
            one()
        done.set()

    ticks = 0
    thread = threading.Thread(target=worker)
    thread.start()
    while not done.is_set():
        time.sleep(0.001)
        ticks += 1
    thread.join()
    assert ticks > 4 * steps, f"{ticks} ticks during {steps} steps of {one_step * 1e3:.1f} ms"
