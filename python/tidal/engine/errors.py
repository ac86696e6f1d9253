"""The engine's own error types (tidal.OutOfMemoryError comes from tidal._C)."""

__all__ = ["UnsupportedModelError", "UsageError"]


class UnsupportedModelError(RuntimeError):
    """The model does something the engine's hooks cannot follow (e.g. it uses
    a parameter outside the forward of the module that owns it in a way tidal
    cannot see)."""


class UsageError(RuntimeError):
    """The engine or its model was used in a way that would train wrong
    weights without a word (a torch optimizer or clip_grad_norm_ over the
    engine's parameters, two backward calls before one step, a second engine
    on one model); the message says what to do instead."""
