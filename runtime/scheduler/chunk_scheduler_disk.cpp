// The chunk scheduler's disk tier: making host room by writing a chunk to
// the file, reading one back, reserving the homes, removing the file. See
// Note [Chunks on NVMe: the tier] in disk_tier.h; the rest of the
// scheduler is in chunk_scheduler.cpp.
#include <algorithm>

#include "runtime/core/error.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal {

void ChunkScheduler::check_disk() const {
  if (!disk_ || !disk_->failed()) return;
  TIDAL_THROW(Error, "the NVMe tier failed earlier, so chunks on disk may have lost their data, and "
              "tidal refuses to go on with them: ", disk_->failure(),
              ". Tip: check the disk (dmesg), then restart from the last checkpoint in a new engine");
}

void ChunkScheduler::prefetch_unless_disk_failed() {
  try {
    prefetch();
  } catch (const Error&) {
    // Note [Chunks on NVMe: after a failure]: the access or release that ran
    // the prefetch is done; the next access raises the tier's failure.
    if (!disk_ || !disk_->failed()) throw;
  }
}

bool ChunkScheduler::write_to_disk_for(const RoomRequest& request) {
  if (!disk_ || request.space != MemorySpace::kHost) return false;
  // Note [Chunks on NVMe: after a failure]: nothing more goes to a failed tier.
  if (disk_->failed()) {
    if (request.prefetch) return false;
    check_disk();
  }
  candidates_.clear();
  for (ChunkId id : resident_[index_of(MemorySpace::kHost)]) {
    if (id == request.chunk || id == request.evicting_for) continue;
    if (!on_disk_list(id)) continue;
    if (store_.chunk(id).movable()) candidates_.push_back(id);
  }
  if (candidates_.empty()) return false;
  const ChunkId victim = pick(request, MemorySpace::kHost);
  // A prefetch writes out only what the access it serves would (Note [Prefetch]).
  if (request.prefetch && trace_.next_use(victim, moment_) <= request.needed_at) return false;
  if (store_.chunk(victim).all_free()) {
    drop_payload(victim);
    return true;
  }
  write_to_disk(victim);
  return true;
}

void ChunkScheduler::reserve_disk() {
  if (!disk_) return;
  std::size_t need = 0;
  std::size_t count = 0;
  for (ChunkId id = 0; id < store_.chunk_id_limit(); ++id) {
    if (!on_disk_list(id) || disk_->has_home(id)) continue;
    need += DiskTier::home_bytes(store_.chunk(id).capacity_bytes());
    ++count;
  }
  if (count == 0) return;
  const std::size_t held = disk_->held_bytes();
  const std::uint64_t free = DirectFile::free_bytes(disk_->dir());
  TIDAL_CHECK_WITH(OutOfMemoryError, held + need <= disk_->budget_bytes() && need <= free,
                   "the NVMe tier needs ", format_bytes(held + need), " for ", count,
                   " chunks of the lists it holds (file '", disk_->path(), "'), but the NVMe budget is ",
                   format_bytes(disk_->budget_bytes()), " and the file system has ", format_bytes(free),
                   " free. Tip: free disk space, choose another nvme_path, raise tidal.nvme_budget, "
                   "or keep the 16-bit parameters off disk (offload_param 'cpu')");
  for (ChunkId id = 0; id < store_.chunk_id_limit(); ++id) {
    if (!on_disk_list(id)) continue;
    disk_->ensure_home(id, store_.chunk(id).capacity_bytes(), store_.describe_chunk(id));
  }
}

void ChunkScheduler::close_disk() {
  if (!disk_) return;
  TIDAL_CHECK(store_.chunks_in(MemorySpace::kDisk) == 0, "chunk scheduler: close_disk with ",
              store_.chunks_in(MemorySpace::kDisk), " chunks on disk (", format_bytes(store_.bytes_in(MemorySpace::kDisk)),
              "); their data would be lost");
  pool_.trim_all(MemorySpace::kHost);  // blocks with a write in flight hold the file
  for (Slot& slot : slots_) slot.disk_current = false;  // no homes any more
  disk_.reset();
  budget_[index_of(MemorySpace::kDisk)] = 0;
  debug_validate();
}

void ChunkScheduler::write_to_disk(ChunkId id) {
  const std::size_t bytes = store_.chunk(id).capacity_bytes();
  // Note [Chunks on NVMe: clean chunks]: the home holds these bytes already.
  const bool skip = options_.disk_skip_clean_writes && disk_copy_current(id);
  std::shared_ptr<PendingIo> io;
  if (!skip) {
    disk_->ensure_home(id, bytes, store_.describe_chunk(id));  // may throw; nothing moved yet
    Block& host = *slots_[id].block;
    host.wait_on_host();  // a copy down into it lands first
    io = disk_->write(id, host.data, bytes);  // may throw; nothing moved yet
  }
  BlockPtr source = detach(id);
  if (io) source->io = std::move(io);
  auto token = std::make_unique<Block>();
  token->space = MemorySpace::kDisk;
  token->bytes = bytes;
  token->data = disk_->token(id);
  attach(id, std::move(token));
  slots_[id].disk_current = true;
  // Reused after the write (Block::io), or after the copy that filled it
  // (Note [Block fences]).
  pool_.give_back(std::move(source));
  if (skip) {
    ++stats_.disk_writes_skipped;
    stats_.bytes_disk_writes_skipped += bytes;
  } else {
    ++stats_.moves_host_to_disk;
    stats_.bytes_host_to_disk += bytes;
  }
  if (slots_[id].prefetched) clear_prefetched(id, /*wasted=*/true);
}

void ChunkScheduler::mark_written(TensorRef ref) {
  const ChunkId id = store_.chunk_of(ref);
  // A chunk on disk has its bytes only in its home, which nothing but the
  // tier writes; one without payload matches nothing already.
  if (store_.chunk(id).space() != MemorySpace::kDisk) slots_[id].written();
}

bool ChunkScheduler::disk_copy_current(ChunkId id) const {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  return disk_ && slots_[id].disk_current && disk_->has_home(id);
}

void ChunkScheduler::read_from_disk(ChunkId id, BlockPtr block) {
  TIDAL_INTERNAL_ASSERT(block->space == MemorySpace::kHost, "disk read into a ", to_string(block->space), " block");
  std::shared_ptr<PendingIo> io;
  try {
    check_disk();
    block->wait_on_host();  // whatever still reads the block (a copy, a write) ends first
    io = disk_->read(id, block->data, block->bytes);
  } catch (...) {
    pool_.give_back(std::move(block));  // the chunk stays on disk; the block is the pool's again
    throw;
  }
  const std::size_t bytes = block->bytes;
  BlockPtr token = detach(id);
  block->io = std::move(io);
  attach(id, std::move(block));
  slots_[id].disk_current = true;  // (a failed read refuses every later access)
  ++stats_.moves_disk_to_host;
  stats_.bytes_disk_to_host += bytes;
}

}  // namespace tidal
