// The access trace: the sequence of chunk accesses of one training step, one
// entry per access() ("moment"). Training repeats the same sequence every
// step, so the trace of one step predicts the next: it drives OPT eviction
// (evict the chunk whose next use is farthest) and prefetch (bring the next
// chunks before they are needed). See Note [Moments and the trace] in
// chunk_scheduler.h for how the scheduler records and follows it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/memory_space.h"

namespace tidal {

struct TraceEntry {
  ChunkId chunk = kNoChunk;
  MemorySpace space = MemorySpace::kNone;  // where the access wanted the chunk

  friend constexpr bool operator==(const TraceEntry&, const TraceEntry&) = default;
};

class AccessTrace {
 public:
  // Returned by next_use for a chunk the trace never touches.
  static constexpr std::int64_t kNever = std::numeric_limits<std::int64_t>::max();

  AccessTrace() = default;
  explicit AccessTrace(std::vector<TraceEntry> entries);

  std::size_t size() const { return entries_.size(); }
  bool empty() const { return entries_.empty(); }
  const std::vector<TraceEntry>& entries() const { return entries_; }
  // The entry of `moment`, counting on into later steps: moment size() is
  // moment 0 of the next step. Requires a non-empty trace and moment >= 0.
  const TraceEntry& at(std::int64_t moment) const {
    return entries_[static_cast<std::size_t>(moment % static_cast<std::int64_t>(entries_.size()))];
  }

  // The first moment after `moment` (>= -1; moments past the end continue
  // into the repeated next steps) at which `chunk` is accessed, or kNever.
  std::int64_t next_use(ChunkId chunk, std::int64_t moment) const;
  // Number of accesses of `chunk` in one step.
  std::size_t uses(ChunkId chunk) const {
    return chunk < uses_.size() ? uses_[chunk].size() : 0;
  }

  // InternalError unless the per-chunk use index matches the entries.
  void validate() const;

 private:
  std::vector<TraceEntry> entries_;
  std::vector<std::vector<std::uint32_t>> uses_;  // chunk id -> ascending moments
};

}  // namespace tidal
