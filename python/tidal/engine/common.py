"""Names engine.py and its objects share."""
from __future__ import annotations

import weakref


from .. import _C

OutOfMemoryError = _C.OutOfMemoryError


_PLACEHOLDER_HINT = (
    " [tidal: if this op read a parameter outside the forward of the module that owns it (e.g. "
    "`other_module.weight` in another module's forward), that parameter is an empty placeholder "
    "there: tidal brings a module's parameters to the device only while that module runs. Use it "
    "through its module, or move the code into the owning module's forward]")



_FWD = _C.chunks.PointKind.FORWARD
_BWD = _C.chunks.PointKind.BACKWARD
_HOLD = _C.chunks.TensorState.HOLD


def _weak_method(bound):
    """`bound` (a method of the engine, or of a part the engine owns, such as
    its ChunkDataParallel) called through a weak reference: its answer, or
    None once the object is gone.

    Note [Gradient hooks hold the engine weakly]: a tensor's post-accumulate-
    grad hooks live in its C++ autograd meta, which Python's garbage
    collector cannot see through. A hook holding the engine strongly made the
    cycle parameter -> hook -> engine -> model -> parameter uncollectable, so a
    dropped engine kept its chunks (and their pinned host memory) until the
    process exited. Module hooks live in Python dicts and need no such care.
    """
    ref = weakref.WeakMethod(bound)

    def call(*args):
        method = ref()
        return None if method is None else method(*args)

    return call

# tidal keys each rank of a data-parallel run may set for its own machine.
_PER_MACHINE_KEYS = frozenset({"device_memory_budget", "host_memory_budget", "device_margin",
                               "cpu_adam_threads", "cpu_adam_pool", "prefetch", "prefetch_depth", "evict_ahead",
                               "skip_clean_copies", "fold_images",
                               "eviction_policy", "hybrid_adam", "warmup_chunk_share", "device"})
