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
// On a GPU whose chunk blocks come from torch's caching allocator, an
// allocation past the engine's budget fails in the op that asks for it:
// the engine caps torch at its budget while it lives (Note [torch's cap
// belongs to the live engines] in python/tidal/engine/device_cap.py), and a
// cache miss past the cap first asks for room (Note [Room on a cache miss] in
// hooks/cuda_room.h). The simulated device's "device" tensors are CPU
// tensors, so the counter plays torch's part: with a limit set (while the
// engine's forward and backward run), a counted allocation that would take
// the live bytes past it first asks the room maker (on the thread that
// armed it: chunks not in use leave the device, or DTR evicts), and if that
// frees too little throws c10::OutOfMemoryError (torch's
// torch.OutOfMemoryError) before anything is allocated. The engine sets the
// limit to what its device budget leaves beside the chunks on the device
// (budget - margin - chunk bytes held) whenever the chunk bytes change, so
// chunks plus every other byte the meter sees never pass the budget: DTR's
// interception evicts and retries on that error, as it does on a GPU's, and
// without DTR the op fails and the engine says what is held. With torch's
// caching rules on (set_host_allocation_model, tidal.simulated_allocator) the
// limit is in the bytes those rules reserve instead, the whole budget less the
// chunks, as torch's cap on a GPU (Note [Who owns a device byte] in
// runtime/memory/caching_allocator_model.h).
struct HostAllocationLimit {
  std::int64_t limit = -1;        // live bytes allowed; < 0: none
  std::int64_t baseline = 0;      // live bytes that are not the engine's (for the message)
  std::int64_t budget = 0;        // the device budget less the margin (for the message)
  std::int64_t chunk_bytes = 0;   // chunk bytes on the device (for the message)
  // With torch's caching rules on (set_host_allocation_model): the bytes the
  // model may reserve (the device budget less the chunk bytes on the device,
  // plus what it held when the engine's meter was made); < 0: none. Replaces
  // `limit`, which is then ignored.
  std::int64_t reserved_cap = -1;
  // Note [A meter's baseline]: the allocations counted up to this sequence
  // number are the baseline's (0: none); as they die, `limit` and `baseline`
  // fall by their bytes, and `reserved_cap` by what the model stops
  // reserving for them (`reserved_baseline`, which the cap includes).
  std::uint64_t baseline_id = 0;
  std::int64_t reserved_baseline = 0;
  // The meter that set it (Note [One engine's window is its own]); 0: none.
  std::uint64_t owner = 0;
};
void set_host_allocation_limit(const HostAllocationLimit& limit);
// Note [One engine's window is its own]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The count, its limit and its room maker are one per process, and belong to
// the engine whose forward or backward runs. An engine dropped earlier can be
// collected in the middle of that window (the cycle collector runs wherever
// an allocation trips it), and what its teardown does must not reach into the
// live engine's window: its meter lifts only a limit it set itself (`owner`);
// the engine's finalizer stops only a count it started
// (python/tidal/engine/hook_wiring.py); and what finalizers allocate while
// the cycle collector runs is not counted (tidal's own host allocations, as
// DTR's generator states: Note [tidal's own host allocations]). Before, a
// collection inside a forward stopped the count (the step's non-chunk peak
// came out at a quarter of the truth) or counted a dead engine's teardown as
// the live engine's activations (the next step's chunk room shrank by them,
// and a backward that fits failed for lack of room).
//
// Lifts the limit if `owner` set it; else leaves it as it is.
void clear_host_allocation_limit(std::uint64_t owner);

// Note [Who owns a device byte] (runtime/memory/caching_allocator_model.h):
// while on (a count of users, one per engine meter that asks), every counted
// allocation is also placed by a CachingAllocatorModel as torch's CUDA caching
// allocator would place it on a GPU. With a reserved_cap set, an allocation
// the model cannot place under it fails as torch.OutOfMemoryError, after a
// miss asked the room maker for room_to_make() bytes, as on a GPU (Note [Room
// on a cache miss] in hooks/cuda_room.h). Turning it on gives the model's
// cache back (torch's empty_cache), as a fresh engine's meter starts.
void set_host_allocation_model(bool on);
struct HostAllocationModelUse {
  bool on = false;
  std::int64_t reserved = 0;        // the model's segments
  std::int64_t allocated = 0;       // its blocks handed out
  std::int64_t stuck = 0;           // what it cannot give back: active + inactive split
  std::int64_t largest_request = 0;  // the largest counted request since it was turned on
  // With a reserved_cap: the most the device held at one moment (the model's
  // reserved bytes + the chunk bytes of the limit) since
  // reset_host_allocation_reserved_peak().
  std::int64_t device_reserved_peak = 0;
  std::uint64_t misses = 0;         // misses that asked the room maker
  std::uint64_t made_room = 0;      // ... and got room
  std::uint64_t failures = 0;       // allocations it could not place (OutOfMemoryError)
};
HostAllocationModelUse host_allocation_model_use();
void reset_host_allocation_reserved_peak();
// Called when a counted allocation on `thread` would pass the limit, before
// it fails: may free device room (chunks not in use leave the device) and
// update the limit; returns whether it freed anything. Not called again
// while it runs. Null: none.
using RoomMaker = std::function<bool(std::size_t bytes)>;
void set_host_allocation_room_maker(RoomMaker maker, std::thread::id thread);

// Note [A meter's baseline]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A meter counts from what was live when it was made (its baseline: counted
// tensors of earlier windows, a previous engine's leftovers). When those die
// while the meter measures (the cycle collector frees a dead engine's tensors
// in the middle of a step), the live bytes fall by them, and a peak taken
// against the fixed baseline comes out short by as much: a budget measured so
// was too small, by chance of collection. So a meter opens a baseline: from
// then on the counter adds up, for it, the bytes freed of allocations counted
// before it opened, and the meter's baseline is what was live then less those.
// Its peak is kept apart too (a peak taken while a baseline tensor lived, less
// the smaller baseline after it died, would come out long by as much), and so
// is what the caching model keeps reserved for the baseline's blocks (the
// segments that hold one of them), walked again as one of them dies.
struct HostAllocationBaseline {
  std::int64_t freed = 0;     // bytes of the baseline's allocations freed since it opened
  std::int64_t peak_own = 0;  // max of (live bytes + freed) since the last peak reset
  std::int64_t reserved = 0;  // the model's segments holding a live block of the baseline
};
// Its id: allocations counted with a sequence number up to it are its own.
std::uint64_t open_host_allocation_baseline();
HostAllocationBaseline host_allocation_baseline(std::uint64_t id);
void close_host_allocation_baseline(std::uint64_t id);

// Installs the wrapper once (idempotent) and turns counting on or off.
void set_host_allocation_counting(bool enabled);
bool host_allocation_counting();
HostAllocationCounts host_allocation_counts();
// Peak restarts from the live bytes; the allocation count from 0.
void reset_host_allocation_peak();

}  // namespace tidal::hooks
