"""tidal.init_context(config): build a model straight into chunks.

Inside the context every nn.Module's __init__ is wrapped: when the outermost
__init__ of a module returns, its own parameters are registered in the
context's ParamStore, their values copied into host chunk slots and their
data replaced by a placeholder. So at most one module's parameters exist as
ordinary tensors at a time, and a model larger than device memory can be
constructed. tidal.initialize(model) adopts the store.

Hugging Face models (transformers imported before the context starts) keep
what their post_init() writes: see Note [Hugging Face's post_init in chunks].
Other code that re-initialises parameters in place after their module's
__init__ returned writes to the placeholders; wrap it in
`store.materialized(module)` (the yielded store) to write into the chunks.
"""
from __future__ import annotations

import contextlib
import functools
import sys

import torch

from ..config import Config
from .store import ParamStore


def _hugging_face_initializer():
    """(PreTrainedModel, its _initialize_weights) when Hugging Face's
    transformers is imported, else (None, None).

    Note [Hugging Face's post_init in chunks]: a transformers model builds
    its modules (each initialised by its own __init__, then registered here),
    then post_init() re-initialises every module with the model's
    _init_weights and ties weights. The per-module step,
    PreTrainedModel._initialize_weights(module), runs here with that
    module's parameters materialised from their chunk slots
    (ParamStore.materialized), so the values written land in the chunks,
    with the same random draws in the same order as building the model
    outside the context: the weights are the same for a fixed seed. Tied
    weights (post_init's tie_weights) leave the replaced parameter's record
    unreferenced, and tidal.initialize drops it (Note [Records the model
    dropped] in store.py).
    """
    module = sys.modules.get("transformers.modeling_utils")
    model = getattr(module, "PreTrainedModel", None)
    original = getattr(model, "_initialize_weights", None) if model is not None else None
    if original is None:
        return None, None
    return model, original


def _subclasses(cls):
    out, todo = [], [cls]
    while todo:
        c = todo.pop()
        out.append(c)
        todo.extend(c.__subclasses__())
    return out


@contextlib.contextmanager
def init_context(config=None):
    """Models built inside keep their parameters in chunks (host memory).

    Yields the ParamStore; pass the model to tidal.initialize() afterwards.
    """
    store = ParamStore(Config.load(config))
    ParamStore._unadopted.append(store)
    depth: dict[int, int] = {}
    originals = {}

    def wrap(cls):
        if "__init__" not in cls.__dict__ or cls in originals:
            return
        original = cls.__dict__["__init__"]

        @functools.wraps(original)
        def __init__(self, *args, **kwargs):
            key = id(self)
            depth[key] = depth.get(key, 0) + 1
            try:
                original(self, *args, **kwargs)
            finally:
                depth[key] -= 1
                if depth[key] == 0:
                    del depth[key]
            if key not in depth:
                for name, p in self.named_parameters(recurse=False):
                    # A meta parameter has no values to keep; it is normally
                    # replaced (a tied weight). If it is still there at
                    # tidal.initialize, that is a clear error.
                    if id(p) not in store.by_param and p.numel() > 0 and not p.is_meta:
                        store.add(p, f"{type(self).__name__}.{name}", provisional=True,
                                  module=self)

        originals[cls] = original
        cls.__init__ = __init__

    original_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")

    @classmethod
    def __init_subclass__(cls, **kwargs):
        super(torch.nn.Module, cls).__init_subclass__(**kwargs)
        wrap(cls)

    for cls in _subclasses(torch.nn.Module):
        wrap(cls)
    torch.nn.Module.__init_subclass__ = __init_subclass__
    hf_model, hf_original = _hugging_face_initializer()
    if hf_model is not None:
        @functools.wraps(hf_original)
        def _initialize_weights(self, module):
            with store.materialized(module):
                return hf_original(self, module)

        hf_model._initialize_weights = _initialize_weights
    try:
        yield store
    finally:
        if hf_model is not None:
            hf_model._initialize_weights = hf_original
        store.sync_param16()
        for cls, original in originals.items():
            cls.__init__ = original
        if original_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = original_init_subclass
