// The engine's non-chunk meters for the memory tracer (Note [The memory
// tracer] in runtime/tracer/memory_tracer.h): what "non-chunk device memory"
// is on each device.
#pragma once

#include <memory>

#include "hooks/torch_memory_provider.h"
#include "runtime/tracer/memory_tracer.h"

namespace tidal::hooks {

// The simulated device: torch's CPU allocations counted by the host
// allocation counter (Note [Counting CPU allocations]) while forward and
// backward run, less what was live when the meter was made. torch_caching:
// placed by torch's CUDA caching allocator's rules too, the device budget
// held in the bytes they reserve (Note [Who owns a device byte] in
// runtime/memory/caching_allocator_model.h); else exact bytes, the budget
// less the margin held in live bytes.
std::unique_ptr<NonChunkMeter> make_host_counter_meter(std::size_t device_budget = 0,
                                                       bool torch_caching = false);

// Chunk blocks from torch's allocator (Note [Chunk memory and torch's
// caching allocator]): torch's allocated bytes less the chunk blocks the
// provider holds, exact peaks. `subtract_baseline`: less what was there
// when the meter was made (the simulated device's CPU stand-in, where torch's
// CPU allocator also serves the rest of the process).
std::unique_ptr<NonChunkMeter> make_provider_meter(std::shared_ptr<TorchMemoryProvider> provider,
                                                   bool subtract_baseline);

}  // namespace tidal::hooks
