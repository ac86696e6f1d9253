"""Hugging Face models as they are (transformers, built from configs; nothing
is downloaded): LlamaForCausalLM, GPT2LMHeadModel and BertForMaskedLM train
under tidal.initialize with their own forward (ModelOutput) and match plain
PyTorch + torch.optim.AdamW; tidal.init_context builds them straight into
chunks with post_init's initialisation kept and no dead copy of tied weights;
engine.save_pretrained writes what transformers' from_pretrained loads.
"""
import copy
import sys
from pathlib import Path

import pytest
import torch
import transformers

import tidal

sys.path.insert(0, str(Path(__file__).parent))
from engine_helpers import measured_budget, within_budget, raw_numel  # noqa: E402

LR = 2e-3


@pytest.fixture(autouse=True)
def simulated_device():
    tidal.set_device("sim", capacity="1GiB")


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
        tie_word_embeddings=True))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def bert():
    return transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


MODELS = {"llama": llama, "gpt2": gpt2, "bert": bert}


def batches(n=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (2, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def config(**tidal_keys):
    t = {"chunk_size": 16384, "device_margin": 1024}
    t.update(tidal_keys)
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}}, "tidal": t}


class _Fitted:
    """engine_helpers.measured_budget for models called with keyword batches."""

    def __init__(self, model):
        self.model = model

    def __call__(self, x, y):
        return self.model(**x).loss


def fitted_config(make):
    cfg = config()
    probe = make()
    data = [(b, None) for b in batches(2)]
    wrapper = _Fitted(probe)

    class Module(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = probe

        def forward(self, x, y):
            return wrapper(x, y)

    cfg["tidal"]["device_memory_budget"] = measured_budget(Module(), cfg, data)
    return cfg


def zero_gradient(name):
    # The attention key bias has a gradient of exactly zero in exact
    # arithmetic (softmax ignores a shift): Adam turns rounding noise there
    # into lr-sized steps that no two implementations share.
    return name.endswith(("attn.c_attn.bias", "attention.self.key.bias"))


@pytest.mark.parametrize("name", list(MODELS))
def test_trains_with_its_own_forward_and_matches_adamw(name):
    make = MODELS[name]
    torch.manual_seed(0)
    ref = make()
    model = copy.deepcopy(ref)
    data = batches()
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    ref_losses = []
    for b in data:
        out = ref(**b)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(out.loss.item())
    cfg = fitted_config(make)
    engine = tidal.initialize(model, cfg)
    losses = []
    for b in data:
        out = engine(**b)
        assert isinstance(out, transformers.utils.ModelOutput)
        engine.backward(out.loss)
        engine.step()
        losses.append(out.loss.item())
    for a, b in zip(ref_losses, losses):
        assert abs(a - b) <= 1e-5 * abs(a), (ref_losses, losses)
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        if name == "gpt2" and key.endswith("c_attn.bias"):
            # Query and value thirds; the key third has a zero gradient (see zero_gradient).
            keep = torch.cat([torch.arange(0, 64), torch.arange(128, 192)])
            p, got = p.detach()[keep], weights[key][keep]
        elif zero_gradient(key):
            continue
        else:
            p, got = p.detach(), weights[key]
        err = (got - p).norm() / p.norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{key}: relative L2 error {err:.3g}"
    assert engine.memory_report()["evictions"] > 0


@pytest.mark.parametrize("name", list(MODELS))
def test_init_context_keeps_post_init_weights_and_no_dead_tied_copy(name):
    make = MODELS[name]
    torch.manual_seed(0)
    ref = make()
    torch.manual_seed(0)
    with tidal.init_context(config()) as store:
        model = make()
    assert all(raw_numel(p) == 0 for p in model.parameters())
    engine = tidal.initialize(model)
    # post_init's draws landed in the chunks, in the same order as outside.
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        assert torch.equal(weights[key], p.detach()), key
    # One record per distinct parameter: the tied head's own weight is gone.
    assert len(engine.store.records) == len({id(p) for p in ref.parameters()})
    assert len(store.records) == len(engine.store.records)
    # The forward computes with the 16-bit slots: they hold the same values.
    ids = batches(1)[0]["input_ids"]
    ref.eval()
    engine.eval()
    with torch.no_grad():
        torch.testing.assert_close(engine(input_ids=ids).logits, ref(input_ids=ids).logits,
                                   rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_save_pretrained_loads_in_transformers_and_round_trips(tmp_path, name):
    make = MODELS[name]
    torch.manual_seed(0)
    model = make()
    engine = tidal.initialize(model, config())
    for b in batches(2):
        engine.backward(engine(**b).loss)
        engine.step()
    # Small shards: the sharded format with its index is what comes out.
    files = engine.save_pretrained(tmp_path / "out", max_shard_size="64KB")
    assert (tmp_path / "out" / "model.safetensors.index.json") in files
    assert (tmp_path / "out" / "config.json").is_file()
    loaded = type(model).from_pretrained(tmp_path / "out")
    want = engine.state_dict()
    for key, value in loaded.state_dict().items():
        torch.testing.assert_close(value, want[key], rtol=0, atol=0, msg=key)
    # And back into a fresh tidal engine: the same logits, exactly.
    torch.manual_seed(1)
    other = tidal.initialize(make(), config())
    other.load_pretrained(tmp_path / "out")
    ids = batches(1)[0]["input_ids"]
    engine.eval()
    other.eval()
    with torch.no_grad():
        torch.testing.assert_close(other(input_ids=ids).logits, engine(input_ids=ids).logits,
                                   rtol=0, atol=0)


def test_save_pretrained_refuses_pending_gradients(tmp_path):
    engine = tidal.initialize(llama(), config())
    engine.backward(engine(**batches(1)[0]).loss)
    with pytest.raises(Exception, match="gradients"):
        engine.save_pretrained(tmp_path / "x")


def test_the_finetune_example_trains_a_local_model_and_saves_it(tmp_path):
    """scripts/finetune_hf.py on a save_pretrained directory the test makes
    from a config: the loss falls, and transformers loads what it saved."""
    import importlib.util

    torch.manual_seed(0)
    source = gpt2()
    source.config.vocab_size = 128
    source.save_pretrained(tmp_path / "base")
    cfg = config()
    cfg["train_micro_batch_size_per_gpu"] = 4
    (tmp_path / "tidal.json").write_text(__import__("json").dumps(cfg))
    spec = importlib.util.spec_from_file_location(
        "finetune_hf", Path(__file__).parents[2] / "scripts" / "finetune_hf.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    out = finetune.main([str(tmp_path / "base"), "--out", str(tmp_path / "tuned"), "--config",
                         str(tmp_path / "tidal.json"), "--steps", "30", "--seq", "16",
                         "--data", "synthetic", "--lr", "0.01"])
    assert out["missing"] == [] and out["unexpected"] == []
    first, last = sum(out["losses"][:5]) / 5, sum(out["losses"][-5:]) / 5
    assert last < first, out["losses"]
    tuned = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "tuned")
    base = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "base")
    changed = [k for k, v in tuned.state_dict().items()
               if v.is_floating_point() and not torch.equal(v, base.state_dict()[k])]
    assert "transformer.h.0.mlp.c_fc.weight" in changed


