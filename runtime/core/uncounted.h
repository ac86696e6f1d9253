// tidal's own host allocations during a step.
//
// Note [tidal's own host allocations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// On the simulated device, torch's CPU allocations while forward and backward
// run are the "device" memory the engine meters and limits (Note [Counting
// CPU allocations] and Note [The simulated device's budget is a hard limit]
// in hooks/host_allocation_counter.h). Some of them are tidal's own host-side
// bookkeeping, which on a GPU would be host memory and cost the device
// nothing: the CPU generator states DTR saves for random ops and restores
// for their replays. Such code runs inside an UncountedScope: allocations of
// this thread are neither counted nor limited while one is open.
#pragma once

namespace tidal {

inline thread_local int g_uncounted_depth = 0;

inline bool uncounted_now() { return g_uncounted_depth > 0; }

class UncountedScope {
 public:
  UncountedScope() { ++g_uncounted_depth; }
  ~UncountedScope() { --g_uncounted_depth; }
  UncountedScope(const UncountedScope&) = delete;
  UncountedScope& operator=(const UncountedScope&) = delete;
};

}  // namespace tidal
