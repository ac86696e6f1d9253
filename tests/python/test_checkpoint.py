"""Checkpoints, state dicts and Hugging Face weights (simulated device).

References are independent of the code under test: an uninterrupted run for
resumption, the plain PyTorch model for state dicts, the Hugging Face model
itself for its weights.
"""
import copy
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import tidal
from tidal.engine.checkpoint import CheckpointError
from tidal.models.gpt import TinyGPT

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import Reversed, measured_budget, train_tidal as train  # noqa: E402
from engine_helpers import gpt_batches as batches  # noqa: E402


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


_MEASURED: dict = {}


def config(**top):
    """The tests' config; without a `tidal` block of its own, the device budget
    is measured on this machine for the TinyGPT these tests train
    (engine_helpers.measured_budget: non-chunk memory differs between CPUs)."""
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": 2e-3, "weight_decay": 0.01}},
           "tidal": {"chunk_size": 16384, "device_margin": 1024}}
    cfg.update(top)
    if "tidal" not in top:
        key = repr(sorted(top.items()))
        if key not in _MEASURED:
            with torch.random.fork_rng():  # the caller's RNG stream stays as it was
                torch.manual_seed(0)
                model = TinyGPT(d=64, seq=8, layers=4, dropout=0.1)
                _MEASURED[key] = measured_budget(model, cfg, batches(2))
        cfg["tidal"]["device_memory_budget"] = _MEASURED[key]
    return cfg


def engine_for(seed=0, hybrid_adam=True, **cfg):
    torch.manual_seed(seed)
    c = config(**cfg)
    c["tidal"]["hybrid_adam"] = hybrid_adam
    return tidal.initialize(TinyGPT(d=64, seq=8, dropout=0.1), c)


def test_resuming_reproduces_the_uninterrupted_run_bit_for_bit(tmp_path):
    data = batches(8)
    # CPU Adam only: hybrid Adam picks the device for chunks resident at the
    # step, which depends on the residency history (a resumed engine starts
    # with none), and device-side Adam rounds differently from CPU Adam.
    # Uninterrupted: 8 steps. Dropout makes the RNG state part of the result.
    straight = engine_for(hybrid_adam=False)
    torch.manual_seed(123)
    expected = train(straight, data)
    # Interrupted after 4 steps, resumed in a fresh engine.
    first = engine_for(hybrid_adam=False)
    torch.manual_seed(123)
    got = train(first, data[:4])
    first.save_checkpoint(tmp_path, client_state={"epoch": 3})
    del first
    second = engine_for(seed=99, hybrid_adam=False)  # other initial weights: all must come from the file
    path, client = second.load_checkpoint(tmp_path)
    assert path.name == "global_step4" and client == {"epoch": 3}
    assert second.global_steps == 4
    got += train(second, data[4:])
    assert got == expected  # bit for bit (fp32 mode)
    a, b = straight.parameters_fp32(), second.parameters_fp32()
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_loss_scaler_and_steps_survive_a_round_trip(tmp_path):
    cfg = {"fp16": {"enabled": True, "initial_scale_power": 8, "hysteresis": 1},
           "train_micro_batch_size_per_gpu": 2}
    engine = engine_for(**cfg)
    train(engine, batches(2))
    x, y = batches(1, seed=7)[0]
    engine.backward(engine(x, y) * float("inf"))
    engine.step()  # overflow: the scale halves
    engine.save_checkpoint(tmp_path, tag="overflowed")
    other = engine_for(**cfg)
    other.load_checkpoint(tmp_path, tag="overflowed")
    assert other.loss_scale == engine.loss_scale == 2 ** 7
    assert other.skipped_steps == 1 and other.global_steps == 3
    assert other.global_samples == engine.global_samples == 6  # DeepSpeed's count, saved too
    assert [r.step for r in other.records] == [r.step for r in engine.records]


