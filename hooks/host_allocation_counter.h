// Counts the bytes torch allocates on the CPU, to measure the engine's
// non-chunk memory on the simulated device (where torch "device" tensors are
// CPU tensors). On CUDA the engine reads torch.cuda.memory_allocated()
// instead, and this counter stays off.
//
// Note [Counting CPU allocations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// install() puts a wrapper in front of torch's CPU allocator (c10's
// allocator registry, one priority above the default). While enabled, each
// allocation's size goes into a table keyed by its address and its deleter
// becomes one that subtracts it again, so the count is live bytes exactly,
// including tensors autograd saved whose Python objects are long gone. While
// disabled the wrapper passes allocations through untouched (one virtual
// call). Allocations made while disabled are never counted, also not when
// they are freed. Chunk memory comes from the device arena, not from torch,
// and so is never counted.
#pragma once

#include <cstdint>
#include <functional>
#include <thread>

namespace tidal::hooks {

struct HostAllocationCounts {
  std::int64_t live_bytes = 0;   // counted allocations not yet freed
  std::int64_t peak_bytes = 0;   // max of live_bytes since the last reset
  std::int64_t allocations = 0;  // counted allocations since the last reset
  // With a limit set: the max of (live bytes - the limit's baseline + the
  // limit's chunk bytes) at any allocation or limit update, i.e. the
  // simulated device's whole use at one moment; not reset by
  // reset_host_allocation_peak (reset_host_allocation_device_peak does).
  std::int64_t device_peak_bytes = 0;
};
void reset_host_allocation_device_peak();

// Note [The simulated device's budget is a hard limit]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On a GPU an allocation past the device's memory fails in the op that asks
// for it. The simulated device's "device" tensors are CPU tensors, so the
// counter plays that part: with a limit set, a counted allocation that would
// take the live bytes past it throws c10::OutOfMemoryError (torch's
// torch.OutOfMemoryError) before anything is allocated. The engine sets the
// limit to what its device budget leaves beside the chunks on the device
// (budget - margin - chunk bytes held) whenever the chunk bytes change, so
// chunks plus every other byte the meter sees never pass the budget: DTR's
// interception evicts and retries on that error, as it does on a GPU's, and
// without DTR the op fails and the engine says what is held.
struct HostAllocationLimit {
  std::int64_t limit = -1;        // live bytes allowed; < 0: none
  std::int64_t baseline = 0;      // live bytes that are not the engine's (for the message)
  std::int64_t budget = 0;        // the device budget less the margin (for the message)
  std::int64_t chunk_bytes = 0;   // chunk bytes on the device (for the message)
};
void set_host_allocation_limit(const HostAllocationLimit& limit);
// Called when a counted allocation on `thread` would pass the limit, before
// it fails: may free device room (chunks not in use leave the device) and
// update the limit; returns whether it freed anything. Not called again
// while it runs. Null: none.
using RoomMaker = std::function<bool(std::size_t bytes)>;
void set_host_allocation_room_maker(RoomMaker maker, std::thread::id thread);

// Installs the wrapper once (idempotent) and turns counting on or off.
void set_host_allocation_counting(bool enabled);
bool host_allocation_counting();
HostAllocationCounts host_allocation_counts();
// Peak restarts from the live bytes; the allocation count from 0.
void reset_host_allocation_peak();

}  // namespace tidal::hooks
