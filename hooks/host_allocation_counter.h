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

namespace tidal::hooks {

struct HostAllocationCounts {
  std::int64_t live_bytes = 0;   // counted allocations not yet freed
  std::int64_t peak_bytes = 0;   // max of live_bytes since the last reset
  std::int64_t allocations = 0;  // counted allocations since the last reset
};

// Installs the wrapper once (idempotent) and turns counting on or off.
void set_host_allocation_counting(bool enabled);
bool host_allocation_counting();
HostAllocationCounts host_allocation_counts();
// Peak restarts from the live bytes; the allocation count from 0.
void reset_host_allocation_peak();

}  // namespace tidal::hooks
