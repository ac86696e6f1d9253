// A chunk: a fixed-capacity block of one chunk list that holds a contiguous
// run of tensors and lives in one memory space at a time.
//
// Ownership: a Chunk describes memory, it does not own it. Whoever moves
// chunks (the chunk scheduler, runtime/scheduler/) owns the payload buffers
// and tells the store where a payload is with ChunkStore::set_payload. That
// keeps this library free of the device layer and of libtorch.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>

#include "chunk/chunk_id.h"
#include "chunk/dtype.h"
#include "chunk/memory_space.h"
#include "chunk/tensor_state.h"

namespace tidal {

class Chunk {
 public:
  Chunk(ChunkKind kind, ChunkIndex index, DType dtype, std::size_t capacity_elements,
        bool dedicated);

  ChunkId id() const { return make_chunk_id(kind_, index_); }
  ChunkKind kind() const { return kind_; }
  ChunkIndex index() const { return index_; }
  DType dtype() const { return dtype_; }

  std::size_t capacity_elements() const { return capacity_elements_; }
  std::size_t capacity_bytes() const { return capacity_elements_ * element_size(dtype_); }
  // Elements up to the end of the last tensor (tail after it is unused).
  std::size_t used_elements() const { return used_elements_; }
  // Holds a single tensor larger than the configured chunk size.
  bool dedicated() const { return dedicated_; }

  // How many tensors it holds; which: ChunkStore::tensors_of (the layout's).
  std::size_t num_tensors() const { return num_tensors_; }

  MemorySpace space() const { return space_; }
  void* payload() const { return payload_; }
  bool has_payload() const { return payload_ != nullptr; }

  // Slots of this chunk in `state`.
  std::size_t count(TensorState state) const { return state_counts_[index_of(state)]; }
  // NB: a chunk is movable only when no tensor in it is COMPUTE.
  bool movable() const { return count(TensorState::kCompute) == 0; }
  // A chunk whose tensors are all FREE holds no data and may drop its payload.
  bool all_free() const { return count(TensorState::kFree) == num_tensors_; }

 private:
  friend class ChunkStore;

  ChunkKind kind_;
  ChunkIndex index_;
  DType dtype_;
  std::size_t capacity_elements_;
  std::size_t used_elements_ = 0;
  bool dedicated_;
  std::size_t num_tensors_ = 0;
  MemorySpace space_ = MemorySpace::kNone;
  void* payload_ = nullptr;
  std::array<std::uint32_t, kNumTensorStates> state_counts_{};
};

}  // namespace tidal
