// The chunk scheduler's prefetch: the cursor that walks the recorded trace
// ahead of the current moment and starts the copies the next uses need
// (Note [Prefetch] in chunk_scheduler.h); the rest of the scheduler is in
// chunk_scheduler.cpp.
#include <algorithm>

#include "runtime/core/error.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal {

void ChunkScheduler::prefetch() {
  const auto length = static_cast<std::int64_t>(trace_.size());
  prefetch_blocked_ = false;
  if (length == 0) return;
  prefetch_cursor_ = std::max(prefetch_cursor_, moment_ + 1);
  const std::int64_t limit = moment_ + 1 + length;  // at most one step ahead
  while (prefetch_cursor_ < limit && outstanding_prefetches_ - outstanding_ahead_ < options_.prefetch_depth) {
    const TraceEntry& entry = trace_.at(prefetch_cursor_);
    const Chunk& chunk = store_.chunk(entry.chunk);
    if (chunk.space() == entry.space || !chunk.has_payload()) {
      ++prefetch_cursor_;  // in place, or nothing to copy (access materializes it)
      continue;
    }
    // An earlier use still to come wants the chunk where it is, it is in
    // use now, or it left ahead of a lowering still to come (Note [Chunks
    // leave ahead of a lowering]): wait, keeping the order.
    if (trace_.next_use(entry.chunk, moment_) != prefetch_cursor_ || !chunk.movable() || held_down(entry.chunk)) {
      prefetch_blocked_ = true;
      return;
    }
    if (!start_prefetch(entry.chunk, entry.space, prefetch_cursor_, /*ahead=*/false)) {
      prefetch_blocked_ = true;
      return;
    }
    ++prefetch_cursor_;
  }
}

bool ChunkScheduler::start_prefetch(ChunkId id, MemorySpace space, std::int64_t needed_at, bool ahead) {
  RoomRequest request;
  request.space = space;
  request.bytes = store_.chunk(id).capacity_bytes();
  request.chunk = id;
  request.prefetch = true;
  request.needed_at = needed_at;
  if (!place(id, space, request)) return false;
  Slot& slot = slots_[id];
  slot.prefetched = true;
  slot.ahead = ahead;
  ++outstanding_prefetches_;
  ++stats_.prefetches;
  if (ahead) {
    ++outstanding_ahead_;
    ++stats_.prefetches_ahead;
  }
  return true;
}

bool ChunkScheduler::send_ahead(ChunkId id) {
  if (!options_.prefetch || !following_ || trace_.empty()) return false;
  if (disk_ && disk_->failed()) return false;  // (as prefetch: Note [Chunks on NVMe: after a failure])
  const Chunk& chunk = store_.chunk(id);
  if (!chunk.has_payload() || !chunk.movable() || slots_[id].prefetched || held_down(id)) return false;
  if (chunk.space() != MemorySpace::kHost && chunk.space() != MemorySpace::kDevice) return false;
  const std::int64_t use = trace_.next_use(id, moment_);
  if (use == AccessTrace::kNever) return false;
  const MemorySpace space = trace_.at(use).space;
  if (space == chunk.space()) return false;
  if (!start_prefetch(id, space, use, /*ahead=*/true)) return false;
  debug_validate();
  return true;
}

void ChunkScheduler::rewind_prefetch(ChunkId id) {
  if (!options_.prefetch || !following_ || trace_.empty()) return;
  const std::int64_t use = trace_.next_use(id, moment_);
  if (use >= prefetch_cursor_ || use == AccessTrace::kNever) return;
  if (trace_.at(use).space == store_.chunk(id).space()) return;  // (moved where that use wants it)
  prefetch_cursor_ = use;
  ++stats_.prefetch_rewinds;
}

void ChunkScheduler::clear_prefetched(ChunkId id, bool wasted) {
  Slot& slot = slots_[id];
  TIDAL_INTERNAL_ASSERT(slot.prefetched && outstanding_prefetches_ > 0, "chunk ", id,
                        " was not prefetched");
  slot.prefetched = false;
  slot.staged = false;
  --outstanding_prefetches_;
  if (slot.ahead) {
    slot.ahead = false;
    --outstanding_ahead_;
  }
  if (wasted) ++stats_.prefetches_wasted;
}

void ChunkScheduler::clear_all_prefetched() {
  if (outstanding_prefetches_ == 0) return;
  for (ChunkId id = 0; id < slots_.size(); ++id) {
    if (slots_[id].prefetched) clear_prefetched(id, /*wasted=*/true);
  }
}

}  // namespace tidal
