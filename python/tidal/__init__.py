"""tidal: train models far larger than one GPU's memory.

Model states live in fixed-size chunks that move between host and device,
Adam runs on the CPU at memory-bandwidth speed, and activations are dropped
and recomputed inside the device memory the chunks leave free.
"""

import torch  # noqa: F401  -- loads libtorch before tidal._C links against it

from tidal._version import __version__
from tidal import _C
from tidal import _testing
from tidal._C import InternalError, OutOfMemoryError
from tidal import dtr, optim, recompute
from tidal.config import Config, ConfigError
from tidal.estimate import estimate
from tidal.engine import (Engine, UnsupportedModelError, UsageError, init_context, initialize,
                          register_external_parameter, set_leaf_modules)
from tidal.device import (
    Device,
    DeviceBuffer,
    Event,
    HostBuffer,
    Stream,
    device_info,
    get_device,
    parse_bytes,
    set_device,
    stats,
)

_testing.install_from_environment()  # TIDAL_TEST_FP32_GEMM: a testing switch (tidal/_testing.py)

__all__ = [
    "__version__",
    "dtr",
    "Config",
    "ConfigError",
    "Engine",
    "estimate",
    "init_context",
    "initialize",
    "optim",
    "recompute",
    "register_external_parameter",
    "set_leaf_modules",
    "Device",
    "DeviceBuffer",
    "Event",
    "HostBuffer",
    "InternalError",
    "OutOfMemoryError",
    "Stream",
    "UnsupportedModelError",
    "UsageError",
    "device_info",
    "get_device",
    "parse_bytes",
    "set_device",
    "stats",
]
