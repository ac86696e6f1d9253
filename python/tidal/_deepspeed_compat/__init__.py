"""DeepSpeed's importable names besides initialize, for tidal.deepspeed.

A DeepSpeed script imports more than `deepspeed` itself:

    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

Each module here is one of those, under DeepSpeed's (0.19.8) module path with
`tidal.deepspeed` in place of `deepspeed` (ALIASES). tidal.deepspeed is a
module, not a package, so on its import it enters each one into sys.modules
under that name (alias), which is all `import tidal.deepspeed.comm` needs:
Python looks a dotted name up in sys.modules once the parent is imported.
What a name does over tidal, or why it is refused, is in each module.
A DeepSpeed module path not here is refused when imported, naming its
feature (refused.py, RefusedModuleFinder); for Python to ask that finder,
tidal.deepspeed has an empty __path__ (a package whose submodules are all
entered here or refused).
"""
from __future__ import annotations

import importlib
import sys

__all__ = ["ALIASES", "alias"]

# DeepSpeed's module path (below `deepspeed.`) -> the module here.
ALIASES = {
    "accelerator": "accelerator",
    "comm": "comm",
    "compression": "compression",
    "compression.helper": "compression.helper",
    "ops": "ops",
    "ops.adam": "ops.adam",
    "ops.lamb": "ops.lamb",
    "ops.lion": "ops.lion",
    "ops.adagrad": "ops.adagrad",
    "moe": "moe",
    "moe.layer": "moe.layer",
    "moe.utils": "moe.utils",
    "runtime": "runtime",
    "runtime.zero": "runtime.zero",
    "runtime.zero.partition_parameters": "runtime.zero.partition_parameters",
    "runtime.zero.offload_config": "runtime.zero.offload_config",
    "zero": "runtime.zero",  # deepspeed.zero is deepspeed.runtime.zero
    "utils": "utils",
    "utils.logging": "utils",  # (its logger)
}


def alias(parent: str) -> dict:
    """Imports every module of ALIASES and enters it into sys.modules as
    `<parent>.<DeepSpeed's path>`, and refuses the other paths below `parent`
    by name (refused.RefusedModuleFinder); returns {DeepSpeed's top-level
    name: module} for the parent's attributes."""
    from .refused import RefusedModuleFinder
    RefusedModuleFinder.install(parent, ALIASES)
    top = {}
    for path, here in ALIASES.items():
        module = importlib.import_module(f"{__name__}.{here}")
        sys.modules.setdefault(f"{parent}.{path}", module)
        if "." not in path:
            top[path] = module
    return top