def test_the_engine_passes_what_it_lacks_to_the_model_as_deepspeed_does():
    # DeepSpeedEngine.__getattr__ hands unknown attributes to its module, so
    # DeepSpeed users write engine.generate(...). Greedy decoding between steps
    # gives plain PyTorch's tokens, with the chunks moving, and training goes on.
    torch.manual_seed(0)
    ref = llama()
    engine = tidal.initialize(copy.deepcopy(ref), fitted_config(llama))
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=0.01)
    data = batches(4)
    prompt = torch.randint(0, 128, (2, 5), generator=torch.Generator().manual_seed(9))
    for i, b in enumerate(data):
        out = engine(**b)
        engine.backward(out.loss)
        engine.step()
        ref(**b).loss.backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            want = ref.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
            got = engine.generate(prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
            assert torch.equal(got, want), (got, want)
    weights = engine.parameters_fp32()
    for key, p in ref.named_parameters():
        err = (weights[key] - p.detach()).norm() / p.norm().clamp_min(1e-12)
        assert err <= 1e-5, f"{key}: relative L2 error {err:.3g}"
    within_budget(engine)
    assert engine.memory_report()["evictions"] > 0
    # The engine's own names win; a name neither has, or a private one, is an error.
    assert isinstance(engine.config, tidal.config.Config)
    assert engine.generation_config is engine.module.generation_config
    with pytest.raises(AttributeError, match="no attribute 'no_such_thing', nor has its model "
                                             "\\(a LlamaForCausalLM\\)"):
        engine.no_such_thing
    with pytest.raises(AttributeError, match="no attribute '_modules'"):
        engine._modules
