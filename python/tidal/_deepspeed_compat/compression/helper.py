"""deepspeed.compression.helper: recursive_getattr and recursive_setattr,
which DeepSpeed-Chat's LoRA module (dschat/utils/module/lora.py) uses to find
a model's linear layers by their dotted names and put LoRA layers in their
place. Plain module attribute walks, as DeepSpeed's."""
from __future__ import annotations

import torch

__all__ = ["recursive_getattr", "recursive_setattr"]


def recursive_getattr(model: torch.nn.Module, module_name: str):
    """The attribute of `model` at the dotted path `module_name`
    ("decoder.layers.0.fc1"): getattr one name at a time.

    Args:
        model: the module to start from.
        module_name: names separated by dots.
    """
    out = model
    for name in module_name.split("."):
        out = getattr(out, name)
    return out


def recursive_setattr(model: torch.nn.Module, module_name: str, module) -> None:
    """Sets the attribute at the dotted path `module_name` of `model` to
    `module` (its parent found with getattr, then the parent's __setattr__,
    so an nn.Module child is registered as one).

    Args:
        model: the module to start from.
        module_name: names separated by dots; the last one is set.
        module: the value (usually an nn.Module) to set.
    """
    *parents, last = module_name.split(".")
    out = model
    for name in parents:
        out = getattr(out, name)
    out.__setattr__(last, module)
