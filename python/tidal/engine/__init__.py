"""The training engine: chunks, hooks, hybrid Adam, mixed precision."""
from .engine import Engine, initialize
from .errors import UnsupportedModelError, UsageError
from .external import register_external_parameter, set_leaf_modules
from .init_context import init_context
from .loss_scaler import DynamicLossScaler, StaticLossScaler

__all__ = ["Engine", "UnsupportedModelError", "UsageError", "initialize", "init_context",
           "register_external_parameter", "set_leaf_modules", "DynamicLossScaler",
           "StaticLossScaler"]
