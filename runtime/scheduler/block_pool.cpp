#include "runtime/scheduler/block_pool.h"

#include <chrono>
#include <cstdio>
#include <exception>
#include <utility>

#include "runtime/core/error.h"

namespace tidal {

BlockPool::BlockPool(std::shared_ptr<Device> device, bool pin_host)
    : device_(std::move(device)), pin_host_(pin_host) {}

// See Note [Destructors after a device error].
BlockPool::~BlockPool() {
  // (Its owner, whose state the predicate reads, is being destroyed: every
  // block goes anyway.)
  image_wanted_ = nullptr;
  bool reported = false;
  for (MemorySpace space : {MemorySpace::kHost, MemorySpace::kDevice}) {
    // trim_one takes the block out of the cache before it waits, so each
    // iteration makes progress even when the wait throws.
    for (;;) {
      try {
        if (!trim_one(space)) break;
      } catch (const std::exception& e) {
        if (!reported) {
          std::fprintf(stderr, "tidal: BlockPool teardown after a device error: %s\n", e.what());
          reported = true;
        }
      } catch (...) {
        if (!reported) {
          std::fprintf(stderr, "tidal: BlockPool teardown after an unknown device error\n");
          reported = true;
        }
      }
    }
  }
}

// Note [A cached block whose copy is done]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A block goes back to the cache as soon as its chunk leaves it, while the
// copy out of it may still be queued (its fence: Note [Block fences]); the
// next copy into it waits on that fence on the copy stream. The newest
// block is the one given back last, so its copy was queued last: where the
// link is the bottleneck and chunks go both ways at once (a chunk's
// gradients down and, once its update is done, its weights up: Note
// [Weights up as they are updated] in python/tidal/engine/overlap.py), each
// copy up into the newest device block waited for the last copy down queued,
// and the copies up ran after all the copies down instead of beside them.
// So the pick is the newest block whose copies are done (its pages are the
// warmest of those), else the oldest, whose copy was queued first and, each
// direction's copy engine running in order, lands first.
BlockPtr BlockPool::take_cached(MemorySpace space, std::size_t bytes, bool pinned) {
  auto& by_size = cache_[index_of(space)];
  auto it = by_size.find(bytes);
  if (it == by_size.end() || it->second.empty()) return nullptr;
  auto& blocks = it->second;
  // On the host, the blocks pinned or not as asked, when there is one.
  const auto as_asked = [&](std::size_t i) {
    return space != MemorySpace::kHost || blocks[i]->host.registered() == pinned;
  };
  bool any_as_asked = false;
  for (std::size_t i = 0; i < blocks.size() && !any_as_asked; ++i) any_as_asked = as_asked(i);
  const auto eligible = [&](std::size_t i) { return !any_as_asked || as_asked(i); };
  const auto done = [&](std::size_t i) {
    try {
      return blocks[i]->ready();
    } catch (...) {
      return false;  // (a device error: the copy into it reports it)
    }
  };
  // Among those whose copies are done, one holding no image someone still
  // wants first (Note [A clean chunk goes down without a copy] and Note
  // [Images someone still wants] in chunk_scheduler.cpp), pinned as asked
  // or not: a block pinned here once serves every step after, a wanted
  // image taken costs its fold's restore once.
  std::size_t pick = blocks.size();
  for (int tier = 0; tier < 3 && pick == blocks.size(); ++tier) {
    for (std::size_t i = blocks.size(); i-- > 0 && pick == blocks.size();) {
      const bool fits = tier == 2 ? eligible(i) : !holds_wanted_image(*blocks[i]) && (tier == 1 || eligible(i));
      if (fits && done(i)) pick = i;
    }
  }
  for (std::size_t i = 0; pick == blocks.size(); ++i) {
    if (eligible(i)) pick = i;
  }
  return take_at(space, it, pick);
}

BlockPtr BlockPool::take_image(std::size_t bytes, std::int64_t chunk, std::uint64_t version) {
  auto& by_size = cache_[index_of(MemorySpace::kHost)];
  auto it = by_size.find(bytes);
  if (it == by_size.end()) return nullptr;
  const auto& blocks = it->second;
  for (std::size_t i = blocks.size(); i-- > 0;) {
    if (blocks[i]->image_of == chunk && blocks[i]->image_version == version) {
      return take_at(MemorySpace::kHost, it, i);
    }
  }
  return nullptr;
}

BlockPtr BlockPool::take_at(MemorySpace space, std::map<std::size_t, std::vector<BlockPtr>>::iterator it,
                            std::size_t i) {
  auto& blocks = it->second;
  const std::size_t bytes = it->first;
  BlockPtr block = std::move(blocks[i]);
  blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
  if (blocks.empty()) cache_[index_of(space)].erase(it);
  cached_[index_of(space)] -= bytes;
  --cached_count_[index_of(space)];
  ++reuses_[index_of(space)];
  ++handed_by_size_[index_of(space)][bytes];
  block->image_of = -1;
  return block;
}

bool BlockPool::has_image(std::size_t bytes, std::int64_t chunk, std::uint64_t version) const {
  const auto& by_size = cache_[index_of(MemorySpace::kHost)];
  auto it = by_size.find(bytes);
  if (it == by_size.end()) return false;
  for (const BlockPtr& block : it->second) {
    if (block->image_of == chunk && block->image_version == version) return true;
  }
  return false;
}

bool BlockPool::has_cached_without_wanted_image(MemorySpace space, std::size_t bytes) const {
  const auto& by_size = cache_[index_of(space)];
  auto it = by_size.find(bytes);
  if (it == by_size.end()) return false;
  for (const BlockPtr& block : it->second) {
    if (!holds_wanted_image(*block)) return true;
  }
  return false;
}

bool BlockPool::has_cached(MemorySpace space, std::size_t bytes) const {
  const auto& by_size = cache_[index_of(space)];
  auto it = by_size.find(bytes);
  return it != by_size.end() && !it->second.empty();
}

BlockPtr BlockPool::allocate(MemorySpace space, std::size_t bytes) {
  TIDAL_INTERNAL_ASSERT(space == MemorySpace::kHost || space == MemorySpace::kDevice,
                        "block in space ", to_string(space));
  auto block = std::make_unique<Block>();
  block->space = space;
  block->bytes = bytes;
  if (space == MemorySpace::kHost) {
    block->host = HostBuffer(bytes);
    block->data = block->host.data();
  } else {
    block->device = device_->allocate(bytes);
    block->data = block->device.data();
  }
  block->fence = device_->create_event();
  held_[index_of(space)] += bytes;
  ++allocations_[index_of(space)];
  allocated_bytes_[index_of(space)] += bytes;
  ++handed_by_size_[index_of(space)][bytes];
  return block;
}

bool BlockPool::prepare_crossing(Block& host_block, bool pin) {
  TIDAL_INTERNAL_ASSERT(host_block.space == MemorySpace::kHost, "prepare_crossing of a block in ",
                        to_string(host_block.space));
  if (!pin || !pin_host_ || host_block.host.registered()) return false;
  host_block.host.pin(device_);
  return true;
}

void BlockPool::give_back(BlockPtr block) {
  TIDAL_INTERNAL_ASSERT(block != nullptr, "give_back of no block");
  const std::size_t space = index_of(block->space);
  cached_[space] += block->bytes;
  ++cached_count_[space];
  cache_[space][block->bytes].push_back(std::move(block));
}

bool BlockPool::trim_one_ready(MemorySpace space) {
  auto& by_size = cache_[index_of(space)];
  // A block whose fence cannot be queried (a device error) counts as not
  // done: trim_one's wait, once the block is out of the cache, reports the
  // error, so every call there makes progress (the destructor relies on it).
  // A pinned block goes after those not pinned (Note [Pinned at the second
  // crossing] in chunk_scheduler.h: pinning it again costs 8x its copy).
  // Among those, one holding no wanted image first.
  for (int pass = 0; pass < kTrimPasses; ++pass) {
    for (auto bucket = by_size.rbegin(); bucket != by_size.rend(); ++bucket) {
      auto& blocks = bucket->second;
      for (std::size_t i = blocks.size(); i-- > 0;) {
        if (!trimmed_in_pass(*blocks[i], pass)) continue;
        bool done = false;
        try {
          done = blocks[i]->ready();
        } catch (...) {
          done = false;
        }
        if (!done) continue;
        BlockPtr block = std::move(blocks[i]);
        blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
        if (blocks.empty()) by_size.erase(std::next(bucket).base());
        forget_cached(*block);
        return true;
      }
    }
  }
  return false;
}

bool BlockPool::trim_one(MemorySpace space) {
  auto& by_size = cache_[index_of(space)];
  if (by_size.empty()) return false;
  // A block whose copies are done goes without a wait; only when every
  // cached block is still being copied does the caller wait for one: the
  // oldest of the largest size, whose copy was queued first.
  if (trim_one_ready(space)) return true;
  auto largest = std::prev(by_size.end());
  BlockPtr block = std::move(largest->second.front());
  largest->second.erase(largest->second.begin());
  if (largest->second.empty()) by_size.erase(largest);
  forget_cached(*block);
  // See Note [Block fences]: memory is freed only once no work touches it.
  const auto start = std::chrono::steady_clock::now();
  if (block->wait_on_host()) {
    ++trim_waits_;
    trim_wait_seconds_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  }
  return true;
}

void BlockPool::forget_cached(const Block& block) {
  const std::size_t s = index_of(block.space);
  cached_[s] -= block.bytes;
  --cached_count_[s];
  held_[s] -= block.bytes;
}

std::size_t BlockPool::trim_ready(MemorySpace space, std::size_t keep_blocks,
                                  const std::map<std::size_t, std::size_t>& keep_by_size) {
  const std::size_t s = index_of(space);
  std::size_t freed = 0;
  auto& by_size = cache_[s];
  // Blocks not pinned go first, and of each, those holding no wanted image
  // (as in trim_one).
  for (int pass = 0; pass < kTrimPasses; ++pass) {
    for (auto bucket = by_size.rbegin(); bucket != by_size.rend() && cached_count_[s] > keep_blocks;) {
      auto& blocks = bucket->second;
      const auto kept = keep_by_size.find(bucket->first);
      const std::size_t keep_here = kept == keep_by_size.end() ? 0 : kept->second;
      for (std::size_t i = blocks.size(); i-- > 0 && cached_count_[s] > keep_blocks && blocks.size() > keep_here;) {
        if (!trimmed_in_pass(*blocks[i], pass) || !blocks[i]->ready()) continue;
        BlockPtr block = std::move(blocks[i]);
        blocks.erase(blocks.begin() + static_cast<std::ptrdiff_t>(i));
        forget_cached(*block);
        ++freed;
      }
      if (blocks.empty()) {
        bucket = decltype(bucket)(by_size.erase(std::next(bucket).base()));
      } else {
        ++bucket;
      }
    }
  }
  return freed;
}

void BlockPool::trim_all(MemorySpace space) {
  while (trim_one(space)) {
  }
}

void BlockPool::validate() const {
  for (std::size_t s = 0; s < kNumMemorySpaces; ++s) {
    std::size_t bytes = 0;
    std::size_t count = 0;
    for (const auto& [size, blocks] : cache_[s]) {
      count += blocks.size();
      TIDAL_INTERNAL_ASSERT(!blocks.empty(), "empty cache bucket of ", size, " bytes");
      for (const BlockPtr& block : blocks) {
        TIDAL_INTERNAL_ASSERT(block->bytes == size && index_of(block->space) == s,
                              "cached block filed under the wrong size or space");
        bytes += block->bytes;
      }
    }
    TIDAL_INTERNAL_ASSERT(bytes == cached_[s] && count == cached_count_[s], "cache holds ", bytes,
                          " bytes in ", count, " blocks, recorded ", cached_[s], " in ",
                          cached_count_[s]);
    TIDAL_INTERNAL_ASSERT(cached_[s] <= held_[s], "cached ", cached_[s], " > held ", held_[s]);
  }
}

}  // namespace tidal
