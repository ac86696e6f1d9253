"""What DeepSpeed has and tidal cannot run, refused by name.

Classes and functions are importable, so a script that imports them but does
not use them runs; they are refused when built or called (refused_class,
refused_function). Modules are refused when imported (RefusedModuleFinder):
`import tidal.deepspeed.pipe` raises a RefusedModuleError naming the feature
and what to do instead, which is a tidal UsageError and also a
ModuleNotFoundError, so a script's `try: import ... except ImportError`
fallback still takes its other branch."""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys

from ..engine.errors import UsageError

__all__ = ["REFUSED_MODULES", "RefusedModuleError", "RefusedModuleFinder", "missing_attribute",
           "refused_class", "refused_function"]


def refused_class(module: str, name: str, why: str, base: type = object) -> type:
    """A class `name` of `module` whose constructor raises UsageError saying
    `why` (what tidal cannot do, and what to do instead)."""
    def __init__(self, *args, **kwargs):
        raise UsageError(f"{module}.{name}: {why}")

    doc = f"DeepSpeed's {name}, refused by tidal when built: {why}"
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": module})


def refused_function(module: str, name: str, why: str):
    """A function `name` of `module` that raises UsageError saying `why` when called."""
    def refused(*args, **kwargs):
        raise UsageError(f"{module}.{name}: {why}")

    refused.__name__ = refused.__qualname__ = name
    refused.__module__ = module
    refused.__doc__ = f"DeepSpeed's {name}, refused by tidal when called: {why}"
    return refused


class RefusedModuleError(UsageError, ModuleNotFoundError):
    """A DeepSpeed module tidal does not provide was imported: the message
    names the feature and what to do instead."""


_PIPELINE = (
    "tidal has no pipeline parallelism (PipelineModule, LayerSpec, PipelineEngine, "
    "train_batch() over stages): tidal trains the whole model on one GPU, moving its chunks "
    "through device memory, so a model too large for one GPU needs no stages. Build the layers "
    "as one nn.Module (a PipelineModule's layers as torch.nn.Sequential(*layers), with the "
    "loss_fn applied to its output), pass it to tidal.deepspeed.initialize, and loop over "
    "engine(batch) / engine.backward(loss) / engine.step(); for more GPUs, data parallel "
    "(torchrun, the config's tidal.data_parallel block)")
_TENSOR_PARALLEL = ("tidal has no tensor or sequence parallelism: one GPU trains the whole "
                    "model (its chunks move through device memory), data parallel across GPUs")

_CHECKPOINTING = (
    "DeepSpeed's activation checkpointing API (deepspeed.checkpointing.configure, checkpoint, "
    "the Megatron RNG tracker) is not in tidal: name the checkpoints in the config's "
    "activation_checkpointing block (docs/recompute.md), or use torch.utils.checkpoint or the "
    "model's own gradient_checkpointing_enable()")

