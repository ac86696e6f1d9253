"""Third-party models under tidal: each built from a tiny config (nothing is
downloaded), trained in plain PyTorch + tidal.optim.CPUAdam and under
tidal.initialize on the simulated device with a device budget below its
state, and compared bit for bit. Writes benchmarks/results/model_zoo-<machine>.json;
the "Models tried" table of docs/models.md is generated from it (benchmarks/make_table.py).

    python benchmarks/model_zoo.py [--steps 5] [--only llama lstm ...] [--quick] [--output F]

Issue 27's list: Hugging Face families (transformers 4.57, built from
configs), torch's own layers (nn.MultiheadAttention, nn.TransformerEncoder /
nn.TransformerDecoder, nn.LSTM, nn.GRU) and the ways weights are shared
(tied embeddings, a module called twice, frozen parameters). torchvision does
not install beside torch 2.13 here (PyPI's wheel fails to import with it), so
the convolutional networks are the Hugging Face implementations of the same
architectures.

For each model, per run:
  * plain: the model in plain PyTorch, tidal.optim.CPUAdam over the
    parameters that require gradients (lr and weight decay of the engine's
    AdamW config; CPUAdam is the engine's SIMD Adam arithmetic, so equal
    gradients give equal weights bit for bit).
  * tidal: a copy of the same initial model under tidal.initialize with a
    device budget measured on this machine (measured_budget(): the non-chunk
    peak of a probe run plus a quarter of the 16-bit chunks, or what its
    parameters attached at once needed if that is more), so chunks are
    evicted and brought back every step (evictions > 0), and no step may go
    over the budget (budget_overruns == 0).
The losses and the whole state_dict (weights, tied keys, buffers such as
BatchNorm's running statistics) are compared bit for bit; where they differ
the largest relative L2 error is recorded. A failure records the exception's
type, message and the innermost frames. Each model runs in its own
subprocess (a crash or leaked engine state cannot touch the next model);
tests/python/test_model_zoo.py runs the same cases in-process.

Each model's record: name, family, source (the class and what about it is
exercised), note, params and trainable_params, steps; losses_plain and
losses_tidal, losses_equal, weights_equal (every state_dict key),
max_relative_loss_error and max_relative_weight_error (0 when equal; L2 per
tensor, the largest), tensors_differing; device_budget, param_chunk_bytes
(the 16-bit chunks), peak_nonchunk_device_bytes, evictions,
bytes_host_to_device_last_step / bytes_device_to_host_last_step,
budget_overruns; seconds_plain, seconds_budget_probe and seconds_tidal
(initialize + the steps); warnings (distinct messages); rnn_kernels for the
RNN models; on failure error {type, message, where} and diagnosis (REFUSED);
trains (no error, bitwise equal, evictions > 0, no overrun).

On the simulated device "device" memory is host memory: these runs check
that the models train exactly while their chunks move, not speed; the
seconds are recorded only to show what each run cost.
"""
from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from typing import Callable, Dict, List, Optional

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402
import tidal  # noqa: E402
from tidal._C.chunks import ChunkKind  # noqa: E402

__all__ = ["LR", "WEIGHT_DECAY", "CASES", "Case", "engine_config", "measured_budget", "train_plain",
           "train_engine", "run_case"]

LR = 2e-3
WEIGHT_DECAY = 0.01
CHUNK = 16384           # bytes of a 16-bit chunk: several chunks per model at these sizes
VOCAB = 128
SEQ = 16
BATCH = 2


# ------------------------------------------------------------------ data
def _generator(seed):
    return torch.Generator().manual_seed(seed)


def lm_batches(n, seed=1):
    """Token ids as Hugging Face models take them (labels = inputs)."""
    g = _generator(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


def seq2seq_batches(n, seed=1):
    g = _generator(seed)
    return [{"input_ids": torch.randint(3, VOCAB, (BATCH, SEQ), generator=g),
             "labels": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)} for _ in range(n)]


def image_batches(n, size=32, classes=10, seed=2):
    g = _generator(seed)
    return [{"pixel_values": torch.randn(BATCH, 3, size, size, generator=g),
             "labels": torch.randint(0, classes, (BATCH,), generator=g)} for _ in range(n)]