_KILLED_SAVE = textwrap.dedent("""
    import os, signal, sys, torch, tidal
    sys.path.insert(0, {tests!r})
    from test_checkpoint import engine_for, batches, train
    from tidal.engine import checkpoint
    tidal.set_device("sim", capacity="1GiB")
    engine = engine_for()
    train(engine, batches(2))
    engine.save_checkpoint({dir!r}, tag="t")
    torch.save(engine.parameters_fp32(), {ref!r})
    train(engine, batches(1, seed=5))
    where = {where!r}
    if where == "writing":     # dies with half the slots written
        real = checkpoint._bytes_of
        count = [0]
        def dying(view):
            count[0] += 1
            if count[0] == 10:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(view)
        checkpoint._bytes_of = dying
    else:                      # dies between the two renames
        real = os.replace
        def dying(src, dst):
            real(src, dst)
            if ".old-" in str(dst):
                os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.os.replace = dying
    engine.save_checkpoint({dir!r}, tag="t")
    print("not killed")
""")


@pytest.mark.parametrize("where", ["writing", "renaming"])
def test_a_save_killed_midway_leaves_the_previous_checkpoint_loadable(tmp_path, where):
    ref = tmp_path / "ref.pt"
    script = _KILLED_SAVE.format(tests=str(Path(__file__).parent), dir=str(tmp_path / "ckpt"),
                                 ref=str(ref), where=where)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == -9, proc.stdout + proc.stderr
    engine = engine_for(seed=42)
    engine.load_checkpoint(tmp_path / "ckpt", tag="t")
    expected = torch.load(ref)
    got = engine.parameters_fp32()
    for k in expected:
        assert torch.equal(got[k], expected[k]), k
    # A later save replaces it normally and removes the killed save's leftovers.
    assert [p.name for p in (tmp_path / "ckpt").glob(".t.*")]
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    assert not list((tmp_path / "ckpt").glob(".t.*"))
    engine.load_checkpoint(tmp_path / "ckpt")


def test_another_model_or_a_corrupt_file_is_a_clear_error(tmp_path):
    engine = engine_for()
    train(engine, batches(1))
    path = engine.save_checkpoint(tmp_path, tag="a")
    torch.manual_seed(0)
    other = tidal.initialize(TinyGPT(d=64, seq=8, layers=3), config())
    with pytest.raises(CheckpointError,
                       match=r"different model: 'blocks\.3\.fc\.bias' in the checkpoint but not"):
        other.load_checkpoint(tmp_path, tag="a")
    states = path / "states.bin"
    data = bytearray(states.read_bytes())
    data[len(data) // 2] ^= 0xFF
    states.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="fails its CRC-32 check"):
        engine_for().load_checkpoint(tmp_path, tag="a")
    states.write_bytes(bytes(data[:-8]))
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        engine_for().load_checkpoint(tmp_path, tag="a")
    # A manifest naming a chunk list this version does not know.
    good = engine.save_checkpoint(tmp_path, tag="k")
    meta = json.loads((good / "meta.json").read_text())
    meta["slots"][0]["kind"] = "param8"
    (good / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"names no chunk list this version knows \(expected one "
                                              r"of param16, param32, momentum, variance, grad32\)"):
        engine_for().load_checkpoint(tmp_path, tag="k")
    with pytest.warns(UserWarning, match="no tag given and no 'latest'"):  # as DeepSpeed
        assert engine_for().load_checkpoint(tmp_path / "empty") == (None, None)
    # Saving or loading with gradients pending is refused, not half-done.
    x, y = batches(1)[0]
    engine.backward(engine(x, y))
    with pytest.raises(RuntimeError, match="pending"):
        engine.save_checkpoint(tmp_path, tag="b")
    with pytest.raises(RuntimeError, match="pending"):
        engine.load_checkpoint(tmp_path, tag="a")


