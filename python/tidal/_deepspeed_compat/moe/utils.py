"""deepspeed.moe.utils: the parameter-group helpers, for models without MoE layers.

DeepSpeed marks an expert's parameters with `allreduce = False` (and a
`group_name`); split_params_into_different_moe_groups_for_optimizer moves
them into groups of their own. tidal builds no MoE layer, so a model here has
no expert parameters and the groups come back as they are, as DeepSpeed
returns them then; an expert parameter (marked by other code) is refused."""
from __future__ import annotations

import torch

from ...engine.errors import UsageError

__all__ = ["has_moe_layers", "is_moe_param",
           "split_params_into_different_moe_groups_for_optimizer"]


def is_moe_param(param: torch.Tensor) -> bool:
    """DeepSpeed's test: an expert's parameter has allreduce set to False."""
    return hasattr(param, "allreduce") and not param.allreduce


def has_moe_layers(m: torch.nn.Module) -> tuple:
    """(False, 0): tidal builds no MoE layer (moe.layer.MoE is refused)."""
    del m
    return False, 0


def split_params_into_different_moe_groups_for_optimizer(param_groups, max_group_size=178956971):
    """DeepSpeed's split, for parameters that belong to no expert: the groups
    as a list (a dict becomes [dict], a tuple a list), each as it was."""
    del max_group_size  # (it sizes the expert groups, of which there are none)
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise UsageError(f"tidal.deepspeed.moe.utils.split_params_into_different_moe_groups_for_"
                         f"optimizer: expected a parameter-group dict, or a list or tuple of them, "
                         f"got {type(param_groups).__name__}")
    for gi, group in enumerate(param_groups):
        # (DeepSpeed's rebuilds each group's "params" as a list: an iterator is read once)
        params = group["params"]
        group["params"] = [params] if isinstance(params, torch.Tensor) else list(params)
        for p in group["params"]:
            if is_moe_param(p):
                raise UsageError(
                    f"tidal.deepspeed.moe.utils.split_params_into_different_moe_groups_for_"
                    f"optimizer: group {gi} holds an expert parameter (allreduce=False, group "
                    f"{getattr(p, 'group_name', '?')!r}); tidal has no mixture-of-experts "
                    f"training")
    return param_groups
