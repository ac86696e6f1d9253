// torch's CUDA caching allocator as rules (sizes, pools, segments, splitting,
// the cache) and as a model that follows them, libtorch-free: the room policy
// the engine runs on a GPU when torch's cache misses (hooks/cuda_room.h), and
// the simulated device's meter of what a GPU would reserve
// (hooks/host_allocation_counter.h). Tested against torch's documented
// behaviour in tests/cpp/runtime/memory/caching_allocator_model_test.cpp.
//
// Note [Who owns a device byte]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// One budget counts every byte the process holds on the device while an
// engine lives: chunk blocks, activations, workspaces, and what an allocator
// keeps cached but unused. torch's caching allocator reserves whole segments
// (cudaMalloc) and cuts tensors out of them; a freed tensor's block stays in
// its segment, reserved, and serves a later request only if it is large
// enough. So the bytes allocated can be well below the bytes reserved, and a
// plan in allocated bytes runs out where the reserved ones pass the cap: on an
// H200 gpt-1.3b at a quarter budget failed with 1.17 GiB reserved but
// unallocated, gpt-6.7b with 0.63 GiB.
//  * On a GPU, chunk blocks come from torch's allocator (Note [Chunk memory
//    and torch's caching allocator] in hooks/torch_memory_provider.h), so
//    torch's cap (the engine's budget) bounds the reserved bytes of both.
//    When torch's cache has no block for a request it asks its free-memory
//    callbacks before it reserves a new segment; tidal's callback (Note [Room
//    on a cache miss] in hooks/cuda_room.h) makes room there: chunks not in
//    use leave the device (or, under DTR with the arbiter, an activation)
//    until a new segment for the largest request seen fits under the cap.
//  * On the simulated device with these rules on (tidal.simulated_allocator),
//    every non-chunk allocation is placed by CachingAllocatorModel exactly as
//    torch would place it, the cap is the budget less the chunk bytes on the
//    device, and the same policy (room_to_make) makes room on a miss. Past
//    the cap an allocation fails as torch.OutOfMemoryError, so a test that
//    packs chunks to the edge fails there the way it fails on a GPU.
// Who may free what: chunks leave by the trace (OPT), activations only under
// DTR; a request that still does not fit is torch's OutOfMemoryError.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <set>
#include <string>

namespace tidal {

// The size rules of c10/cuda/CUDACachingAllocator.cpp with its defaults (no
// max_split_size, no expandable segments, no power-of-two rounding).
namespace torch_cache {
constexpr std::size_t kMinBlockSize = 512;              // sizes are rounded to 512 bytes
constexpr std::size_t kSmallSize = std::size_t{1} << 20;  // the largest "small" request
constexpr std::size_t kSmallBuffer = std::size_t{2} << 20;  // small requests share 2 MiB segments
constexpr std::size_t kMinLargeAlloc = std::size_t{10} << 20;  // 1-10 MiB requests share 20 MiB
constexpr std::size_t kLargeBuffer = std::size_t{20} << 20;
constexpr std::size_t kRoundLarge = std::size_t{2} << 20;  // larger segments round up to 2 MiB

// A request's block size.
std::size_t round_size(std::size_t bytes);
// The segment a cache miss reserves for a block of `rounded` bytes.
std::size_t segment_size(std::size_t rounded);
}  // namespace torch_cache

// What the room policy reads of an allocator: torch's DeviceStats (aggregate)
// or the model's.
struct AllocatorUse {
  std::size_t reserved = 0;        // bytes of segments held
  std::size_t allocated = 0;       // bytes of blocks handed out
  std::size_t active = 0;          // handed out, or freed with stream uses pending
  std::size_t inactive_split = 0;  // free blocks in segments that also hold other blocks
};

// Note [Room on a cache miss] (hooks/cuda_room.h) as arithmetic: after a miss
// torch reserves a new segment if it fits under `cap`, first giving back its
// whole free segments if it must; what it can never give back is what is
// active and the free pieces of split segments. The bytes that must leave
// (chunk blocks, which go back to torch's cache as whole free segments or
// merge into one) so that a segment for `largest_request` fits: 0 when it
// fits already.
std::size_t room_to_make(const AllocatorUse& use, std::size_t cap, std::size_t largest_request);

// Places requests as torch's caching allocator does, for one stream and one
// device. Not thread-safe: its owner locks.
class CachingAllocatorModel {
 public:
  // A block handed out; opaque to the owner.
  using Handle = std::uintptr_t;
  // Asked on a miss, as torch asks its free-memory callbacks; true when it
  // freed something (the cap may have risen).
  using OnMiss = std::function<bool()>;

  CachingAllocatorModel();
  ~CachingAllocatorModel();
  CachingAllocatorModel(const CachingAllocatorModel&) = delete;
  CachingAllocatorModel& operator=(const CachingAllocatorModel&) = delete;

  // torch's malloc: the best-fitting cached block (split when the rest is
  // worth keeping); else on_miss() and a second look; else a new segment if
  // reserved + its size <= cap(); else every whole free segment is released
  // and the segment tried once more. 0 when that fails too (nothing was
  // placed; the cache may have been released). `cap` is read after on_miss.
  // `tag`: the owner's mark on the block (its allocation's order), read by
  // reserved_holding_tags_up_to.
  Handle allocate(std::size_t bytes, const std::function<std::size_t()>& cap, const OnMiss& on_miss,
                  std::uint64_t tag = 0);
  // torch's free: the block goes back to its pool, merged with free neighbours.
  void free(Handle handle);
  // torch's empty_cache: every whole free segment is released. Returns the bytes.
  std::size_t release_cached();

  AllocatorUse use() const;
  std::size_t peak_reserved() const { return peak_reserved_; }
  std::size_t peak_allocated() const { return peak_allocated_; }
  std::size_t segments() const { return segments_; }
  // The bytes of the segments that hold a live block tagged <= `tag` (what
  // those blocks keep reserved; 0 < tag). Walks every block.
  std::size_t reserved_holding_tags_up_to(std::uint64_t tag) const;
  // The block size of a live handle.
  std::size_t block_size(Handle handle) const;
  // What the last failed allocate() saw (for the error message).
  const std::string& last_failure() const { return last_failure_; }
  // InternalError unless pools, segments and counters agree.
  void validate() const;

 private:
  struct Block;
  struct BySize {
    bool operator()(const Block* a, const Block* b) const;
  };
  using Pool = std::set<Block*, BySize>;

  Pool& pool_for(bool small) { return small ? small_ : large_; }
  const Pool& pool_for_const(bool small) const { return small ? small_ : large_; }
  Block* take_free(bool small, std::size_t size);
  Block* new_segment(bool small, std::size_t bytes);
  void release_segment(Block* block);
  void note_peaks();

  Pool small_;
  Pool large_;
  std::set<Block*> heads_;  // the first block of each segment
  std::uintptr_t next_address_ = 1u << 21;
  std::size_t reserved_ = 0;
  std::size_t allocated_ = 0;
  std::size_t inactive_split_ = 0;
  std::size_t peak_reserved_ = 0;
  std::size_t peak_allocated_ = 0;
  std::size_t segments_ = 0;
  std::size_t live_blocks_ = 0;
  std::string last_failure_;
};

}  // namespace tidal
