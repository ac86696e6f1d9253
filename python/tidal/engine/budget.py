"""What the registered model needs of the device budget, checked at
tidal.initialize and after a relayout: each module's chunks must fit at
once, beside the chunks a host budget too small for the state keeps on the
device for good (Note [One place per chunk] in runtime/scheduler/chunk_scheduler.h)."""
from __future__ import annotations

from typing import NamedTuple

from .common import OutOfMemoryError
from .params import ParamTable
from .store import NOWHERE, PARAM16


class DeviceRoom(NamedTuple):
    """spilled_floor: chunk bytes that live on the device all the time (the
        host budget cannot hold them), a floor under the chunk room.
    warmup_chunk_room: the chunk room while no trace is known (Note [The
        warm-up budget] in runtime/tracer/memory_tracer.h)."""
    spilled_floor: int
    warmup_chunk_room: int


def check(params: ParamTable, store, config) -> DeviceRoom:
    """Raises OutOfMemoryError when a module's chunks, or those beside the
    spilled floor, cannot fit the room the device budget leaves for chunks."""
    c = store.chunks
    limit = store.device_budget - store.margin
    largest = 0
    for m, recs in params.module_records.items():
        chunks = {r.chunk for r in recs}
        need = sum(c.chunk_capacity_bytes(i, PARAM16) for i in chunks)
        largest = max(largest, need)
        if need > limit:
            raise OutOfMemoryError(
                f"module '{params.names[m]}' ({type(m).__name__}) needs its parameters on the "
                f"device at once: {len(recs)} parameters in {len(chunks)} chunk(s) of "
                f"{need} bytes, but the device budget leaves {limit} bytes for chunks "
                f"(budget {store.device_budget} - margin {store.margin}); raise "
                f"tidal.device_memory_budget or lower tidal.chunk_size")
    s = c.stats()
    # The chunks of the lists on the NVMe tier (Note [Chunks on NVMe: the
    # tier]) go to disk instead when the host is full (those with a payload:
    # a frozen pool's chunks have no master).
    to_disk = sum(c.chunk_capacity_bytes(i, k) for k in store.disk_kinds()
                  for i in range(c.num_chunks) if c.chunk_space(i, k) != NOWHERE)
    host = store.capacity_bytes()[0]
    spilled = max(0, s["resident_bytes_host"] + s["resident_bytes_device"] + s["resident_bytes_disk"]
                  - to_disk - host)
    if spilled + largest > limit:
        state = s["resident_bytes_host"] + s["resident_bytes_device"]
        raise OutOfMemoryError(
            f"the model's chunks ({state} bytes of states, {len(params.records)} parameters) "
            f"fit host + device only with no room to compute: the host holds {host} bytes of "
            f"them (tidal.host_memory_budget {store.host_budget} less "
            f"{store.host_reserve} kept for chunks moving down), so {spilled} "
            f"bytes stay on the device, and the largest module needs {largest} bytes of chunks "
            f"there at once, more than the {limit} bytes the device budget leaves for chunks "
            f"(tidal.device_memory_budget {store.device_budget} - margin "
            f"{store.margin}); activations need room too. Raise "
            f"tidal.host_memory_budget or tidal.device_memory_budget, or train a smaller model "
            f"(about {store.largest_model_params()} parameters at "
            f"{store.state_bytes_per_param()} bytes each fit these budgets)")
    return DeviceRoom(spilled, min(limit, max(largest + spilled, int(config.warmup_chunk_share * limit))))
