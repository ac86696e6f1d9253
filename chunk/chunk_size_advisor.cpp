#include "chunk/chunk_size_advisor.h"

#include <algorithm>

#include "chunk/chunk_layout.h"
#include "runtime/core/error.h"

namespace tidal {

ChunkSizeAdvice advise_chunk_size(std::span<const std::size_t> tensor_numels,
                                  const ChunkSizeSearch& search) {
  TIDAL_CHECK(!tensor_numels.empty(), "chunk-size advisor: expected at least one tensor size");
  const std::size_t align = search.alignment_elements;
  TIDAL_CHECK(align > 0 && (align & (align - 1)) == 0,
              "chunk-size advisor: the alignment must be a power of two elements, got ", align);
  TIDAL_CHECK(search.step_elements > 0, "chunk-size advisor: expected a positive step, got 0");
  TIDAL_CHECK(search.min_elements <= search.max_elements, "chunk-size advisor: empty range [",
              search.min_elements, ", ", search.max_elements, "] elements");
  for (std::size_t i = 0; i < tensor_numels.size(); ++i) {
    TIDAL_CHECK(tensor_numels[i] > 0, "chunk-size advisor: tensor ", i, " has 0 elements");
  }

  ChunkSizeAdvice best;
  bool best_shared = false;  // best holds every tensor in shared chunks
  std::size_t previous = 0;
  for (std::size_t size = search.min_elements; size <= search.max_elements;) {
    const std::size_t candidate = size / align * align;
    if (candidate > 0 && candidate != previous) {
      previous = candidate;
      ChunkLayout layout(candidate, align);
      for (std::size_t numel : tensor_numels) layout.append(numel);
      const bool shared = layout.dedicated_chunks() == 0;
      const std::size_t waste = layout.waste_elements();
      ++best.candidates;
      // Prefer no dedicated chunks, then least waste, then the larger size
      // (candidates ascend, so >= lets a later equal-waste one win).
      const bool better = best.chunk_elements == 0 || (shared && !best_shared) ||
                          (shared == best_shared && waste <= best.waste_elements);
      if (better) {
        const std::size_t candidates = best.candidates;
        best = ChunkSizeAdvice{};
        best.candidates = candidates;
        best.chunk_elements = candidate;
        best.num_chunks = layout.num_chunks();
        best.dedicated_chunks = layout.dedicated_chunks();
        best.total_elements = layout.total_numel();
        best.capacity_elements = layout.total_capacity();
        best.waste_elements = waste;
        best.waste_fraction =
            static_cast<double>(waste) / static_cast<double>(layout.total_capacity());
        best_shared = shared;
      }
    }
    if (search.max_elements - size < search.step_elements) break;
    size += search.step_elements;
  }
  TIDAL_CHECK(best.chunk_elements > 0, "chunk-size advisor: no candidate in [",
              search.min_elements, ", ", search.max_elements, "] elements is at least one alignment unit (",
              align, " elements)");
  return best;
}

}  // namespace tidal
