// One of the five chunk lists: the chunks of one kind (16-bit params, fp32
// master params, Adam m, Adam v, gradient sums), in layout order. See Note [One layout, five lists].
#pragma once

#include <cstddef>
#include <vector>

#include "chunk/chunk.h"
#include "chunk/chunk_id.h"
#include "chunk/dtype.h"

namespace tidal {

class ChunkList {
 public:
  ChunkList(ChunkKind kind, DType dtype) : kind_(kind), dtype_(dtype) {}

  ChunkKind kind() const { return kind_; }
  DType dtype() const { return dtype_; }
  std::size_t size() const { return chunks_.size(); }
  bool empty() const { return chunks_.empty(); }
  const Chunk& operator[](ChunkIndex index) const { return chunks_[index]; }
  const Chunk& back() const { return chunks_.back(); }
  const std::vector<Chunk>& chunks() const { return chunks_; }
  auto begin() const { return chunks_.begin(); }
  auto end() const { return chunks_.end(); }

  // Bytes of all chunk capacities in this list.
  std::size_t capacity_bytes() const;

 private:
  friend class ChunkStore;

  ChunkKind kind_;
  DType dtype_;
  std::vector<Chunk> chunks_;
};

}  // namespace tidal
