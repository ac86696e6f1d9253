#include "runtime/memory/caching_allocator_model.h"

#include <algorithm>
#include <vector>

#include "runtime/core/error.h"

namespace tidal {

namespace torch_cache {

std::size_t round_size(std::size_t bytes) {
  if (bytes < kMinBlockSize) return kMinBlockSize;
  return kMinBlockSize * ((bytes + kMinBlockSize - 1) / kMinBlockSize);
}

std::size_t segment_size(std::size_t rounded) {
  if (rounded <= kSmallSize) return kSmallBuffer;
  if (rounded < kMinLargeAlloc) return kLargeBuffer;
  return kRoundLarge * ((rounded + kRoundLarge - 1) / kRoundLarge);
}

}  // namespace torch_cache

std::size_t room_to_make(const AllocatorUse& use, std::size_t cap, std::size_t largest_request) {
  const std::size_t want = torch_cache::segment_size(torch_cache::round_size(largest_request));
  const std::size_t stuck = use.active + use.inactive_split;
  const std::size_t headroom = cap > stuck ? cap - stuck : 0;
  return want > headroom ? want - headroom : 0;
}

// A block of a segment: handed out (allocated) or free in its pool. The
// blocks of one segment form a list by address (prev/next), as torch's do.
struct CachingAllocatorModel::Block {
  std::uintptr_t address = 0;
  std::size_t size = 0;
  bool small = false;
  bool allocated = false;
  std::uint64_t tag = 0;
  Block* prev = nullptr;
  Block* next = nullptr;
  bool split() const { return prev != nullptr || next != nullptr; }
};

bool CachingAllocatorModel::BySize::operator()(const Block* a, const Block* b) const {
  if (a->size != b->size) return a->size < b->size;
  return a->address < b->address;
}

CachingAllocatorModel::CachingAllocatorModel() = default;

CachingAllocatorModel::~CachingAllocatorModel() {
  for (Block* head : heads_) {
    Block* b = head;
    while (b != nullptr) {
      Block* next = b->next;
      delete b;
      b = next;
    }
  }
}

CachingAllocatorModel::Block* CachingAllocatorModel::take_free(bool small, std::size_t size) {
  Pool& pool = pool_for(small);
  Block key;
  key.size = size;
  key.address = 0;
  const auto it = pool.lower_bound(&key);
  if (it == pool.end()) return nullptr;
  Block* b = *it;
  pool.erase(it);
  return b;
}

CachingAllocatorModel::Block* CachingAllocatorModel::new_segment(bool small, std::size_t bytes) {
  auto* b = new Block;
  b->address = next_address_;
  // Segments never touch, so blocks of two segments never look adjacent.
  next_address_ += bytes + torch_cache::kRoundLarge;
  b->size = bytes;
  b->small = small;
  heads_.insert(b);
  reserved_ += bytes;
  ++segments_;
  return b;
}

void CachingAllocatorModel::release_segment(Block* block) {
  TIDAL_INTERNAL_ASSERT(!block->split() && !block->allocated, "releasing a segment in use");
  pool_for(block->small).erase(block);
  heads_.erase(block);
  reserved_ -= block->size;
  --segments_;
  delete block;
}

void CachingAllocatorModel::note_peaks() {
  peak_reserved_ = std::max(peak_reserved_, reserved_);
  peak_allocated_ = std::max(peak_allocated_, allocated_);
}

CachingAllocatorModel::Handle CachingAllocatorModel::allocate(std::size_t bytes,
                                                            const std::function<std::size_t()>& cap,
                                                            const OnMiss& on_miss, std::uint64_t tag) {
  const std::size_t size = torch_cache::round_size(bytes);
  const bool small = size <= torch_cache::kSmallSize;
  const std::size_t segment = torch_cache::segment_size(size);
  Block* block = take_free(small, size);
  if (block == nullptr && on_miss && on_miss()) block = take_free(small, size);
  if (block == nullptr) {
    const std::size_t limit = cap();
    if (reserved_ + segment <= limit) {
      block = new_segment(small, segment);
    } else {
      release_cached();
      if (reserved_ + segment <= limit) block = new_segment(small, segment);
    }
    if (block == nullptr) {
      last_failure_ = detail::str_cat("a request of ", bytes, " bytes needs a new segment of ", segment,
                                      " bytes; ", reserved_, " are reserved (", allocated_,
                                      " allocated, ", reserved_ - allocated_,
                                      " reserved but unallocated) of a cap of ", limit);
      note_peaks();
      return 0;
    }
  }
  // Taking a free piece of a split segment leaves the inactive split bytes.
  if (block->split()) inactive_split_ -= block->size;
  const std::size_t remaining = block->size - size;
  const bool split_rest = small ? remaining >= torch_cache::kMinBlockSize : remaining > torch_cache::kSmallSize;
  if (split_rest) {
    auto* rest = new Block;
    rest->address = block->address + size;
    rest->size = remaining;
    rest->small = small;
    rest->prev = block;
    rest->next = block->next;
    if (rest->next != nullptr) rest->next->prev = rest;
    block->next = rest;
    block->size = size;
    pool_for(small).insert(rest);
    inactive_split_ += rest->size;
  }
  block->allocated = true;
  block->tag = tag;
  allocated_ += block->size;
  ++live_blocks_;
  note_peaks();
  return reinterpret_cast<Handle>(block);
}

void CachingAllocatorModel::free(Handle handle) {
  auto* block = reinterpret_cast<Block*>(handle);
  TIDAL_INTERNAL_ASSERT(block != nullptr && block->allocated, "free of a block not handed out");
  block->allocated = false;
  allocated_ -= block->size;
  --live_blocks_;
  Pool& pool = pool_for(block->small);
  // Merge with free neighbours of the same segment, as torch's free_block.
  for (Block* other : {block->prev, block->next}) {
    if (other == nullptr || other->allocated) continue;
    pool.erase(other);
    inactive_split_ -= other->size;
    if (other == block->prev) {
      block->address = other->address;
      block->prev = other->prev;
      if (block->prev != nullptr) block->prev->next = block;
      if (heads_.erase(other) > 0) heads_.insert(block);
    } else {
      block->next = other->next;
      if (block->next != nullptr) block->next->prev = block;
    }
    block->size += other->size;
    delete other;
  }
  pool.insert(block);
  if (block->split()) inactive_split_ += block->size;
}

std::size_t CachingAllocatorModel::release_cached() {
  std::size_t freed = 0;
  for (Pool* pool : {&small_, &large_}) {
    std::vector<Block*> whole;
    for (Block* b : *pool) {
      if (!b->split()) whole.push_back(b);
    }
    for (Block* b : whole) {
      freed += b->size;
      release_segment(b);
    }
  }
  return freed;
}

AllocatorUse CachingAllocatorModel::use() const {
  AllocatorUse u;
  u.reserved = reserved_;
  u.allocated = allocated_;
  u.active = allocated_;  // (one stream: nothing waits on another's events)
  u.inactive_split = inactive_split_;
  return u;
}

std::size_t CachingAllocatorModel::reserved_holding_tags_up_to(std::uint64_t tag) const {
  std::size_t bytes = 0;
  for (const Block* head : heads_) {
    std::size_t segment = 0;
    bool held = false;
    for (const Block* b = head; b != nullptr; b = b->next) {
      segment += b->size;
      held = held || (b->allocated && b->tag != 0 && b->tag <= tag);
    }
    if (held) bytes += segment;
  }
  return bytes;
}

std::size_t CachingAllocatorModel::block_size(Handle handle) const {
  const auto* block = reinterpret_cast<const Block*>(handle);
  TIDAL_INTERNAL_ASSERT(block != nullptr && block->allocated, "size of a block not handed out");
  return block->size;
}

void CachingAllocatorModel::validate() const {
  std::size_t reserved = 0, allocated = 0, split_free = 0, live = 0, free_blocks = 0;
  for (const Block* head : heads_) {
    TIDAL_INTERNAL_ASSERT(head->prev == nullptr, "a segment's head has a predecessor");
    for (const Block* b = head; b != nullptr; b = b->next) {
      reserved += b->size;
      if (b->next != nullptr) {
        TIDAL_INTERNAL_ASSERT(b->next->prev == b && b->next->address == b->address + b->size,
                              "segment list broken at ", b->address);
        TIDAL_INTERNAL_ASSERT(b->allocated || b->next->allocated, "two free neighbours not merged");
      }
      if (b->allocated) {
        allocated += b->size;
        ++live;
      } else {
        ++free_blocks;
        TIDAL_INTERNAL_ASSERT(pool_for_const(b->small).count(const_cast<Block*>(b)) == 1,
                              "free block missing from its pool");
        if (b->split()) split_free += b->size;
      }
    }
  }
  TIDAL_INTERNAL_ASSERT(reserved == reserved_, "reserved ", reserved_, " but segments hold ", reserved);
  TIDAL_INTERNAL_ASSERT(allocated == allocated_, "allocated ", allocated_, " but blocks hold ", allocated);
  TIDAL_INTERNAL_ASSERT(split_free == inactive_split_, "inactive split ", inactive_split_, " but ",
                        split_free);
  TIDAL_INTERNAL_ASSERT(live == live_blocks_ && heads_.size() == segments_, "counts disagree");
  TIDAL_INTERNAL_ASSERT(free_blocks == small_.size() + large_.size(), "pools hold blocks not free");
}

}  // namespace tidal
