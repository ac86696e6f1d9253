#include "chunk/chunk_list.h"

namespace tidal {

std::size_t ChunkList::capacity_bytes() const {
  std::size_t bytes = 0;
  for (const Chunk& chunk : chunks_) bytes += chunk.capacity_bytes();
  return bytes;
}

}  // namespace tidal
