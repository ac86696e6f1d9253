"""Where each chunk's Adam runs under hybrid Adam: the plan a step and a
gradient fold follow (Note [Where a chunk's Adam runs]).

Note [Where a chunk's Adam runs]
~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
A chunk's update runs on the device or on the host (cpu_adam), and what it
costs is the bytes that cross the link. In 16-bit training a chunk updated
on the host sends its gradients down (its 16-bit chunk) and its new weights
up: 2 bytes per parameter each way in bf16/fp16. One updated on the device
moves nothing if its fp32 master, m and v stay there, and 12 bytes per
parameter each way if they must come up for the update and leave again for
the next activation peak: six times the host update's traffic, for an update
the host makes at memory bandwidth (and hides under backward, Note [CPU Adam
during backward]). So states never come up only to be updated and pushed
down again; a chunk's states live on the device only where they can stay
there through the whole step.

That room is fixed by the trace (PatrickStar's margin rule): the chunk budget
at the activation peak, limit - max(interval peaks), less every 16-bit chunk
(forward and backward need them; kept resident when they fit). The states of
the chunks that fit in the rest, taken in first-use order, are the device's;
the others are updated on the host. First-use order because the first chunks'
gradients land last in backward, where CPU Adam has the least backward left
to hide under, and the next forward needs them first. The plan is made from
each step's adopted trace, so it follows a trace that changes (a longer
sequence, DTR, another batch size); until there is a trace (the warm-up
step), the update runs where the device has room at that moment, as before.

What the plan does not decide: a master the host budget spilled to the device
is updated there, and a host too full to take a 16-bit chunk updates on the
device (hooks/chunk_step.h's update_on_device, which also checks the room at
the moment of the update).
"""
from __future__ import annotations

__all__ = ["AdamPlacement"]

from .. import _C

_KIND = _C.chunks.ChunkKind
PARAM16, PARAM32, MOMENTUM, VARIANCE, GRAD32 = (_KIND.PARAM16, _KIND.PARAM32, _KIND.MOMENTUM,
                                               _KIND.VARIANCE, _KIND.GRAD32)


class AdamPlacement:
    """The hybrid-Adam plan of one ParamStore: which chunks' states live on
    the device (Note [Where a chunk's Adam runs]).

    Args:
        store: the ParamStore whose chunks are planned (read through
            store.chunks at each use: a relayout replaces the scheduler).
        hybrid: tidal.hybrid_adam; without it every update runs on the host.
    """

    def __init__(self, store, hybrid: bool, disk: bool = False):
        self._store = store
        self._hybrid = hybrid
        # With the NVMe tier the step keeps the rule of before the plan (where
        # the device has room at the update): the tier's disk traffic and its
        # estimate were measured with it, and the plan moved more chunks to
        # disk in test_engine_nvme's bf16 case; not yet worked out.
        self._disk = disk
        # Chunk index -> planned on the device, per accumulation mode (the
        # sums are a fourth state list); None: no trace yet.
        self._plans: dict[bool, frozenset] | None = None
        self._key = None  # what the plan was made from: (chunk count, room)
        self._capacities = None  # kind -> [bytes per chunk], read once per layout

    def replan(self, limit: int, peaks) -> None:
        """A new plan from the tracer's budget less margin (`limit`) and the
        interval peaks of its adopted trace (`peaks`, non-chunk bytes)."""
        if not peaks or self._disk:
            self.forget()
            return
        c = self._store.chunks
        n = c.num_chunks
        room = limit - max(peaks)
        if (n, room) == self._key:
            return  # (the same room for the same chunks: the same plan)
        self._key = (n, room)
        if self._capacities is None or len(self._capacities[PARAM16]) != n:
            # Once per layout: a steady step makes no call into C++ here.
            self._capacities = {k: [c.chunk_capacity_bytes(i, k) for i in range(n)]
                                for k in (PARAM16, PARAM32, MOMENTUM, VARIANCE, GRAD32)}
        caps = self._capacities
        room -= sum(caps[PARAM16])
        plans = {}
        for summing in (False, True):
            kinds = (PARAM32, MOMENTUM, VARIANCE) + ((GRAD32,) if summing else ())
            left, plan = room, set()
            for i in range(n):
                need = sum(caps[k][i] for k in kinds)
                if need <= left:
                    plan.add(i)
                    left -= need
            plans[summing] = frozenset(plan)
        self._plans = plans

    def forget(self) -> None:
        """The chunks were rebuilt (a relayout): no plan until the next trace."""
        self._plans = None
        self._key = None
        self._capacities = None

    def planned(self, summing: bool = False):
        """The chunks planned on the device, or None before the first trace."""
        return None if self._plans is None else self._plans[summing]

    def prefer_device(self, chunk: int, summing: bool) -> bool:
        """Whether `chunk`'s update belongs on the device (without a plan:
        wherever the device has room, the warm-up step's rule)."""
        if not self._hybrid:
            return False
        return self._plans is None or chunk in self._plans[summing]

    def on_device(self, chunk: int, kinds, host_short: bool) -> bool:
        """Whether `chunk`'s update (a step over `kinds`, or a fold) runs on
        the device now: the plan, checked against the room there is."""
        summing = GRAD32 in kinds
        return self._store.chunks.update_on_device(chunk, list(kinds), host_short,
                                                   self.prefer_device(chunk, summing))
