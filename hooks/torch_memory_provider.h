// Device memory providers backed by torch's allocators: chunk blocks come from
// torch's CUDA caching allocator on a GPU, or from torch's CPU allocator (counted
// by the host allocation counter) as the simulated device's stand-in.
//
// Note [Chunk memory and torch's caching allocator]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The problem. With chunk blocks from cudaMalloc, two allocators share one GPU
// and neither can take memory from the other: torch's caching allocator keeps
// the memory activations freed (reserved, not allocated) and gives it back only
// on its own OOM path, which cannot free chunks; the chunk scheduler frees
// chunk blocks with cudaFree, which a later torch allocation cannot reuse until
// torch's cache misses. Each starves the other, and the engine, which measured
// torch's allocated bytes, did not even see what torch's cache kept.
//
// The decision: chunk blocks come from torch's caching allocator
// (Device::set_memory_provider, Note [Device memory providers] in
// runtime/device/device.h). Then there is one allocator and one cache:
// * a chunk block the scheduler frees (BlockPool trims it when the budget
//   drops) lands in torch's cache, where the next activation can use it,
//   without a cudaFree: freeing a chunk block in the middle of a step no longer
//   synchronizes the device (torch frees to its cache; cudaFree happens only in
//   torch's own empty_cache / OOM path);
// * when torch runs out for a chunk block, its OOM path first frees every
//   cached segment it holds (the activations' leftovers included) and retries
//   cudaMalloc; only then does allocate() return nullptr, and the scheduler
//   trims its own cached blocks and evicts chunks before it gives up
//   (ChunkScheduler::acquire_block);
// * when torch's cache has no block for an activation, the cached chunk
//   blocks it can reuse are those the scheduler freed; chunks still resident
//   are the engine's to limit, by the budget it derives from the trace (Note
//   [The memory tracer] in runtime/tracer/memory_tracer.h), and while forward
//   and backward run, torch's free-memory callback moves resident chunks off
//   the device before torch reserves past its cap (Note [Room on a cache
//   miss] in hooks/cuda_room.h; the registry is found at run time like the
//   allocator, below).
// * the budget now counts all of it: chunk blocks are in torch's allocated and
//   reserved bytes, so torch's stats are the device's whole use by torch and
//   tidal. The engine subtracts the bytes this provider holds to get the
//   non-chunk memory; held_bytes() is what the source counted for them (the
//   change of its live bytes across each call: on a GPU the bytes requested,
//   as torch's trace tracker reports them, so without torch's 512-byte
//   rounding; the reserved bytes, which the budget is held in, include it).
//
// Measuring non-chunk peaks exactly. The source keeps one peak of the bytes
// live (chunks included). Between two chunk-block calls the bytes this
// provider holds are constant, so there (peak - held) is the non-chunk peak.
// At each call, before the held bytes change, the provider folds (peak -
// held) into its window peak and then restarts the source's peak at the
// current value; at a trace point other_peak_bytes() = max(window peak, peak
// now - held) is the exact non-chunk peak since reset_window(). On a GPU the
// source's counts are tidal's own, kept from torch's allocator trace tracker
// (requested bytes, reserved bytes and their peaks: CudaAllocatorTotals in
// hooks/cuda_room.h), so torch's statistics (max_memory_allocated and the
// like) are never reset behind the user's back.
//
// Why the functions are found at run time. tidal builds against torch's
// headers but must link and import with a CPU build of torch (this project's
// CI), which has no libc10_cuda.so. The CUDA source therefore opens the
// already loaded libc10_cuda.so (dlopen RTLD_NOLOAD: a CUDA build of torch
// loaded it at `import torch`) and reads c10::cuda::CUDACachingAllocator::allocator,
// the one exported object raw_alloc_with_stream / raw_delete / getDeviceStats
// reach through (they are inline in CUDACachingAllocator.h and
// call virtual functions on it; virtual calls need no link-time symbols). With
// a CPU build of torch the lookup fails with an error saying so. Going through
// torch's Python API (torch.cuda.caching_allocator_alloc) instead would have
// needed the GIL inside Device::allocate and Python alive at every free,
// including frees at interpreter exit.
//
// Streams. A block from raw_alloc_with_stream belongs to that stream in torch's
// cache: torch hands it out again, after raw_delete, to work on that stream
// without waiting. The CUDA provider allocates on torch's compute stream (the
// engine's), and Device frees a chunk block only after its fence completed
// (Note [Block fences]), so no copy on tidal's streams still touches it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>

