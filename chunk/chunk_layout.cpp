#include "chunk/chunk_layout.h"

#include <algorithm>
#include <limits>

#include "runtime/core/error.h"

namespace tidal {

ChunkLayout::ChunkLayout(std::size_t chunk_elements, std::size_t alignment_elements)
    : chunk_elements_(chunk_elements), alignment_(alignment_elements) {
  TIDAL_CHECK(alignment_elements > 0 && (alignment_elements & (alignment_elements - 1)) == 0,
              "chunk layout: the tensor alignment must be a power of two elements, got ",
              alignment_elements);
  TIDAL_CHECK(chunk_elements > 0 && chunk_elements % alignment_elements == 0,
              "chunk layout: the chunk size must be a positive multiple of the tensor alignment (",
              alignment_elements, " elements), got ", chunk_elements, " elements");
}

TensorPlacement ChunkLayout::append(std::size_t numel, std::uint8_t pool, bool with_previous) {
  TIDAL_CHECK(numel > 0, "chunk layout: tensor ", placements_.size(),
              " has 0 elements; only non-empty tensors are placed in chunks");
  TIDAL_CHECK(numel <= std::numeric_limits<std::size_t>::max() - alignment_,
              "chunk layout: tensor of ", numel, " elements is too large to place");
  const auto tensor = static_cast<TensorId>(placements_.size());
  TIDAL_CHECK(placements_.size() < kNoTensor, "chunk layout: more than ", kNoTensor - 1,
              " tensors");

  TensorPlacement placement;
  placement.numel = numel;
  auto open_chunk = [&](std::size_t capacity, bool dedicated) {
    ChunkExtent extent;
    extent.capacity = capacity;
    extent.dedicated = dedicated;
    extent.pool = pool;
    extents_.push_back(extent);
    total_capacity_ += capacity;
    if (dedicated) ++dedicated_chunks_;
    return static_cast<ChunkIndex>(extents_.size() - 1);
  };

  if (open_.size() <= pool) {
    std::array<ChunkIndex, kOpenChunks> none;
    none.fill(kNoChunk);
    open_.resize(std::size_t{pool} + 1, none);
    last_.resize(std::size_t{pool} + 1, kNoChunk);
  }
  std::array<ChunkIndex, kOpenChunks>& open = open_[pool];
  if (numel > chunk_elements_) {
    placement.chunk = open_chunk(round_up(numel, alignment_), /*dedicated=*/true);
    placement.offset = 0;  // the open chunks stay open (Note [One layout, five lists])
  } else {
    bool placed = false;
    std::array<ChunkIndex, kOpenChunks + 1> order;
    std::size_t tries = 0;
    // A small tensor (a bias, a LayerNorm) goes to the fullest open chunk where
    // it fits, not beside its weight: Note [One layout, five lists].
    const bool small = numel <= chunk_elements_ / kSmallTensorDivisor;
    if (with_previous && !small && std::find(open.begin(), open.end(), last_[pool]) != open.end()) {
      order[tries++] = last_[pool];
    }
    for (ChunkIndex c : open) order[tries++] = c;
    if (small) {
      std::stable_sort(order.begin(), order.begin() + tries, [&](ChunkIndex a, ChunkIndex b) {
        const std::size_t ua = a == kNoChunk ? 0 : extents_[a].used;
        const std::size_t ub = b == kNoChunk ? 0 : extents_[b].used;
        return ua > ub;
      });
    }
    for (std::size_t i = 0; i < tries; ++i) {
      const ChunkIndex c = order[i];
      if (c == kNoChunk) continue;
      const std::size_t offset = round_up(extents_[c].used, alignment_);
      if (offset + numel <= extents_[c].capacity) {
        placement.chunk = c;
        placement.offset = offset;
        placed = true;
        break;
      }
    }
    if (!placed) {
      placement.chunk = open_chunk(chunk_elements_, /*dedicated=*/false);
      placement.offset = 0;
      for (std::size_t i = 0; i + 1 < kOpenChunks; ++i) open[i] = open[i + 1];
      open[kOpenChunks - 1] = placement.chunk;
    }
  }
  last_[pool] = placement.chunk;
  ChunkExtent& extent = extents_[placement.chunk];
  extent.used = placement.offset + numel;
  extent.tensors.push_back(tensor);
  ++extent.num_tensors;
  total_numel_ += numel;
  placements_.push_back(placement);
  return placement;
}

}  // namespace tidal
