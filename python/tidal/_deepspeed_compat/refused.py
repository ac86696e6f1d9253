"""Classes DeepSpeed has and tidal cannot run: importable, so a script that
imports them but does not use them runs; refused by name when built."""
from __future__ import annotations

from ..engine.errors import UsageError

__all__ = ["refused_class"]


def refused_class(module: str, name: str, why: str, base: type = object) -> type:
    """A class `name` of `module` whose constructor raises UsageError saying
    `why` (what tidal cannot do, and what to do instead)."""
    def __init__(self, *args, **kwargs):
        raise UsageError(f"{module}.{name}: {why}")

    doc = f"DeepSpeed's {name}, refused by tidal when built: {why}"
    return type(name, (base,), {"__init__": __init__, "__doc__": doc, "__module__": module})
