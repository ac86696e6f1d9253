// The 16-bit chunks that attached parameters hold, and their bytes: the chunk
// room ModuleHooks asks the device for (DeviceRoom::make_room) is the bytes of
// the chunks in use plus those of the chunks a hook is about to attach.
//
// A chunk is in use while at least one parameter is attached to a slot in it;
// a parameter attached to a weight made from its master (Note [Weights while
// gradients wait] in hooks/module_hooks.h) holds no chunk and is not counted.
// The peak is kept across relayouts (the engine reports it).
//
// Thread safety: none; ModuleHooks' thread rules.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/chunk_store.h"
#include "runtime/core/error.h"

namespace tidal::hooks {

class ChunksInUse {
 public:
  // `store` is not owned; reset() replaces it.
  explicit ChunksInUse(const ChunkStore* store) : store_(store) {}

  // After a relayout: the new store, and no chunk in use.
  void reset(const ChunkStore* store) {
    store_ = store;
    count_.assign(store_->num_chunks(), 0);
    bytes_ = 0;
  }
  // No chunk in use (every parameter went back to its chunk).
  void clear() {
    std::fill(count_.begin(), count_.end(), 0);
    bytes_ = 0;
  }
  // One more (fewer) attached parameter in 16-bit chunk `chunk`.
  void add(ChunkIndex chunk) {
    if (chunk >= count_.size()) count_.resize(chunk + 1, 0);
    if (count_[chunk]++ == 0) {
      bytes_ += chunk_bytes(chunk);
      peak_bytes_ = std::max(peak_bytes_, bytes_);
    }
  }
  void remove(ChunkIndex chunk) {
    TIDAL_INTERNAL_ASSERT(chunk < count_.size() && count_[chunk] > 0, "ChunksInUse: chunk ", chunk,
                          " has no attached parameter");
    if (--count_[chunk] == 0) bytes_ -= chunk_bytes(chunk);
  }

  bool in_use(ChunkIndex chunk) const { return chunk < count_.size() && count_[chunk] > 0; }
  // The capacity of 16-bit chunk `chunk`.
  std::size_t chunk_bytes(ChunkIndex chunk) const {
    return store_->chunk(make_chunk_id(ChunkKind::kParam16, chunk)).capacity_bytes();
  }
  // The bytes of the chunks in use now, and the most at once.
  std::size_t bytes() const { return bytes_; }
  std::size_t peak_bytes() const { return peak_bytes_; }

 private:
  const ChunkStore* store_;
  std::vector<std::uint32_t> count_;  // attached parameters per 16-bit chunk
  std::size_t bytes_ = 0;
  std::size_t peak_bytes_ = 0;
};

}  // namespace tidal::hooks
