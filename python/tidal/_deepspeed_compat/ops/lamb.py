"""deepspeed.ops.lamb: FusedLamb, refused (tidal's engine runs Adam)."""
from ..refused import refused_class

__all__ = ["FusedLamb"]

FusedLamb = refused_class(
    "tidal.deepspeed.ops.lamb", "FusedLamb",
    "LAMB scales each layer's update by its trust ratio, and tidal's engine runs Adam/AdamW "
    "only (tidal.deepspeed.ops.adam.FusedAdam or DeepSpeedCPUAdam, or the config's optimizer "
    "type 'Adam'/'AdamW')")
