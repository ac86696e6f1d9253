"""deepspeed.zero (deepspeed.runtime.zero): zero.Init, GatheredParameters,
register_external_parameter, ZeroParamStatus and ZeroParamType, over
tidal's chunks (partition_parameters.py)."""
from .partition_parameters import (GatheredParameters, Init, ZeroParamStatus, ZeroParamType,
                                   register_external_parameter)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType",
           "register_external_parameter"]
