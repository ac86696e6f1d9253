"""tidal.optimizer_state_dtype "bf16": Adam's momentum and variance in bf16
chunks (10 bytes per parameter in mixed precision instead of 14; Note
[16-bit optimizer state] in cpu_adam/adam.h), against an independent
reference written here with torch ops, on the host and on both device paths,
and the pool it buys: a model 14/10 as large trains in the same budgets."""
import copy
import sys
from pathlib import Path

import pytest
import torch

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import gpt_batches, measured_budget, train_tidal  # noqa: E402
from tidal.engine.store import MOMENTUM, PARAM32, VARIANCE  # noqa: E402
from tidal.models.gpt import TinyGPT  # noqa: E402

LR, WD, B1, B2, EPS = 2e-3, 0.01, 0.9, 0.999, 1e-8


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def config(budget="64MiB", **tidal_keys):
    t = {"chunk_size": 16384, "device_memory_budget": budget, "device_margin": 1024,
         "optimizer_state_dtype": "bf16"}
    t.update(tidal_keys)
    return {"gradient_clipping": 0.0, "tidal": t,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}}}


def reference_step(params, state, step):
    """AdamW with bf16 moments: each moment widened to fp32, updated, used
    for the weight, then rounded to nearest even (torch's .to(bfloat16)); the
    operation order of tidal's scalar kernel (cpu_adam/reference.cpp)."""
    bc1 = 1 - B1 ** step
    bc2_sqrt = (1 - B2 ** step) ** 0.5
    with torch.no_grad():
        for p in params:
            g = p.grad
            m, v = (t.float() for t in state.setdefault(
                id(p), [torch.zeros_like(p, dtype=torch.bfloat16)] * 2))
            p.mul_(torch.tensor(1 - LR * WD, dtype=torch.float32))
            m = m + torch.tensor(1 - B1, dtype=torch.float32) * (g - m)
            v = v * torch.tensor(B2, dtype=torch.float32) + (torch.tensor(1 - B2, dtype=torch.float32) * g) * g
            denom = v.sqrt() / torch.tensor(bc2_sqrt, dtype=torch.float32) + torch.tensor(EPS, dtype=torch.float32)
            p.add_((torch.tensor(-LR / bc1, dtype=torch.float32) * m) / denom)
            state[id(p)] = [m.to(torch.bfloat16), v.to(torch.bfloat16)]
            p.grad = None


@pytest.mark.parametrize("side", ["host", "device-simd", "device-fused"])
def test_bf16_moments_match_an_independent_reference(side):
    torch.manual_seed(0)
    ref = TinyGPT(d=64, seq=8)
    model = copy.deepcopy(ref)
    batches = gpt_batches(8)
    state, ref_losses = {}, []
    for i, (x, y) in enumerate(batches, 1):
        loss = ref(x, y)
        loss.backward()
        reference_step(list(ref.parameters()), state, i)
        ref_losses.append(loss.item())
    if side == "host":
        cfg = config(hybrid_adam=False)
        cfg["tidal"]["device_memory_budget"] = measured_budget(model, cfg, batches)
    else:
        cfg = config(hybrid_adam=True)
    engine = tidal.initialize(model, cfg)
    if side == "device-fused":
        engine._step.device_adam_kernel = "fused"  # torch's fused AdamW over fp32 temporaries
    losses = train_tidal(engine, batches)
    r = engine.memory_report()
    assert r["state_bytes_per_param"] == 12  # fp32 training: 4 + 4 + 2 + 2
    if side == "host":
        assert r["adam_chunks_on_device"] == 0 and r["evictions"] > 0
    else:
        assert r["adam_chunks_on_host"] == 0
    weights = engine.parameters_fp32()
    # The reference's constants (bias corrections, step size) round as
    # torch's scalars do, the kernel's as C++ doubles cast once: an ulp apart
    # now and then, and a moment an ulp apart can round to the neighbouring
    # bf16 value. So: close, not bitwise (an fp32-moment run differs from this
    # reference by 5.5e-4 after these steps: the check tells the two apart).
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    for name, p in ref.named_parameters():
        err = ((weights[name] - p.detach()).norm() / p.detach().norm()).item()
        assert err <= 1e-4, f"{name}: relative error {err:.3g}"
    # The moments are bf16 chunks, half the bytes of the fp32 master's.
    c = engine.chunks
    rec = engine.records[0]
    assert c.chunk_capacity_bytes(rec.chunk, MOMENTUM) * 2 == c.chunk_capacity_bytes(rec.chunk, PARAM32)
    assert c.chunk_capacity_bytes(rec.chunk, VARIANCE) * 2 == c.chunk_capacity_bytes(rec.chunk, PARAM32)


def test_ten_bytes_per_parameter_and_a_model_14_10_as_large_in_the_same_pool():
    host, device = 192 << 20, 32 << 20
    d, seq = 128, 16

    def cfg(states):
        return {"gradient_clipping": 0.0, "bf16": {"enabled": True},
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                "tidal": {"chunk_size": "1MiB", "host_memory_budget": host,
                          "device_memory_budget": device, "optimizer_state_dtype": states}}
    per_layer = 12 * d * d + 13 * d
    layers = int((0.9 * (host + device) / 10 - (96 + seq + 2) * d) / per_layer)
    assert layers * per_layer > 1.39 * 0.9 * (host + device) / 14  # 14/10 of 14 B/param's 0.9
    with tidal.init_context(cfg("bf16")):
        model = TinyGPT(vocab=96, d=d, layers=layers, heads=4, seq=seq)
    engine = tidal.initialize(model, cfg("bf16"))
    assert engine.memory_report()["state_bytes_per_param"] == 10
    assert engine.memory_report()["largest_model_params"] == (
        engine.store.capacity_bytes()[0] + engine.store.capacity_bytes()[1]) // 10
    x = torch.randint(0, 96, (1, seq), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(5):
        loss = engine(x, torch.roll(x, -1, 1))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.05, losses
    r = engine.memory_report()
    assert r["budget_overruns"] == 0 and r["peak_device_bytes"] <= device
    assert r["peak_chunk_host_bytes"] <= host


def test_a_checkpoint_of_other_moments_is_refused(tmp_path):
    torch.manual_seed(0)
    model = TinyGPT(d=64, seq=8)
    twin = copy.deepcopy(model)
    engine = tidal.initialize(model, config())
    train_tidal(engine, gpt_batches(1))
    engine.save_checkpoint(tmp_path, tag="t")
    fp32 = config()
    fp32["tidal"]["optimizer_state_dtype"] = "fp32"
    other = tidal.initialize(twin, fp32)
    with pytest.raises(tidal.engine.checkpoint.CheckpointError, match=r"bf16 Adam moments, the engine "
                                                                      r"keeps fp32"):
        other.load_checkpoint(tmp_path, tag="t")
    other.load_checkpoint(tmp_path, tag="t", load_optimizer_states=False)
