"""LoRA with peft under tidal.initialize: a frozen base keeps only its 16-bit
copy in chunks, the adapters train as in plain PyTorch + torch.optim.AdamW,
and checkpoints (tidal's, and peft's own adapter files) keep both."""
import copy
import pytest
import torch

import tidal
from tidal.engine.store import FREE, MOMENTUM, PARAM16, PARAM32, VARIANCE

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LR = 2e-3


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def lora_llama():
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    cfg = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                          target_modules=["q_proj", "v_proj", "down_proj"])
    model = peft.get_peft_model(base, cfg)
    # peft starts lora_B at zero; give it values so every adapter matters from step one.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.02)
    return model


def batches(n, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (2, 12), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def config(precision="fp32"):
    cfg = {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
           "tidal": {"chunk_size": 16384, "device_memory_budget": "64MiB", "device_margin": 1024}}
    if precision != "fp32":
        cfg[precision] = {"enabled": True}
    return cfg


def train_engine(engine, data):
    losses = []
    for b in data:
        loss = engine(**b).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def test_adapters_train_as_plain_pytorch_and_the_base_stays_frozen():
    ref = lora_llama()
    model = copy.deepcopy(ref)
    data = batches(6)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR, weight_decay=0.01)
    ref_losses = []
    for b in data:
        loss = ref(**b).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    engine = tidal.initialize(model, config())
    losses = train_engine(engine, data)
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    weights = engine.parameters_fp32()
    trained = 0
    for name, p in ref.named_parameters():
        err = (weights[name] - p.detach()).norm() / p.detach().norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{name}: relative L2 error {err:.3g}"
        trained += p.requires_grad
    assert trained == 12  # lora_A and lora_B of three projections in two layers
    base = [r for r in engine.records if "lora_" not in r.name]
    assert base and not any(r.trainable for r in base)


def test_the_frozen_base_costs_two_bytes_per_parameter_in_bf16():
    model = lora_llama()
    engine = tidal.initialize(model, config("bf16"))
    frozen = sum(r.numel for r in engine.records if not r.trainable)
    assert frozen > 25 * sum(r.numel for r in engine.records if r.trainable)
    assert engine.store.state_bytes_per_param(trainable=False) == 2
    assert engine.store.state_bytes_per_param(trainable=True) == 14
    c = engine.chunks
    for r in engine.records:
        if not r.trainable:
            assert engine.store.kinds_of(r) == (PARAM16,), r.name
            assert all(c.state(r.id, k) == FREE for k in (PARAM32, MOMENTUM, VARIANCE)), r.name
    # Note [Pools keep frozen tensors apart]: no chunk mixes the two, so the
    # chunks hold exactly a 16-bit chunk per chunk and the fp32 master,
    # momentum and variance chunks of the trainable ones only.
    flags = {}
    for r in engine.records:
        flags.setdefault(r.chunk, set()).add(r.trainable)
    assert all(len(f) == 1 for f in flags.values()), flags
    want = sum(c.chunk_capacity_bytes(i, PARAM16)
               + (sum(c.chunk_capacity_bytes(i, k) for k in (PARAM32, MOMENTUM, VARIANCE))
                  if True in f else 0)
               for i, f in flags.items())
    s = c.stats()
    assert s["resident_bytes_host"] + s["resident_bytes_device"] == want
    trainable_chunks = sum(True in f for f in flags.values())
    assert trainable_chunks == 1  # 3,328 adapter parameters fit one 16 KiB chunk


def test_checkpoints_keep_frozen_and_trained_weights(tmp_path):
    model = lora_llama()
    twin = copy.deepcopy(model)
    data = batches(4)
    engine = tidal.initialize(model, config())
    train_engine(engine, data[:2])
    engine.save_checkpoint(tmp_path / "ckpt", tag="t")
    # peft's own adapter file: the trained adapter values, not empty tensors.
    model.save_pretrained(tmp_path / "adapter")
    from safetensors.torch import load_file
    saved = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    weights = engine.parameters_fp32()
    assert len(saved) == 12
    for key, value in saved.items():
        name = next(n for n in weights if n.replace(".default", "") == key)
        assert value.numel() > 0 and torch.equal(value, weights[name]), key
    # Resume into a fresh engine: the same losses as going on.
    other = tidal.initialize(twin, config())
    other.load_checkpoint(tmp_path / "ckpt", tag="t")
    after = other.parameters_fp32()
    for name, w in weights.items():
        assert torch.equal(after[name], w), name
    assert train_engine(other, data[2:]) == train_engine(engine, data[2:])