# DeepSpeed's module path (below `deepspeed.`) -> why tidal refuses it. A
# module path under one of these is refused with its message too.
REFUSED_MODULES = {
    "pipe": _PIPELINE,
    "runtime.pipe": _PIPELINE,
    "ops.sparse_attention": (
        "DeepSpeed's block-sparse attention kernels (SparseSelfAttention, the SparsityConfig "
        "classes, SparseAttentionUtils) are not in tidal: use the model's dense attention "
        "(torch.nn.functional.scaled_dot_product_attention)"),
    "ops.transformer": (
        "DeepSpeed's fused transformer layer kernels (DeepSpeedTransformerLayer) are not in "
        "tidal: build the model from torch's or Hugging Face's layers"),
    "runtime.data_pipeline": (
        "DeepSpeed's data efficiency library (curriculum learning, data sampling and analysis, "
        "random-LTD) is not in tidal: build the DataLoader yourself; tidal.deepspeed.initialize "
        "(training_data=...) batches a dataset as DeepSpeed's plain loader does"),
    "runtime.domino": "Domino is tensor parallelism; " + _TENSOR_PARALLEL,
    "sequence": "DeepSpeed-Ulysses is sequence parallelism; " + _TENSOR_PARALLEL,
    "module_inject": (
        "kernel injection and automatic tensor parallelism (replace_transformer_layer, AutoTP) "
        "are DeepSpeed's inference and tensor-parallel paths; tidal trains the model as it is"),
    "inference": ("DeepSpeed's inference engine is not in tidal: run the trained model "
                  "(engine.module, or engine(batch) under torch.no_grad()) as it is"),
    "compression.compress": (
        "DeepSpeed's compression training (init_compression, redundancy_clean: quantization, "
        "pruning, layer reduction) is not in tidal; tidal.deepspeed.compression.helper "
        "(recursive_getattr, recursive_setattr) is"),
    "profiling": ("DeepSpeed's flops profiler is not in tidal: engine.memory_report(), "
                  "engine.memory_profile() and tidal.profile measure tidal's runs"),
    "monitor": ("DeepSpeed's monitors (TensorBoard, W&B, CSV from the config) are not in "
                "tidal: log from the script (torch.utils.tensorboard, wandb)"),
    "autotuning": "DeepSpeed's autotuner is not in tidal: tidal sizes its chunks itself "
                  "(tidal.estimate, the config's tidal block)",
    "checkpointing": _CHECKPOINTING,
    "runtime.activation_checkpointing": _CHECKPOINTING,
}


def _why(path: str) -> "str | None":
    parts = path.split(".")
    for n in range(len(parts), 0, -1):
        why = REFUSED_MODULES.get(".".join(parts[:n]))
        if why is not None:
            return why
    return None


def missing_attribute(parent: str, name: str) -> AttributeError:
    """The AttributeError for `parent.name` that tidal does not have (a
    module's __getattr__ raises it): for one of REFUSED_MODULES's top-level
    names (deepspeed.pipe, deepspeed.checkpointing, ...) it says why, so
    `deepspeed.checkpointing.configure(...)` fails naming the feature;
    hasattr() stays False."""
    why = REFUSED_MODULES.get(name)
    text = f"module {parent!r} has no attribute {name!r}"
    if why is not None:
        text += f" (DeepSpeed's deepspeed.{name}): {why}"
    return AttributeError(text)


class _RefusingLoader(importlib.abc.Loader):
    def __init__(self, message: str):
        self.message = message

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        error = RefusedModuleError(self.message)
        error.name = module.__name__  # (ImportError's field; RuntimeError's __init__ takes no keywords)
        raise error


class RefusedModuleFinder(importlib.abc.MetaPathFinder):
    """On sys.meta_path (after Python's own finders): a module below
    `parent` (tidal.deepspeed) that no finder before it found is refused,
    with its feature's message from REFUSED_MODULES, or, for a path tidal
    knows nothing of, a message listing the DeepSpeed modules tidal has.

    Args:
        parent: the package name the DeepSpeed paths hang from.
        provided: DeepSpeed's module paths tidal provides (for the message).
    """

    def __init__(self, parent: str, provided):
        self.parent = parent
        self.provided = sorted(provided)

    def find_spec(self, fullname, path, target=None):
        if not fullname.startswith(self.parent + "."):
            return None
        ds_path = fullname[len(self.parent) + 1:]
        why = _why(ds_path)
        if why is None:
            why = (f"tidal does not provide DeepSpeed's deepspeed.{ds_path}. tidal.deepspeed "
                   f"stands in for DeepSpeed's training front door: initialize and the modules "
                   f"{', '.join(self.provided)} (docs/deepspeed.md)")
        message = f"{fullname} (DeepSpeed's deepspeed.{ds_path}): {why}"
        return importlib.machinery.ModuleSpec(fullname, _RefusingLoader(message))

    @classmethod
    def install(cls, parent: str, provided) -> "RefusedModuleFinder":
        """Appends one finder for `parent` to sys.meta_path (once per parent)."""
        for finder in sys.meta_path:
            if isinstance(finder, cls) and finder.parent == parent:
                return finder
        finder = cls(parent, provided)
        sys.meta_path.append(finder)
        return finder
