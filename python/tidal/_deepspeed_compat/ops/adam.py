"""deepspeed.ops.adam: DeepSpeedCPUAdam and FusedAdam with DeepSpeed's signatures.

DeepSpeed-Chat and the offload fine-tunes build one themselves, over their
own parameter groups, and hand it to deepspeed.initialize(optimizer=...).
Handed to tidal.deepspeed.initialize, neither steps: the engine runs the
update rule it describes over its chunks (groups, lr, betas, eps, weight
decay, adamw mode, bias correction; see
tidal/_deepspeed_compat/client_optimizer.py). Built and stepped alone they
are optimizers as DeepSpeed's are:

* DeepSpeedCPUAdam is tidal.optim.CPUAdam (tidal's SIMD CPU Adam) with
  DeepSpeed's arguments: for fp32 parameters in host memory, as DeepSpeed's
  (whose engine gives it fp32 masters). It takes 16-bit parameters when built,
  as DeepSpeed's does; a step over them is refused by name.
  fp32_optimizer_states is accepted either way: over fp32 parameters (the only
  ones it steps, and the only ones DeepSpeed's engine gives it) the states are
  fp32 whatever it says.
* FusedAdam is torch.optim.Adam (decoupled weight decay when adam_w_mode, as
  DeepSpeed's adam_w_mode), for parameters on any device. torch's Adam always
  corrects its bias: a standalone step with bias_correction=False is refused
  (the engine runs that rule).

amsgrad=True is refused by both when built (DeepSpeed's FusedAdam refuses it
too; its CPU Adam ignores it).
"""
from __future__ import annotations

import torch

from ...engine.errors import UsageError
from ...optim import CPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class DeepSpeedCPUAdam(CPUAdam):
    """deepspeed.ops.adam.DeepSpeedCPUAdam (ops/adam/cpu_adam.py): Adam, or
    AdamW with adamw_mode (the default), over host fp32 parameters.

    Args:
        model_params: parameters or parameter-group dicts.
        lr, betas, eps, weight_decay: Adam's hyperparameters (defaults DeepSpeed's).
        bias_correction: Adam's bias correction.
        amsgrad: must be False.
        adamw_mode: decoupled (AdamW) weight decay; False: L2 (Adam).
        fp32_optimizer_states: accepted (see the module's docstring).
    """

    # DeepSpeed's is built on the model's parameters whatever their dtype.
    _checks_params_when_built = False
    optimizer_id = 0

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0, amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        if amsgrad:
            raise UsageError("tidal.deepspeed.ops.adam.DeepSpeedCPUAdam(amsgrad=True): tidal's "
                             "Adam has no AMSGrad variant (DeepSpeed's CPU Adam ignores the flag; "
                             "tidal refuses it rather than ignore it); pass amsgrad=False")
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         adamw_mode=adamw_mode, bias_correction=bias_correction)
        self.opt_id = DeepSpeedCPUAdam.optimizer_id
        DeepSpeedCPUAdam.optimizer_id += 1
        self.adam_w_mode = bool(adamw_mode)
        self.fp32_optimizer_states = bool(fp32_optimizer_states)


class FusedAdam(torch.optim.Adam):
    """deepspeed.ops.adam.FusedAdam (ops/adam/fused_adam.py): Adam, or AdamW
    with adam_w_mode (the default), as torch.optim.Adam computes it.

    Args:
        params: parameters or parameter-group dicts.
        lr, betas, eps, weight_decay: Adam's hyperparameters (defaults DeepSpeed's).
        bias_correction: Adam's bias correction (False only under the engine).
        adam_w_mode: decoupled (AdamW) weight decay; False: L2 (Adam).
        amsgrad: must be False (DeepSpeed's refuses it too).
        set_grad_none: zero_grad() sets the gradients to None.
    """

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 adam_w_mode=True, weight_decay=0., amsgrad=False, set_grad_none=True):
        if amsgrad:
            raise UsageError("tidal.deepspeed.ops.adam.FusedAdam(amsgrad=True): FusedAdam does not "
                             "support the AMSGrad variant (DeepSpeed's refuses it too); pass "
                             "amsgrad=False")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=bool(adam_w_mode))
        self.defaults["bias_correction"] = bool(bias_correction)
        for group in self.param_groups:
            group.setdefault("bias_correction", bool(bias_correction))
        self.adam_w_mode = 1 if adam_w_mode else 0
        self.set_grad_none = set_grad_none

    def zero_grad(self, set_to_none: "bool | None" = None) -> None:
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        for gi, group in enumerate(self.param_groups):
            if not group.get("bias_correction", True):
                raise UsageError(
                    f"tidal.deepspeed.ops.adam.FusedAdam.step(): param_groups[{gi}] has "
                    f"bias_correction=False, which torch's Adam (this FusedAdam's step) does not "
                    f"implement; hand the optimizer to tidal.deepspeed.initialize (its engine "
                    f"runs that rule), or use tidal.optim.CPUAdam(bias_correction=False) for host "
                    f"fp32 parameters")
        return super().step(closure)
