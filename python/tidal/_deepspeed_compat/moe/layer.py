"""deepspeed.moe.layer: MoE, refused when built."""
import torch

from ..refused import refused_class

__all__ = ["MoE"]

MoE = refused_class(
    "tidal.deepspeed.moe.layer", "MoE",
    "tidal has no mixture-of-experts layers: no expert parallelism, gating or all-to-all; "
    "build the model without MoE layers (the CIFAR-10 tutorial: leave --moe off)",
    base=torch.nn.Module)
