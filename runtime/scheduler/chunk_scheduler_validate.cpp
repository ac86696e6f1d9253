// The chunk scheduler's invariant checks (validate(), and after every
// operation under TIDAL_DEBUG_FULL); the rest of the scheduler is in
// chunk_scheduler.cpp.
#include "runtime/core/error.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal {

void ChunkScheduler::debug_validate() const {
#if defined(TIDAL_DEBUG_FULL)
  validate();
#endif
}

void ChunkScheduler::validate() const {
  store_.validate();
  pool_.validate();
  trace_.validate();
  TIDAL_INTERNAL_ASSERT(slots_.size() == store_.chunk_id_limit() && last_use_.size() == slots_.size(),
                        slots_.size(), " slots for ", store_.chunk_id_limit(), " chunks");
  std::size_t prefetched = 0;
  std::size_t ahead = 0;
  for (ChunkId id = 0; id < slots_.size(); ++id) {
    const Chunk& chunk = store_.chunk(id);
    const Slot& slot = slots_[id];
    // Note [Chunks on NVMe: clean chunks]: only a chunk with a home and a
    // payload can match it.
    TIDAL_INTERNAL_ASSERT(!slot.disk_current || (disk_ != nullptr && disk_->has_home(id) && slot.block),
                          "chunk ", id, " counts as matching its home on disk without a home or a payload");
    if (slot.block == nullptr) {
      TIDAL_INTERNAL_ASSERT(!chunk.has_payload(), "chunk ", id,
                            " has a payload in the store but no block");
      TIDAL_INTERNAL_ASSERT(!slot.prefetched, "chunk ", id, " prefetched without payload");
      continue;
    }
    const Block& block = *slot.block;
    TIDAL_INTERNAL_ASSERT(block.space == chunk.space() && block.data == chunk.payload(), "chunk ",
                          id, " payload ", chunk.payload(), " in ", to_string(chunk.space()),
                          " but its block is ", block.data, " in ", to_string(block.space));
    TIDAL_INTERNAL_ASSERT(block.bytes == chunk.capacity_bytes(), "chunk ", id, " of ",
                          chunk.capacity_bytes(), " bytes in a block of ", block.bytes);
    const auto& resident = resident_[index_of(block.space)];
    TIDAL_INTERNAL_ASSERT(slot.resident_pos < resident.size() && resident[slot.resident_pos] == id,
                          "chunk ", id, " missing from the resident list of ",
                          to_string(block.space));
    if (block.space == MemorySpace::kDevice) {
      TIDAL_INTERNAL_ASSERT(device_->owns(block.data, block.bytes), "chunk ", id,
                            " payload is not a live device allocation");
    } else if (block.space == MemorySpace::kDisk) {
      TIDAL_INTERNAL_ASSERT(disk_ != nullptr && block.data == disk_->token(id), "chunk ", id,
                            " on disk without the tier's token");
      TIDAL_INTERNAL_ASSERT(on_disk_list(id), "chunk ", id,
                            " of a list kept off disk is on disk");
      TIDAL_INTERNAL_ASSERT(slot.disk_current, "chunk ", id, " is on disk but its home does not hold it");
    } else {
      TIDAL_INTERNAL_ASSERT(block.host.data() == block.data && block.host.size() == block.bytes,
                            "chunk ", id, " host payload is not its host buffer");
    }
    if (slot.prefetched) ++prefetched;
    TIDAL_INTERNAL_ASSERT(!slot.ahead || slot.prefetched, "chunk ", id, " sent ahead but not prefetched");
    if (slot.ahead) ++ahead;
  }
  for (MemorySpace space : {MemorySpace::kHost, MemorySpace::kDevice}) {
    const std::size_t s = index_of(space);
    TIDAL_INTERNAL_ASSERT(resident_[s].size() == store_.chunks_in(space), "resident list of ",
                          to_string(space), " has ", resident_[s].size(), " chunks, the store ",
                          store_.chunks_in(space));
    TIDAL_INTERNAL_ASSERT(pool_.held_bytes(space) == store_.bytes_in(space) + pool_.cached_bytes(space),
                          to_string(space), ": held ", pool_.held_bytes(space), " != resident ",
                          store_.bytes_in(space), " + cached ", pool_.cached_bytes(space),
                          " (a block leaked)");
    // Note [Blocks leaving over a lowered budget]: on the device, cached
    // blocks may be over it.
    TIDAL_INTERNAL_ASSERT(store_.bytes_in(space) <= budget_[s], to_string(space), ": resident ",
                          store_.bytes_in(space), " bytes over the budget of ", budget_[s]);
    TIDAL_INTERNAL_ASSERT(space == MemorySpace::kDevice || pool_.held_bytes(space) <= budget_[s],
                          to_string(space), ": held ", pool_.held_bytes(space), " bytes over the budget of ",
                          budget_[s]);
    TIDAL_INTERNAL_ASSERT(stats_.peak_resident_bytes[s] >= store_.bytes_in(space),
                          "peak below resident");
  }
  TIDAL_INTERNAL_ASSERT(resident_[index_of(MemorySpace::kNone)].empty(), "resident list of none");
  TIDAL_INTERNAL_ASSERT(resident_[index_of(MemorySpace::kDisk)].size() == store_.chunks_in(MemorySpace::kDisk),
                        "resident list of disk has ", resident_[index_of(MemorySpace::kDisk)].size(),
                        " chunks, the store ", store_.chunks_in(MemorySpace::kDisk));
  if (disk_) {
    TIDAL_INTERNAL_ASSERT(store_.bytes_in(MemorySpace::kDisk) <= disk_->held_bytes() &&
                              disk_->held_bytes() <= disk_->budget_bytes(),
                          "disk: ", store_.bytes_in(MemorySpace::kDisk), " bytes of chunks in a file of ",
                          disk_->held_bytes(), ", budget ", disk_->budget_bytes());
  }
  TIDAL_INTERNAL_ASSERT(prefetched == outstanding_prefetches_, prefetched,
                        " chunks flagged prefetched, counted ", outstanding_prefetches_);
  TIDAL_INTERNAL_ASSERT(ahead == outstanding_ahead_, ahead, " chunks flagged sent ahead, counted ",
                        outstanding_ahead_);
  // (Those sent ahead are not counted against the depth: Note [Sent ahead of the cursor].)
  TIDAL_INTERNAL_ASSERT(options_.prefetch ? outstanding_prefetches_ - outstanding_ahead_ <= options_.prefetch_depth
                                           : outstanding_prefetches_ == 0,
                        outstanding_prefetches_ - outstanding_ahead_, " prefetches outstanding, depth ",
                        options_.prefetch_depth);
  if (!options_.use_trace) {
    TIDAL_INTERNAL_ASSERT(trace_.empty() && !following_ && recording_.empty(),
                          "trace kept with use_trace off");
  } else if (following_) {
    TIDAL_INTERNAL_ASSERT(!trace_.empty() && moment_ < static_cast<std::int64_t>(trace_.size()) &&
                              recording_.empty(),
                          "following a trace of ", trace_.size(), " at moment ", moment_);
  } else {
    TIDAL_INTERNAL_ASSERT(static_cast<std::int64_t>(recording_.size()) == moment_ + 1,
                          "recorded ", recording_.size(), " moments at moment ", moment_);
  }
}

}  // namespace tidal
