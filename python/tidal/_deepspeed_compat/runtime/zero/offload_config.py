"""deepspeed.runtime.zero.offload_config: the enums of engine.offload_states()
(Note [Offloading the engine's states] in tidal/engine/store.py), with
DeepSpeed's names and values. Both are str enums, as DeepSpeed's: a member
equals its value ("cpu", "optim_states")."""
from __future__ import annotations

from enum import Enum

__all__ = ["OffloadDeviceEnum", "OffloadStateTypeEnum"]


class OffloadDeviceEnum(str, Enum):
    """Where states go: DeepSpeed's offload devices. offload_states takes cpu
    (none: nothing moves; nvme is refused, as DeepSpeed refuses it there)."""
    none = "none"
    cpu = "cpu"
    nvme = "nvme"


class OffloadStateTypeEnum(str, Enum):
    """Which states offload_states(include=...) moves. In tidal's chunks:
    optim_states the Adam moments, hp_params the fp32 masters, lp_params the
    16-bit parameters, lp_grads the 16-bit slots too (they take the gradients
    after backward) and the fp32 gradient sums of accumulation,
    contiguous_grad_buffer the gradient sums."""
    optim_states = "optim_states"
    hp_params = "hp_params"
    lp_params = "lp_params"
    lp_grads = "lp_grads"
    contiguous_grad_buffer = "contiguous_grad_buffer"
