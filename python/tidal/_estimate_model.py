"""The model side of tidal.estimate (Note [The pre-flight estimate] in
estimate.py): the model resolved from a preset, a Hugging Face config or a
meta-device module, its tensors in the engine's chunk layout, and one forward
and backward on the meta device for the activation peak and the FLOPs."""
from __future__ import annotations

import copy
import os
import weakref
from pathlib import Path

import torch

from . import _C
from ._schema import read_json_object
from .config import Config


_ELEMENT = {"fp32": 4, "bf16": 2, "fp16": 2}
_TORCH = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_CHUNK_DTYPES = {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32"}


# --------------------------------------------------------------------------- model
def _preset_model(name: str):
    from .models.gpt import PRESETS, TinyGPT
    layers, d, heads, positions, vocab = PRESETS[name]
    with torch.device("meta"):
        model = TinyGPT(vocab=vocab, d=d, layers=layers, heads=heads, seq=positions)
    return model, f"preset {name}", {"kind": "tinygpt", "positions": positions, "vocab": vocab}


def _hf_model(config, origin: str):
    import transformers
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    positions = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    return model, origin, {"kind": "causal_lm", "positions": positions,
                           "vocab": getattr(config, "vocab_size", None)}


def _json_model(path: Path):
    from .models.gpt import TinyGPT
    from .train import _transformers_config, shape_from_hf_config
    if path.is_dir():
        path = path / "config.json"
    hf = read_json_object(path, "Hugging Face config")
    if hf.get("model_type"):
        return _hf_model(_transformers_config(hf, str(path)),
                         f"Hugging Face {hf['model_type']} config {path}")
    shape = shape_from_hf_config(hf, str(path))
    with torch.device("meta"):
        model = TinyGPT(vocab=shape.vocab, d=shape.hidden, layers=shape.layers, heads=shape.heads,
                        seq=shape.positions, tied=shape.tied)
    return model, shape.source, {"kind": "tinygpt", "positions": shape.positions,
                                 "vocab": shape.vocab, "note": shape.note}


def _resolve_model(model):
    """(nn.Module, description, facts) for a preset name, a config.json path,
    a transformers config or an nn.Module."""
    from .models.gpt import PRESETS
    if isinstance(model, torch.nn.Module):
        from .models.gpt import TinyGPT
        kind = "tinygpt" if isinstance(model, TinyGPT) else \
            "causal_lm" if hasattr(model, "config") and hasattr(model, "generate") else "module"
        facts = {"kind": kind}
        if kind == "tinygpt":
            facts.update(positions=model.wpe.num_embeddings, vocab=model.wte.num_embeddings,
                         layers=len(model.blocks), hidden=model.wte.embedding_dim)
        elif kind == "causal_lm":
            c = model.config
            facts.update(positions=getattr(c, "max_position_embeddings", None),
                         vocab=getattr(c, "vocab_size", None))
        return model, f"{type(model).__name__} (given)", facts
    if isinstance(model, (str, os.PathLike)):
        name = os.fspath(model)
        if name in PRESETS:
            return _preset_model(name)
        path = Path(name)
        if path.exists() or name.endswith(".json"):
            if not path.exists():
                raise ValueError(f"Hugging Face config '{name}': no such file")
            return _json_model(path)
        import difflib
        near = difflib.get_close_matches(name, list(PRESETS), n=1, cutoff=0.5)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        raise ValueError(f"unknown model '{name}': not a preset{hint} (presets: "
                         f"{', '.join(PRESETS)}) and no such config.json file")
    if type(model).__module__.startswith("transformers.") and hasattr(model, "to_dict"):
        return _hf_model(model, f"transformers {type(model).__name__} ({model.model_type})")
    raise TypeError(f"tidal.estimate: expected a preset name, a config.json path, a transformers "
                    f"config or an nn.Module, got {type(model).__name__}")


def _module_tensors(model):
    """The model's parameters as tidal.initialize registers a built model:
    [(name, numel, trainable, module key)] and {module key: [tensor indexes]}
    (Engine._setup and ParamStore.add)."""
    from .engine import external as _external
    tensors, index, owned_by = [], {}, {}
    for _mname, m, owned in _external.owned_parameters(model):
        if owned is None:
            continue
        mine = []
        for full, p in owned:
            if id(p) not in index:
                if p.numel() == 0:
                    continue
                index[id(p)] = len(tensors)
                tensors.append((full, p.numel(), bool(p.requires_grad), id(m)))
            mine.append(index[id(p)])
        if mine:
            owned_by[id(m)] = mine
    return tensors, owned_by


def _layout(tensors, owned_by, cfg: Config) -> dict:
    """The engine's chunk layout for `tensors` (Note [The pre-flight estimate])."""
    K = _C.chunks.ChunkKind
    device = _C.create_device("sim", 1 << 20, None, None)  # places, never allocates
    chunks = _C.chunks.Chunks(
        device, chunk_bytes=cfg.chunk_size, param_dtype=_CHUNK_DTYPES[cfg.precision],
        device_budget=1 << 20, host_budget=1 << 20,
        state_dtype="bfloat16" if cfg.optimizer_state_dtype == "bf16" else "float32")
    last = {}
    ids = []
    for i, (name, numel, trainable, key) in enumerate(tensors):
        pool = 0 if trainable else 1
        ids.append(chunks.register(f"{i}:{name}", numel, pool=pool,
                                   with_previous=last.get(pool) == key))
        last[pool] = key
    chunks.take_warnings()
    n = chunks.num_chunks
    chunk_of = [chunks.placement(t)[0] for t in ids]
    trainable_chunk = [False] * n
    for (name, numel, trainable, key), c in zip(tensors, chunk_of):
        trainable_chunk[c] = trainable_chunk[c] or trainable
    cap = {k: [chunks.chunk_capacity_bytes(c, k) for c in range(n)]
           for k in (K.PARAM16, K.PARAM32, K.MOMENTUM, K.VARIANCE, K.GRAD32)}
    p16 = sum(cap[K.PARAM16])
    p16_trainable = sum(b for b, t in zip(cap[K.PARAM16], trainable_chunk) if t)
    optimizer = sum(cap[K.PARAM32][c] + cap[K.MOMENTUM][c] + cap[K.VARIANCE][c]
                    for c in range(n) if trainable_chunk[c])
    sums = sum(cap[K.GRAD32][c] for c in range(n) if trainable_chunk[c]) \
        if cfg.gradient_accumulation_steps > 1 else 0
    largest = 0
    for members in owned_by.values():
        largest = max(largest, sum(cap[K.PARAM16][c] for c in {chunk_of[i] for i in members}))
    elements = chunks.chunk_elements
    return {
        "chunks": n,
        "chunk_elements": elements,
        "dedicated_chunks": sum(1 for b in cap[K.PARAM16] if b > elements * _ELEMENT[cfg.precision]),
        "param16_bytes": p16,
        "param16_trainable_bytes": p16_trainable,
        "optimizer_state_bytes": optimizer,
        "gradient_sum_bytes": sums,
        "largest_module_param16_bytes": largest,
        "state_bytes": p16 + optimizer + sums,
        "padding_elements": sum(cap[K.PARAM16]) // _ELEMENT[cfg.precision] -
        sum(t[1] for t in tensors),
    }


# --------------------------------------------------------------------- activations
class _LiveBytes:
    """Bytes of live tensors other than the parameters, and their peak, under a
    TorchDispatchMode (tensors of one storage counted once)."""

    def __init__(self, exclude: set):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves
        outer = self
        self.exclude, self.sizes, self.refs = exclude, {}, {}
        self.now = self.peak = 0

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        outer._track(t)
                return out

        self.mode = Mode()

    def _track(self, t):
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self.exclude:
            return
        if key not in self.sizes:
            self.sizes[key], self.refs[key] = storage.nbytes(), 0
            self.now += self.sizes[key]
            self.peak = max(self.peak, self.now)
        self.refs[key] += 1
        weakref.finalize(t, self._drop, key)

    def _drop(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= self.sizes.pop(key)
            del self.refs[key]


def _fused_sdpa(original):
    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
             enable_gqa=False):
        if enable_gqa or query.shape[-1] != value.shape[-1]:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p,
                            is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out
    return sdpa


class _MetaAutocast(torch.autocast):
    """torch.autocast with device_type "meta" read as "cpu": models that switch
    autocast off around a block (Hugging Face's rotary embeddings) name the
    device of their tensors, and autocast knows no meta device."""

    def __init__(self, device_type, *args, **kwargs):
        super().__init__("cpu" if device_type == "meta" else device_type, *args, **kwargs)


def _trace(model, facts: dict, precision: str, micro_batch: int, seq: int, inputs=None) -> dict:
    """Activation peak and FLOPs of one forward + backward on the meta device."""
    from torch.utils.flop_counter import FlopCounterMode
    import torch.nn.functional as F
    if any(not p.is_meta for p in model.parameters()):
        return {"error": "the model is not on the meta device (build it under "
                         "`with torch.device('meta'):` to have its activations estimated)"}
    if inputs is None and facts["kind"] == "module":
        return {"error": "no inputs for this model: pass inputs=(args...) or a callable "
                         "(micro_batch, seq) -> args"}
    model = copy.deepcopy(model)  # meta: no data; the caller's model keeps its dtype
    if precision != "fp32":
        model.to(_TORCH[precision])
    for p in model.parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    exclude = {p.untyped_storage()._cdata for p in model.parameters()}
    exclude |= {b.untyped_storage()._cdata for b in model.buffers()}
    vocab = facts.get("vocab") or 2
    x = torch.randint(0, vocab, (micro_batch, seq), device="meta")
    live = _LiveBytes(exclude)
    original, autocast = F.scaled_dot_product_attention, torch.autocast
    F.scaled_dot_product_attention = _fused_sdpa(original)
    torch.autocast = _MetaAutocast
    try:
        with FlopCounterMode(display=False) as flops, live.mode:
            if facts["kind"] == "tinygpt":
                loss = model(x, x)
            elif facts["kind"] == "causal_lm":
                loss = model(input_ids=x, labels=x).loss
            else:
                args = inputs(micro_batch, seq) if callable(inputs) else inputs
                args = args if isinstance(args, tuple) else (args,)
                out = model(*args)
                loss = getattr(out, "loss", None)
                if loss is None:
                    loss = out if out.dim() == 0 else out.float().sum()
            forward_peak = live.peak
            loss.backward()
    except Exception as e:  # a model whose forward needs real data (an .item(), ...)
        return {"error": f"the forward or backward on the meta device failed: "
                         f"{type(e).__name__}: {str(e)[:200]}"}
    finally:
        F.scaled_dot_product_attention, torch.autocast = original, autocast
    return {"activation_bytes": live.peak, "forward_peak_bytes": forward_peak,
            "flops": flops.get_total_flops()}