def whisper_batches(n, mel=16, frames=32, seed=3):
    g = _generator(seed)
    return [{"input_features": torch.randn(BATCH, mel, frames, generator=g),
             "labels": torch.randint(3, VOCAB, (BATCH, SEQ // 2), generator=g)} for _ in range(n)]


def clip_batches(n, seed=4):
    g = _generator(seed)
    return [{"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             "pixel_values": torch.randn(BATCH, 3, 16, 16, generator=g),
             "return_loss": True} for _ in range(n)]


def pair_batches(n, seed=5):
    """(input, target) token pairs for the torch-layer models."""
    g = _generator(seed)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)) for _ in range(n)]


def hf_loss(model, batch):
    """A Hugging Face model (or the engine around one) called as it is."""
    return model(**batch).loss


def pair_loss(model, batch):
    return model(*batch)


# ------------------------------------------------------- Hugging Face models
def _hf(name):
    import transformers

    return getattr(transformers, name)


def _causal(model_cls, config_cls, **extra):
    def build():
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=32)
        config.update(extra)
        return _hf(model_cls)(_hf(config_cls)(**config))
    return build


def llama(**extra):
    return _causal("LlamaForCausalLM", "LlamaConfig", num_key_value_heads=2, **extra)


def llama_frozen():
    """A fine-tune's usual freeze: the embeddings and the first block."""
    model = llama()()
    model.model.embed_tokens.weight.requires_grad_(False)
    for p in model.model.layers[0].parameters():
        p.requires_grad_(False)
    return model


