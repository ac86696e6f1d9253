"""tidal.recompute: static recompute segments and recompute-offload.

The sublinear-memory plan for static graphs (Chen et al., "Training Deep Nets
with Sublinear Memory Cost"; Paddle's recompute and recompute-offload). A
segment is one module, or a run of consecutive blocks of a chain: in forward
only its input (the *checkpoint*) is kept; in backward the segment is run
again from the checkpoint to regenerate what autograd saved::

    plan = tidal.recompute(model, checkpoints="auto")          # ~sqrt(N) segments of the chain
    plan = tidal.recompute(model, ["blocks.0", "blocks.1"])    # one segment per named module
    plan = tidal.recompute(model, "auto", offload=True)        # checkpoints go to host memory
    ...
    plan.remove()                                             # the original forwards again

or from a config file's ``activation_checkpointing`` block (DeepSpeed's names)::

    plan = tidal.recompute.from_config(model, {"number_checkpoints": 4, "cpu_checkpointing": True})

Mechanism (see docs/recompute.md): every block of a segment gets a forward
wrapper; inside it a ``saved_tensors_hooks`` pack hook replaces each tensor
autograd saves by a (run, index) handle, so nothing but the checkpoint stays
alive. The first unpack in backward reruns the segment from the checkpoint,
with the forward's CPU/CUDA RNG states and autocast state, and with batch
norm's running statistics swapped for scratch copies so they are updated
exactly once; the recomputed tensors are handed out in the order they were
saved (their shapes and dtypes are checked against the forward's).

Offload: a segment's checkpoint is copied to host memory on a copy stream as
soon as the segment starts and its device copy is released once the copy is
done; in backward, when a segment's recompute starts, the checkpoints of the
next ``prefetch_depth`` segments (in backward order) are copied back, so the
copies overlap compute. On CUDA this is a ``torch.cuda.Stream``, pinned host
memory and CUDA events (torch's caching allocator must see the side stream,
``record_stream``). Elsewhere the copies go through tidal's device layer: a
stream of the simulated device and its copy engines, the same link the
training engine's chunk copies take (each copy takes latency + bytes /
bandwidth on its direction's engine, behind the copies booked there), or a
link of its own when ``offload_bandwidth`` / ``offload_latency_us`` are
given; host copies are ``tidal.HostBuffer``\\ s, so ``tidal.stats()["host"]``
counts them.

The package's modules follow the plan's parts: ``segments`` (which modules
make a segment), ``copies`` (the offload copies through the device layer),
``run`` (one forward of a segment and its recompute), ``plan`` (the
installed plan and its offload), ``entry`` (:func:`recompute`) and
``config_block`` (the config file's blocks).
"""

from __future__ import annotations

import sys
import types

from .config_block import CONFIG_KEYS, from_config, validate_config
from .copies import CopyEvent
from .entry import ByteSize, Checkpoints, recompute  # noqa: F401 -- the signature's aliases, as before
from .plan import Recompute
from .segments import Segment, find_chain, plan_for_target

__all__ = [
    "CONFIG_KEYS",
    "CopyEvent",
    "Recompute",
    "Segment",
    "find_chain",
    "from_config",
    "plan_for_target",
    "recompute",
    "validate_config",
]


class _RecomputeModule(types.ModuleType):
    """Makes the module callable: ``tidal.recompute(model, ...)`` is
    :func:`recompute`, and ``tidal.recompute.from_config`` stays reachable."""

    def __call__(self, *args, **kwargs) -> Recompute:
        return recompute(*args, **kwargs)


sys.modules[__name__].__class__ = _RecomputeModule
