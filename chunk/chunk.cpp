#include "chunk/chunk.h"

namespace tidal {

Chunk::Chunk(ChunkKind kind, ChunkIndex index, DType dtype, std::size_t capacity_elements,
             bool dedicated)
    : kind_(kind),
      index_(index),
      dtype_(dtype),
      capacity_elements_(capacity_elements),
      dedicated_(dedicated) {}

}  // namespace tidal