def gpt2():
    return _hf("GPT2LMHeadModel")(_hf("GPT2Config")(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=32,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def gpt_neox():
    return _hf("GPTNeoXForCausalLM")(_hf("GPTNeoXConfig")(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=32, rotary_pct=0.25))


def opt():
    return _hf("OPTForCausalLM")(_hf("OPTConfig")(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0))


def _masked(model_cls, config_cls, **extra):
    def build():
        config = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, max_position_embeddings=40,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        config.update(extra)
        return _hf(model_cls)(_hf(config_cls)(**config))
    return build


def t5():
    return _hf("T5ForConditionalGeneration")(_hf("T5Config")(
        vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4,
        dropout_rate=0.0, decoder_start_token_id=0))


def bart():
    return _hf("BartForConditionalGeneration")(_hf("BartConfig")(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128,
        max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def whisper():
    return _hf("WhisperForConditionalGeneration")(_hf("WhisperConfig")(
        vocab_size=VOCAB, num_mel_bins=16, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_source_positions=16, max_target_positions=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1,
        begin_suppress_tokens=None, suppress_tokens=None))


def vit():
    return _hf("ViTForImageClassification")(_hf("ViTConfig")(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        image_size=32, patch_size=8, num_labels=10))


def clip():
    text = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, max_position_embeddings=SEQ)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  image_size=16, patch_size=4)
    return _hf("CLIPModel")(_hf("CLIPConfig")(text_config=text, vision_config=vision, projection_dim=32))


def resnet():
    # ResNet-18's layout (basic blocks), narrow.
    return _hf("ResNetForImageClassification")(_hf("ResNetConfig")(
        embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[2, 2, 2, 2], layer_type="basic",
        num_labels=10))


def mobilenet_v2():
    return _hf("MobileNetV2ForImageClassification")(_hf("MobileNetV2Config")(
        image_size=32, depth_multiplier=0.35, finegrained_output=False, classifier_dropout_prob=0.0,
        num_labels=10))


def efficientnet():
    # EfficientNet-B0's stage layout, width and depth scaled down; hidden_dim
    # must be the top convolution's width, round_filters(1280) = 320 at width 0.25.
    return _hf("EfficientNetForImageClassification")(_hf("EfficientNetConfig")(
        image_size=32, width_coefficient=0.25, depth_coefficient=0.5, hidden_dim=320,
        dropout_rate=0.0, drop_connect_rate=0.0, num_labels=10))


def convnext():
    return _hf("ConvNextForImageClassification")(_hf("ConvNextConfig")(
        hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 2, 1], num_labels=10))


# ------------------------------------------------------- torch's own layers
class AttentionLM(torch.nn.Module):
    """Embedding -> nn.MultiheadAttention (causal) -> head."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.attn = torch.nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        out, _ = self.attn(h, h, h, attn_mask=mask, need_weights=False)
        return F.cross_entropy(self.head(self.norm(h + out)).flatten(0, 1), y.flatten())


class EncoderDecoderLM(torch.nn.Module):
    """nn.TransformerEncoder and nn.TransformerDecoder stacks, built separately."""

    def __init__(self, d=64, heads=4):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        layer = dict(d_model=d, nhead=heads, dim_feedforward=128, dropout=0.0, batch_first=True)
        self.encoder = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(**layer), 2,
                                                   enable_nested_tensor=False)
        self.decoder = torch.nn.TransformerDecoder(torch.nn.TransformerDecoderLayer(**layer), 2)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        mask = torch.nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        memory = self.encoder(h)
        out = self.decoder(h, memory, tgt_mask=mask, tgt_is_causal=True)
        return F.cross_entropy(self.head(out).flatten(0, 1), y.flatten())


class RecurrentLM(torch.nn.Module):
    """Embedding -> a 2-layer nn.LSTM or nn.GRU -> head."""

    def __init__(self, cell, d=64):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.rnn = cell(d, d, num_layers=2, batch_first=True)
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, x, y):
        out, _ = self.rnn(self.emb(x))
        return F.cross_entropy(self.head(out).flatten(0, 1), y.flatten())


class SharedBlockLM(torch.nn.Module):
    """One block called twice per forward (its gradient lands twice)."""

    def __init__(self, d=64):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, d)
        self.block = torch.nn.Sequential(torch.nn.LayerNorm(d), torch.nn.Linear(d, 2 * d),
                                         torch.nn.GELU(), torch.nn.Linear(2 * d, d))
        self.head = torch.nn.Linear(d, VOCAB)

    def forward(self, x, y):
        h = self.emb(x)
        h = h + self.block(h)
        h = h + self.block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


# ------------------------------------------------------------------ the zoo
@dataclasses.dataclass(frozen=True)
class Case:
    """One model of the zoo: how to build it, its data and its loss.

    Args:
        name: short id (the test's parameter, --only).
        family: the table's group.
        source: the class that is built, and what about it is exercised.
        build: returns the model, freshly initialized (from the global seed).
        batches: batches(n) -> n batches, the same for every call.
        loss: loss(model_or_engine, batch) -> the scalar loss.
        note: what the table should say beside the result.
    """
    name: str
    family: str
    source: str
    build: Callable[[], torch.nn.Module]
    batches: Callable[[int], list]
    loss: Callable
    note: str = ""


HF = "Hugging Face transformers"
VISION = "vision (torchvision stand-ins)"
TORCH = "torch layers"
RNN = "RNN"
SHARING = "shared and frozen weights"
NOT_TORCHVISION = ("the Hugging Face implementation: torchvision does not install beside torch 2.13 "
                   "here")

CASES: List[Case] = [
    Case("llama", HF, "LlamaForCausalLM (GQA: 4 heads, 2 KV heads)", llama(), lm_batches, hf_loss),
    Case("mistral", HF, "MistralForCausalLM (sliding window 8 < seq 16)",
         _causal("MistralForCausalLM", "MistralConfig", num_key_value_heads=2, sliding_window=8),
         lm_batches, hf_loss),
    Case("qwen2", HF, "Qwen2ForCausalLM (q/k/v biases)",
         _causal("Qwen2ForCausalLM", "Qwen2Config", num_key_value_heads=2), lm_batches, hf_loss),
    Case("gpt2", HF, "GPT2LMHeadModel (Conv1D layers, head tied to wte)", gpt2, lm_batches, hf_loss),
    Case("gpt_neox", HF, "GPTNeoXForCausalLM (partial rotary, parallel residual)", gpt_neox,
         lm_batches, hf_loss),
    Case("opt", HF, "OPTForCausalLM (learned positions with offset)", opt, lm_batches, hf_loss),
    Case("bert", HF, "BertForMaskedLM (decoder tied to word embeddings)",
         _masked("BertForMaskedLM", "BertConfig"), lm_batches, hf_loss),
    Case("roberta", HF, "RobertaForMaskedLM",
         _masked("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1), lm_batches, hf_loss),
    Case("albert", HF, "AlbertForMaskedLM (one layer group shared by both layers)",
         _masked("AlbertForMaskedLM", "AlbertConfig", embedding_size=32), lm_batches, hf_loss),
    Case("t5", HF, "T5ForConditionalGeneration (relative position buckets, tied embeddings)", t5,
         seq2seq_batches, hf_loss),
    Case("bart", HF, "BartForConditionalGeneration", bart, seq2seq_batches, hf_loss),
    Case("whisper", HF, "WhisperForConditionalGeneration (conv front end, 16 mel bins)", whisper,
         whisper_batches, hf_loss),
    Case("mixtral", HF, "MixtralForCausalLM (8 experts, top-1 routing: every step some experts "
         "get no token and no gradient)",
         _causal("MixtralForCausalLM", "MixtralConfig", num_key_value_heads=2, num_local_experts=8,
                 num_experts_per_tok=1), lm_batches, hf_loss),
    Case("vit", HF, "ViTForImageClassification", vit, image_batches, hf_loss),
    Case("clip", HF, "CLIPModel (text + vision towers, contrastive loss)", clip, clip_batches, hf_loss),
    Case("resnet", VISION, "ResNetForImageClassification (ResNet-18 layout: basic blocks 2-2-2-2, "
         "BatchNorm)", resnet, image_batches, hf_loss, NOT_TORCHVISION),
    Case("mobilenet_v2", VISION, "MobileNetV2ForImageClassification (depth multiplier 0.35)",
         mobilenet_v2, image_batches, hf_loss,
         NOT_TORCHVISION + "; MobileNetV3 has no Hugging Face class, V2 stands in"),
    Case("efficientnet", VISION, "EfficientNetForImageClassification (B0 stages, width 0.25, "
         "depth 0.5)", efficientnet, image_batches, hf_loss, NOT_TORCHVISION),
    Case("convnext", VISION, "ConvNextForImageClassification", convnext, image_batches, hf_loss,
         NOT_TORCHVISION),
    Case("multihead_attention", TORCH, "nn.MultiheadAttention (causal mask; out_proj read "
         "without being called)", AttentionLM, pair_batches, pair_loss),
    Case("transformer_encoder_decoder", TORCH, "nn.TransformerEncoder + nn.TransformerDecoder, "
         "2 layers each", EncoderDecoderLM, pair_batches, pair_loss),
    Case("lstm", RNN, "nn.LSTM language model, 2 layers",
         lambda: RecurrentLM(torch.nn.LSTM), pair_batches, pair_loss),
    Case("gru", RNN, "nn.GRU language model, 2 layers",
         lambda: RecurrentLM(torch.nn.GRU), pair_batches, pair_loss),
    Case("tied_embeddings", SHARING, "LlamaForCausalLM, tie_word_embeddings=True",
         llama(tie_word_embeddings=True), lm_batches, hf_loss),
    Case("shared_module", SHARING, "one block called twice per forward (torch layers)",
         SharedBlockLM, pair_batches, pair_loss),
    Case("frozen", SHARING, "LlamaForCausalLM, embeddings and first block requires_grad=False",
         llama_frozen, lm_batches, hf_loss),
]
BY_NAME: Dict[str, Case] = {c.name: c for c in CASES}

# The models tidal refuses today, and why (what was found running them; the
# test marks them xfail(strict=True), so a fix turns them into failures to
# un-mark). The result file records the exception itself.
REFUSED: Dict[str, str] = {}
QUICK = ["llama", "lstm", "resnet"]


# ------------------------------------------------------------ the two runs
def engine_config(budget=0) -> dict:
    return {"gradient_clipping": 0.0, "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "tidal": {"chunk_size": CHUNK, "device_memory_budget": budget, "device_margin": 1024}}


def train_plain(model, batches, loss_of) -> List[float]:
    """Plain PyTorch with CPUAdam (the engine's Adam arithmetic)."""
    opt = tidal.optim.CPUAdam([p for p in model.parameters() if p.requires_grad], lr=LR,
                              weight_decay=WEIGHT_DECAY)
    losses = []
    for batch in batches:
        loss = loss_of(model, batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def train_engine(engine, batches, loss_of) -> List[float]:
    losses = []
    for batch in batches:
        loss = loss_of(engine, batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def measured_budget(model, batches, loss_of, chunk_share=0.25, slack=1.25) -> int:
    """A device budget below the model's state, measured on this machine.

    tests/python/engine_helpers.measured_budget's rule for a model trained
    through `loss_of`, with the chunk room of tests/python/test_engine_budget.py:
    a throwaway copy trains two steps with the whole device; the budget is the
    margin + `slack` x that run's peak non-chunk bytes (the part above 1x
    at most a quarter of the 16-bit chunks) + the larger of
    `chunk_share` of the 16-bit chunks and the chunk bytes its attached
    parameters needed at once (a module called twice or a tied weight stays
    attached through backward, so that can be more than any one module's).
    Measured, not a constant: non-chunk bytes (on the simulated device every
    CPU allocation torch makes) differ between CPUs.
    """
    probe = tidal.initialize(copy.deepcopy(model), engine_config(0))
    try:
        train_engine(probe, batches[:2], loss_of)
        nonchunk = probe.memory_report()["peak_nonchunk_device_bytes"]
        c = probe.chunks
        chunk16 = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16) for i in range(c.num_chunks))
        in_use = probe._wiring.hooks.peak_bytes_in_use
        # (The slack above the probe's non-chunk bytes, for what differs when
        # chunks move, is capped at a quarter of the 16-bit chunks: where
        # non-chunk bytes dwarf the chunks, a quarter of them held every chunk.)
        extra = min(int((slack - 1) * nonchunk), chunk16 // 4)
        return probe.store.margin + nonchunk + extra + max(in_use, int(chunk_share * chunk16))
    finally:
        probe.remove_hooks()


def rnn_kernels(model, batch, loss_of) -> List[str]:
    """The aten RNN ops one training step of a copy of `model` runs (on a CPU
    with oneDNN, nn.LSTM is aten.mkldnn_rnn_layer; nn.GRU has no fused CPU
    kernel and runs as its cell's matmuls and pointwise ops)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.add(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as ops:
        loss_of(copy.deepcopy(model), batch).backward()
    return sorted(op for op in ops.seen if any(w in op for w in ("rnn", "lstm", "gru")))


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not got.is_floating_point():
        return 0.0 if torch.equal(got, want) else float("inf")
    got, want = got.double(), want.double()
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def compare(engine, ref, ref_losses, losses) -> dict:
    """Losses and the whole state_dict (weights, tied keys, buffers), bit for bit."""
    want = ref.state_dict()
    got = engine.state_dict()
    differ = [k for k in want if k not in got or not torch.equal(got[k], want[k].to(got[k].dtype))]
    loss_err = max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(losses, ref_losses)), default=0.0)
    return {
        "losses_equal": losses == ref_losses,
        "weights_equal": not differ and got.keys() == want.keys(),
        "max_relative_loss_error": loss_err,
        "max_relative_weight_error": max((_relative_error(got[k], want[k]) for k in differ if k in got),
                                         default=0.0),
        "tensors_differing": differ[:10],
        "state_dict_keys": len(want),
    }


def _error(e: BaseException) -> dict:
    """The exception's type, message and innermost frames (paths relative to the repository)."""
    def where(f):
        path = os.path.relpath(f.filename, common.ROOT) if f.filename.startswith(str(common.ROOT)) \
            else f.filename
        return f"{path}:{f.lineno} {f.name}"
    frames = traceback.extract_tb(e.__traceback__)
    return {"type": f"{type(e).__module__}.{type(e).__qualname__}", "message": str(e),
            "where": [where(f) for f in frames[-6:]]}


def run_case(case: Case, steps: int, catch: bool = True) -> dict:
    """Trains `case` both ways for `steps` steps; the record of the result.

    Needs the simulated device set (tidal.set_device). With `catch`, a
    failure under tidal is recorded in "error" and the engine's hooks are
    removed; without, it is raised (the test's way). A failure in plain
    PyTorch is always raised: it is the zoo's own bug."""
    torch.manual_seed(0)
    ref = case.build()
    model = copy.deepcopy(ref)
    batches = case.batches(steps)
    record = {
        "name": case.name, "family": case.family, "source": case.source, "note": case.note,
        "params": sum(p.numel() for p in ref.parameters()),
        "trainable_params": sum(p.numel() for p in ref.parameters() if p.requires_grad),
        "steps": steps,
    }
    if case.family == RNN:
        record["rnn_kernels"] = rnn_kernels(ref, batches[0], case.loss)
    torch.manual_seed(1)
    t0 = time.perf_counter()
    ref_losses = train_plain(ref, batches, case.loss)
    record["seconds_plain"] = time.perf_counter() - t0
    record["losses_plain"] = ref_losses
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = None
        try:
            t0 = time.perf_counter()
            budget = measured_budget(model, batches, case.loss)
            record["seconds_budget_probe"] = time.perf_counter() - t0
            record["device_budget"] = budget
            torch.manual_seed(1)
            t0 = time.perf_counter()
            engine = tidal.initialize(model, engine_config(budget))
            losses = train_engine(engine, batches, case.loss)
            record["seconds_tidal"] = time.perf_counter() - t0
            record["losses_tidal"] = losses
            report = engine.memory_report()
            c = engine.chunks
            record["param_chunk_bytes"] = sum(c.chunk_capacity_bytes(i, ChunkKind.PARAM16)
                                              for i in range(c.num_chunks))
            record["evictions"] = report["evictions"]
            record["bytes_host_to_device_last_step"] = report["bytes_host_to_device_last_step"]
            record["bytes_device_to_host_last_step"] = report["bytes_device_to_host_last_step"]
            record["peak_nonchunk_device_bytes"] = report["peak_nonchunk_device_bytes"]
            record["budget_overruns"] = report["budget_overruns"]
            record.update(compare(engine, ref, ref_losses, losses))
        except Exception as e:  # noqa: BLE001 - every failure is the result
            if not catch:
                raise
            record["error"] = _error(e)
            record["diagnosis"] = REFUSED.get(case.name)
        finally:
            if engine is not None:
                engine.remove_hooks()
    record["warnings"] = sorted({str(w.message)[:300] for w in caught})
    record["trains"] = trains(record)
    return record


def trains(record: dict) -> bool:
    """Bitwise equal, chunks moved, never over the budget, no error."""
    return ("error" not in record and record["losses_equal"] and record["weights_equal"]
            and record["evictions"] > 0 and record["budget_overruns"] == 0)


# ------------------------------------------------------------------ driver
def _child(name: str, steps: int, output: str) -> int:
    tidal.set_device("sim", capacity="1GiB")
    record = run_case(BY_NAME[name], steps)
    with open(output, "w") as f:
        json.dump(record, f)
    return 0


def _in_subprocess(case: Case, steps: int, timeout: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "record.json")
        cmd = [sys.executable, os.path.abspath(__file__), "--child", case.name, "--steps", str(steps),
               "--output", out]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"name": case.name, "family": case.family, "source": case.source, "note": case.note,
                    "steps": steps, "trains": False,
                    "error": {"type": "timeout", "message": f"no result after {timeout:.0f} s", "where": []}}
        if os.path.exists(out):
            with open(out) as f:
                return json.load(f)
        return {"name": case.name, "family": case.family, "source": case.source, "note": case.note,
                "steps": steps, "trains": False,
                "error": {"type": "crash", "message": f"exit code {proc.returncode}: "
                          + proc.stderr[-2000:], "where": []}}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--only", nargs="+", choices=list(BY_NAME), help="these models only")
    ap.add_argument("--quick", action="store_true", help=f"{', '.join(QUICK)}, 2 steps (not tabled)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per model")
    ap.add_argument("--output", default=None)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        return _child(args.child, args.steps, args.output)
    if args.quick:
        args.steps = 2
    names = args.only or (QUICK if args.quick else list(BY_NAME))
    records = []
    for name in names:
        record = _in_subprocess(BY_NAME[name], args.steps, args.timeout)
        records.append(record)
        status = "trains bitwise" if record["trains"] else (
            f"{record['error']['type']}: {record['error']['message'][:200]}" if "error" in record
            else f"differs (loss rel {record['max_relative_loss_error']:.2g}, "
                 f"weights rel {record['max_relative_weight_error']:.2g})")
        print(f"{name:28s} {status}", flush=True)
    import transformers

    payload = {"quick": args.quick, "steps": args.steps, "lr": LR, "weight_decay": WEIGHT_DECAY,
               "chunk_size": CHUNK, "simulated_device": "sim, capacity 1GiB",
               "transformers": transformers.__version__,
               "mkldnn_available": torch.backends.mkldnn.is_available(),
               "models": records}
    name = "model_zoo-quick" if args.quick else "model_zoo"
    if args.only and not args.output:
        name += "-partial"
    path = common.write_result(name, payload, args.output)
    print(f"{sum(r['trains'] for r in records)}/{len(records)} train bitwise; wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