def test_state_dict_loads_into_the_plain_model_and_back():
    torch.manual_seed(0)
    plain = TinyGPT(d=64, seq=8)
    engine = tidal.initialize(copy.deepcopy(plain), config())
    train(engine, batches(3))
    sd = engine.state_dict()
    assert list(sd) == list(plain.state_dict())
    assert all(v.dtype == torch.float32 for v in sd.values() if v.is_floating_point())
    plain.load_state_dict(sd)  # strict: the unwrapped model takes it as is
    plain.eval()
    engine.eval()
    x, _ = batches(1, seed=9)[0]
    with torch.no_grad():
        torch.testing.assert_close(engine(x), plain(x), rtol=0, atol=0)
    # And a plain state_dict into the engine: weights replaced, outputs equal.
    torch.manual_seed(5)
    fresh = TinyGPT(d=64, seq=8).eval()
    engine.load_state_dict(fresh.state_dict())
    with torch.no_grad():
        torch.testing.assert_close(engine(x), fresh(x), rtol=0, atol=0)
    bad = fresh.state_dict()
    bad["wpe.weight"] = torch.zeros(3, 3)
    before = engine.state_dict()
    with pytest.raises(CheckpointError, match=r"'wpe\.weight': \[3, 3\] given, \[8, 64\] in the model"):
        engine.load_state_dict(bad)
    after = engine.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing was loaded
    del bad["wpe.weight"]
    with pytest.raises(CheckpointError, match="missing keys: wpe.weight"):
        engine.load_state_dict(bad)


def test_hugging_face_gpt2_trains_and_loads_save_pretrained_weights(tmp_path):
    import transformers  # installed by scripts/setup.sh
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, n_positions=32, vocab_size=128,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    ref = transformers.GPT2LMHeadModel(cfg)
    model = copy.deepcopy(ref)
    opt = torch.optim.AdamW(ref.parameters(), lr=2e-3, weight_decay=0.01)
    engine = tidal.initialize(model, config(tidal={"chunk_size": 16384, "device_memory_budget": "1MiB",
                                                   "device_margin": 1024}))
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        x = torch.randint(0, 128, (2, 16), generator=g)
        expected = ref(input_ids=x, labels=x).loss
        expected.backward()
        opt.step()
        opt.zero_grad()
        loss = engine(input_ids=x, labels=x).loss
        engine.backward(loss)
        engine.step()
        assert abs(loss.item() - expected.item()) <= 1e-5 * expected.item()
    weights = engine.parameters_fp32()
    for name, p in ref.named_parameters():
        got, want = weights[name], p.detach()
        if name.endswith("attn.c_attn.bias"):
            # The key bias has an exactly-zero true gradient (softmax ignores
            # a per-query constant); Adam normalises rounding noise there.
            got, want = torch.cat([got[:64], got[128:]]), torch.cat([want[:64], want[128:]])
        assert (got - want).norm() <= 1e-5 * want.norm(), name
    assert engine.memory_report()["evictions"] > 0

    # save_pretrained weights (safetensors, tied lm_head omitted) into a tidal model.
    ref.save_pretrained(tmp_path / "hf")
    torch.manual_seed(1)
    fresh = transformers.GPT2LMHeadModel(cfg)
    other = tidal.initialize(fresh, config(tidal={"chunk_size": 16384, "device_margin": 1024}))
    other.load_pretrained(tmp_path / "hf")
    other.eval()
    ref.eval()
    x = torch.randint(0, 128, (2, 16), generator=g)
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=x).logits, ref(input_ids=x).logits,
                                   rtol=0, atol=0)


def test_a_checkpoint_saved_after_the_relayout_resumes_in_a_fresh_engine(tmp_path):
    g = torch.Generator().manual_seed(2)
    data = [(torch.randn(4, 32, generator=g), torch.randn(4, 32, generator=g)) for _ in range(6)]

    def make(seed):
        torch.manual_seed(seed)
        budget = {"chunk_size": 16384, "device_memory_budget": "64KiB", "device_margin": 1024}
        return tidal.initialize(Reversed(depth=6), config(tidal=budget))

    straight = make(0)
    expected = train(straight, data)
    first = make(0)
    got = train(first, data[:3])
    assert first.relayouts == 1
    first.save_checkpoint(tmp_path)
    second = make(7)  # module-order chunks: no relayout yet
    assert second.relayouts == 0
    second.load_checkpoint(tmp_path)
    got += train(second, data[3:])
    assert got == expected
    a, b = straight.parameters_fp32(), second.parameters_fp32()
    assert all(torch.equal(a[k], b[k]) for k in a)