#include "runtime/device/device.h"

namespace tidal::hooks {

class TorchMemoryProvider final : public DeviceMemoryProvider {
 public:
  // One of torch's allocators, and its counters of allocated bytes.
  class Source {
   public:
    virtual ~Source() = default;
    virtual std::string name() const = 0;
    // nullptr when out of memory.
    virtual void* allocate(std::size_t bytes) = 0;
    virtual void free(void* ptr) = 0;
    // Bytes allocated now, and the most since reset_peak().
    virtual std::int64_t allocated_bytes() const = 0;
    virtual std::int64_t peak_allocated_bytes() const = 0;
    // The most reserved since reset_peak() (chunk blocks, tensors and the
    // allocator's cache); -1 where the source does not keep a cache of its own.
    virtual std::int64_t peak_reserved_bytes() const { return -1; }
    virtual void reset_peak() = 0;
  };

  explicit TorchMemoryProvider(std::unique_ptr<Source> source);

  std::string name() const override;
  void* allocate(std::size_t bytes) override;
  void free(void* ptr) override;

  // What torch counts for the blocks this provider handed out and not yet got back.
  std::int64_t held_bytes() const;
  std::int64_t held_blocks() const;
  // torch's allocated bytes now, less held_bytes(): the memory that is not chunks.
  std::int64_t other_bytes() const;
  // The peak of other_bytes() since reset_window(), exactly (Note [Chunk memory
  // and torch's caching allocator]).
  std::int64_t other_peak_bytes() const;
  // The most torch reserved at one moment since reset_window() (chunk blocks
  // included: the device's whole use by torch and tidal), exactly; -1 where
  // the source keeps no cache (the CPU stand-in).
  std::int64_t reserved_peak_bytes() const;
  // Restarts the window: the source's peak and the window peak start from now.
  void reset_window();
  std::int64_t allocations() const;
  std::int64_t frees() const;

 private:
  // Folds the interval since the last restart into the window; caller holds mutex_.
  void close_interval();

  std::unique_ptr<Source> source_;
  mutable std::mutex mutex_;
  std::unordered_map<void*, std::int64_t> counted_;  // block -> bytes torch counted for it
  std::int64_t held_ = 0;
  std::int64_t window_peak_ = 0;
  std::int64_t window_reserved_peak_ = -1;
  std::int64_t allocations_ = 0;
  std::int64_t frees_ = 0;
};

// torch's CUDA caching allocator on device `ordinal`, blocks on `stream` (a
// cudaStream_t; 0 = the legacy default stream). Throws NotImplementedError when
// tidal was built without CUDA or torch is not a CUDA build (no libc10_cuda.so
// loaded), RuntimeError when torch's CUDA allocator is not initialized.
std::shared_ptr<TorchMemoryProvider> make_torch_cuda_memory_provider(int ordinal,
                                                                    std::uintptr_t stream);

// torch's CPU allocator, each block counted by the host allocation counter
// (hooks/host_allocation_counter.h) whether counting is on or not, as torch
// counts every block of its CUDA allocator: the simulated device's stand-in for
// the CUDA provider, so the engine's accounting runs the same there.
std::shared_ptr<TorchMemoryProvider> make_torch_cpu_memory_provider();

}  // namespace tidal::hooks
