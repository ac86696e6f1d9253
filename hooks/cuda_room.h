// Room for an allocation on a GPU, made inside torch's CUDA caching allocator
// before it reserves a new segment (Note [Room on a cache miss]).
//
// Note [Room on a cache miss]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The problem (Note [Who owns a device byte] in
// runtime/memory/caching_allocator_model.h): the engine plans the chunk room
// from the allocated bytes its trace saw, but torch's cap limits reserved
// bytes, and nothing on CUDA made room when an activation needed a new
// segment past the cap: the op failed, though chunks not in use sat on the
// device.
//
// The hook: torch's caching allocator, when no cached block fits a request,
// runs every callback in c10's FreeCudaMemoryCallbacksRegistry and looks
// again before it reserves a segment (and, past its cap, gives back its whole
// free segments and tries once more, then raises OutOfMemoryError). tidal
// registers one callback per process. While an engine's forward or backward
// runs (armed by DeviceRoom::set_device_room_maker, as the simulated device's
// room maker is), the callback reads torch's statistics and asks for
// room_to_make(...) bytes: enough that a segment for the largest non-chunk
// request seen so far fits under the engine's cap once torch gives back what
// it can. DeviceRoom::free_device_room frees them as on the simulated
// device: chunks not in use leave by the trace (their blocks go back to
// torch's cache, where the retry finds them or whence torch gives them back
// to the driver), or, under DTR with the arbiter, the cheaper activation.
//
// Why the largest request and not this one: the callback is not told the
// size (FreeMemoryCallback::Execute() takes nothing). An allocator trace
// tracker (attachAllocatorTraceTracker) sees every request's size after it
// is served, so from the warm-up on the largest request is known; a request
// larger than any before it may still fail, and then fails as before.
//
// Rules of the callback (it runs on whatever thread allocates, with torch's
// allocator lock held, which is recursive, so the frees of an eviction may
// take it again on this thread):
//  * never for chunk blocks: the scheduler's own allocation (ChunkBlockScope)
//    has its own fallbacks, and the scheduler is in the middle of a change;
//  * never re-entered on a thread (an allocation inside the room maker);
//  * never throws into torch: an error is kept for the memory report, and
//    torch goes on to its own out-of-memory path;
//  * only for a miss on the armed engine's device (cudaGetDevice: torch
//    allocates on the current device), on the thread running its hooks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "hooks/host_allocation_counter.h"

namespace tidal::hooks {

struct CudaRoomCounts {
  std::uint64_t misses = 0;       // cache misses seen while armed
  std::uint64_t made_room = 0;    // misses on which room was asked for and some was freed
  std::uint64_t bytes_asked = 0;  // what those asked for
  std::uint64_t short_of_room = 0;  // misses on which the maker could free nothing more
  std::uint64_t errors = 0;       // the maker threw (last_error says what)
  std::size_t largest_request = 0;  // the largest non-chunk request on the tracked device
  std::string last_error;
};

// Registers the callback and the trace tracker with torch (once per process)
// and tracks the requests on device `ordinal` from now on (the largest is
// kept until reset_cuda_room_counts). NotImplementedError without the CUDA
// backend or a CUDA build of torch.
void track_cuda_requests(int ordinal);
// While armed, misses on `ordinal` make room up to `cap` bytes through
// `maker`. Returns a token; disarm_cuda_room(token) disarms only if no other
// arming came since.
std::uint64_t arm_cuda_room(int ordinal, std::size_t cap, RoomMaker maker);
void disarm_cuda_room(std::uint64_t token);
// The token of the arming in force, or 0.
std::uint64_t armed_cuda_room();
// Misses on this thread may make room from now on (the engine's hooks call
// it as they run; no other thread touches the scheduler).
void set_cuda_room_thread();
// The largest request the room is sized for: this window's and the last's
// (an engine rolls it at each step's end, so a request outside training,
// an evaluation or a load, stops counting after a step).
void roll_cuda_request_window();
CudaRoomCounts cuda_room_counts();
void reset_cuda_room_counts();

// torch's allocator on the tracked device, as its trace tracker reports it,
// so tidal never resets torch's own statistics (they stay the user's): bytes
// requested and live (chunk blocks included), bytes reserved, and the peak of
// each since reset_cuda_allocator_peaks(). Starts from torch's statistics
// when tracking starts (track_cuda_requests).
struct CudaAllocatorTotals {
  std::int64_t requested = 0;
  std::int64_t requested_peak = 0;
  std::int64_t reserved = 0;
  std::int64_t reserved_peak = 0;
};
CudaAllocatorTotals cuda_allocator_totals();
void reset_cuda_allocator_peaks();

// While one lives on a thread, torch allocations there are chunk blocks.
class ChunkBlockScope {
 public:
  ChunkBlockScope();
  ~ChunkBlockScope();
  ChunkBlockScope(const ChunkBlockScope&) = delete;
  ChunkBlockScope& operator=(const ChunkBlockScope&) = delete;
  static bool active();
};

}  // namespace tidal::hooks
