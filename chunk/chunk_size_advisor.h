// The chunk-size advisor: which chunk size in a search range wastes the
// least memory for a given model, and how much it wastes. PatrickStar and
// ColossalAI Gemini offer the same search; ours runs the store's own
// placement (ChunkLayout), so the figure it reports is the waste the store
// will really have.
#pragma once

#include <cstddef>
#include <span>

#include "chunk/dtype.h"

namespace tidal {

struct ChunkSizeSearch {
  // Candidate chunk sizes in elements: min, min + step, ..., up to max.
  // Each is rounded down to a multiple of alignment_elements (candidates
  // below one alignment unit are skipped).
  std::size_t min_elements = 0;
  std::size_t max_elements = 0;
  std::size_t step_elements = 0;
  std::size_t alignment_elements = 32;
};

struct ChunkSizeAdvice {
  std::size_t chunk_elements = 0;      // the choice
  std::size_t num_chunks = 0;          // per list, dedicated ones included
  std::size_t dedicated_chunks = 0;    // tensors larger than the choice
  std::size_t total_elements = 0;      // sum of tensor sizes
  std::size_t capacity_elements = 0;   // sum of chunk capacities (one list)
  std::size_t waste_elements = 0;      // capacity - total: padding and chunk tails
  double waste_fraction = 0;           // waste / capacity
  std::size_t candidates = 0;          // sizes evaluated

  // Wasted bytes over the four lists every trainable tensor uses: one 16-bit
  // and three fp32 elements per wasted element (the gradient-sum list of
  // gradient accumulation, when used, wastes 4 bytes more per element).
  std::size_t waste_bytes(DType param_dtype) const {
    return waste_elements * (element_size(param_dtype) + 3 * element_size(DType::kFloat32));
  }
  // Bytes of one 16-bit chunk of the chosen size: ChunkStoreOptions::chunk_bytes.
  std::size_t chunk_bytes(DType param_dtype) const {
    return chunk_elements * element_size(param_dtype);
  }
};

// Picks the candidate with the least waste among those that hold every
// tensor in a shared chunk (no dedicated chunks); if no candidate is that
// large, among all candidates. Ties go to the larger chunk: fewer, larger
// transfers run closer to link peak. ValueError on an empty tensor list, a
// zero-size tensor or an empty or malformed range.
ChunkSizeAdvice advise_chunk_size(std::span<const std::size_t> tensor_numels,
                                  const ChunkSizeSearch& search);

}  // namespace tidal
