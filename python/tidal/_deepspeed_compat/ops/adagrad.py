"""deepspeed.ops.adagrad: DeepSpeedCPUAdagrad, refused (tidal's engine runs Adam)."""
from ..refused import refused_class

__all__ = ["DeepSpeedCPUAdagrad"]

DeepSpeedCPUAdagrad = refused_class(
    "tidal.deepspeed.ops.adagrad", "DeepSpeedCPUAdagrad",
    "Adagrad's accumulated squares are another rule, and tidal's engine runs Adam/AdamW only "
    "(tidal.deepspeed.ops.adam.FusedAdam or DeepSpeedCPUAdam, or the config's optimizer type "
    "'Adam'/'AdamW')")
