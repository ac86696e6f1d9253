"""The training engine: chunks, hooks, hybrid Adam, mixed precision."""
from .engine import Engine, UnsupportedModelError, initialize
from .init_context import init_context
from .loss_scaler import DynamicLossScaler, StaticLossScaler

__all__ = ["Engine", "UnsupportedModelError", "initialize", "init_context", "DynamicLossScaler", "StaticLossScaler"]
