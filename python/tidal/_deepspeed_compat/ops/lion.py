"""deepspeed.ops.lion: DeepSpeedCPULion and FusedLion, refused (tidal's engine runs Adam)."""
from ..refused import refused_class

__all__ = ["DeepSpeedCPULion", "FusedLion"]

_WHY = ("Lion's sign update is another rule, and tidal's engine runs Adam/AdamW only "
        "(tidal.deepspeed.ops.adam.FusedAdam or DeepSpeedCPUAdam, or the config's optimizer type "
        "'Adam'/'AdamW')")
DeepSpeedCPULion = refused_class("tidal.deepspeed.ops.lion", "DeepSpeedCPULion", _WHY)
FusedLion = refused_class("tidal.deepspeed.ops.lion", "FusedLion", _WHY)
