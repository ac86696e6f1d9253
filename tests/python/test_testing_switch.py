"""The suite's bf16 GEMM switch (TIDAL_TEST_FP32_GEMM, python/tidal/_testing.py).

Each case runs in a subprocess, with the switch on or off whatever this host is (the
suite's own process has it on only where torch's bf16 GEMM is its reference loop), so
these tests check the switch on every host, against references it does not replace:
the ops' out= variants, which keep torch's own kernels.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from conftest import _low_precision_gemm_is_slow  # noqa: E402  (the suite's own test of the host)

KERNELS = textwrap.dedent("""
    import json, torch, tidal
    assert tidal._testing._library is not None
    g = torch.Generator().manual_seed(0)
    def r(*shape, dtype):
        return torch.randn(*shape, generator=g).to(dtype)
    def native(op, *args, shape, **kw):
        out = torch.empty(shape, dtype=args[0].dtype)
        return getattr(torch.ops.aten, op).out(*args, **kw, out=out)
    failures = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        a, b = r(37, 65, dtype=dtype), r(65, 29, dtype=dtype)
        x, y = r(3, 37, 65, dtype=dtype), r(3, 65, 29, dtype=dtype)
        bias, bbias = r(29, dtype=dtype), r(3, 37, 29, dtype=dtype)
        cases = {
            "mm": (torch.mm(a, b), "mm", (a, b), (37, 29), {}),
            "bmm": (torch.bmm(x, y), "bmm", (x, y), (3, 37, 29), {}),
            "addmm": (torch.addmm(bias, a, b, beta=0.5, alpha=2.0), "addmm",
                      (bias, a, b), (37, 29), {"beta": 0.5, "alpha": 2.0}),
            "baddbmm": (torch.baddbmm(bbias, x, y, beta=0.5, alpha=2.0), "baddbmm", (bbias, x, y), (3, 37, 29),
                        {"beta": 0.5, "alpha": 2.0}),
        }
        for name, (got, op, args, shape, kw) in cases.items():
            if got.dtype != dtype or tuple(got.shape) != shape:
                failures.append(f"{name} {dtype}: {got.dtype} {tuple(got.shape)}")
                continue
            if dtype == torch.float32:
                # torch's own kernel, bit for bit.
                if not torch.equal(got, native(op, *args, shape=shape, **kw)):
                    failures.append(f"{name} fp32 is not torch's kernel's result")
                continue
            # The fp32 product of the exact fp32 values (torch's fp32 kernel), rounded once.
            exact = native(op, *(t.float() for t in args), shape=shape, **kw).to(dtype)
            if not torch.equal(got, exact):
                failures.append(f"{name} {dtype} is not the fp32 product rounded once")
            # torch's own reduced-precision kernel: the same up to the order of the sums.
            own = native(op, *args, shape=shape, **kw)
            if not torch.allclose(got.float(), own.float(), rtol=2e-2, atol=2e-2):
                failures.append(f"{name} {dtype}: {(got.float() - own.float()).abs().max()} from torch's kernel")
    # Through autograd: mm's gradients are mm's too.
    a, b = r(8, 16, dtype=torch.bfloat16).requires_grad_(), r(16, 4, dtype=torch.bfloat16).requires_grad_()
    torch.mm(a, b).sum().backward()
    ones = torch.ones(8, 4, dtype=torch.bfloat16)
    if not torch.equal(a.grad, (ones.float() @ b.detach().float().t()).bfloat16()):
        failures.append("mm's gradient")
    # Mixed dtypes are refused as torch refuses them.
    try:
        torch.mm(a.detach(), b.detach().float())
        failures.append("bf16 @ fp32 was not refused")
    except RuntimeError:
        pass
    print("RESULT " + json.dumps(failures))
""")

# A bf16 GPT trained by the engine on the simulated device within a budget measured from
# a run with the whole device (engine_helpers.measured_budget: its activation peak and a
# quarter of the 16-bit chunks), so chunks move. The engine meters every CPU allocation
# torch makes there.
ENGINE = textwrap.dedent("""
    import copy, json, sys, torch, tidal
    from tidal.models.gpt import TinyGPT
    sys.path.insert(0, sys.argv[1])
    from engine_helpers import gpt_batches, measured_budget, train_tidal, within_budget
    torch.manual_seed(0)
    model = TinyGPT(vocab=512, d=64, layers=4, heads=4, seq=16)
    batches = gpt_batches(4, vocab=512, seq=16)
    tidal.set_device("sim", capacity="1GiB")
    cfg = {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "tidal": {"chunk_size": "64KiB", "device_margin": "256KiB"}}
    budget = measured_budget(model, cfg, batches)
    cfg["tidal"]["device_memory_budget"] = budget
    engine = tidal.initialize(copy.deepcopy(model), cfg)
    losses = train_tidal(engine, batches)
    within_budget(engine)
    r, s = engine.memory_report(), engine.chunks.stats()
    keys = ("peak_nonchunk_device_bytes", "peak_device_bytes", "budget_overruns", "evictions")
    print("RESULT " + json.dumps({"budget": budget, "losses": losses, **{k: r[k] for k in keys},
                                  "h2d": s["bytes_host_to_device"], "d2h": s["bytes_device_to_host"]}))
""")


def _child(code: str, switch: str) -> dict | list:
    env = dict(os.environ, TIDAL_TEST_FP32_GEMM=switch, OMP_NUM_THREADS="1")
    p = subprocess.run([sys.executable, "-c", code, str(HERE)], env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT "))[7:])


def test_reduced_precision_products_are_the_fp32_product_rounded_once_and_fp32_is_torchs():
    assert _child(KERNELS, "1") == []


def test_the_switch_changes_no_counted_device_byte_and_no_chunk_move():
    off, on = _child(ENGINE, "0"), _child(ENGINE, "1")
    # The paths fire: chunks move, within the budget (the child checks the peak; 0 overruns).
    assert on["evictions"] > 0 and on["h2d"] > 0, on
    assert on["budget_overruns"] == 0 and off["budget_overruns"] == 0
    # The fp32 operands and product are uncounted: the same budget (from the whole-device
    # run's activation peak), the same activation peak and bytes as torch's own kernel
    # gives (with them counted: budget 1146954 against 1013834, activation peak 576776
    # against 470280). Where torch's kernel is its reference loop, the host the switch is
    # for, also the same peak and evictions. Where it is oneDNN's (an AVX-512 host) the
    # run with torch's kernel made 56 evictions against 54 and peaked 18812 bytes lower,
    # with the same budget, activation peak and bytes, on the code before and after Note
    # [Images someone still wants] alike: that kernel's own host allocations, counted as
    # device memory here, differ from the reference loop's (not traced further).
    losses = on.pop("losses"), off.pop("losses")
    if not _low_precision_gemm_is_slow():
        for key in ("evictions", "peak_device_bytes"):
            on.pop(key), off.pop(key)
    assert on == off, (on, off)
    # Only the order of the sums differs.
    assert losses[0] == pytest.approx(losses[1], rel=2e-2), losses


def test_a_bad_value_is_refused_by_name():
    env = dict(os.environ, TIDAL_TEST_FP32_GEMM="yes")
    p = subprocess.run([sys.executable, "-c", "import tidal"], env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode != 0
    assert "TIDAL_TEST_FP32_GEMM='yes'" in p.stderr and "expected '1'" in p.stderr, p.stderr[-2000:]
