#include "chunk/chunk_layout.h"

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

TensorPlacement ChunkLayout::append(std::size_t numel, std::uint8_t pool) {
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
    extent.first_tensor = tensor;
    extent.dedicated = dedicated;
    extent.pool = pool;
    extents_.push_back(extent);
    total_capacity_ += capacity;
    if (dedicated) ++dedicated_chunks_;
    return static_cast<ChunkIndex>(extents_.size() - 1);
  };

  if (open_.size() <= pool) open_.resize(std::size_t{pool} + 1, kNoChunk);
  if (numel > chunk_elements_) {
    placement.chunk = open_chunk(round_up(numel, alignment_), /*dedicated=*/true);
    placement.offset = 0;
    open_[pool] = kNoChunk;  // the pool's next tensor opens a new chunk: first-use order
  } else {
    bool placed = false;
    if (open_[pool] != kNoChunk) {
      const ChunkExtent& open = extents_[open_[pool]];
      const std::size_t offset = round_up(open.used, alignment_);
      if (offset + numel <= open.capacity) {
        placement.chunk = open_[pool];
        placement.offset = offset;
        placed = true;
      }
    }
    if (!placed) {
      placement.chunk = open_chunk(chunk_elements_, /*dedicated=*/false);
      placement.offset = 0;
      open_[pool] = placement.chunk;
    }
  }
  ChunkExtent& extent = extents_[placement.chunk];
  extent.used = placement.offset + numel;
  ++extent.num_tensors;
  total_numel_ += numel;
  placements_.push_back(placement);
  return placement;
}

}  // namespace tidal
