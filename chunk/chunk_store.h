// The chunk store: tensors registered in first-use order, placed once by a
// ChunkLayout and held by five chunk lists that share it; the state of every
// tensor slot; where each chunk's payload is. See Note [One layout, five lists]
// and Note [Chunk state machine].
//
// The store decides nothing about memory: it records what the owner of chunk
// memory (the chunk scheduler) did and refuses what would break an
// invariant, e.g. moving a chunk that has a COMPUTE slot or dropping the
// payload of one that still holds data. validate() checks every invariant;
// under TIDAL_DEBUG_FULL it runs after every mutation.
//
// Thread safety: none. One thread drives a store (and its scheduler).
#pragma once

#include <array>
#include <cstddef>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "chunk/chunk.h"
#include "chunk/chunk_id.h"
#include "chunk/chunk_layout.h"
#include "chunk/chunk_list.h"
#include "chunk/dtype.h"
#include "chunk/memory_space.h"
#include "chunk/tensor_state.h"

namespace tidal {

inline constexpr std::size_t kDefaultChunkBytes = std::size_t{64} << 20;

struct ChunkStoreOptions {
  // Capacity of a chunk of the 16-bit list. Chunks of the fp32 lists hold the
  // same number of elements in twice the bytes (Note [One layout, five lists]);
  // with a float32 parameter list, in the same bytes.
  std::size_t chunk_bytes = kDefaultChunkBytes;
  // fp16 or bf16: the dtype of the 16-bit parameter list. float32 is the
  // engine's exactness mode (compute in fp32; the list is "16-bit" by role).
  DType param_dtype = DType::kFloat16;
  // float32 or bfloat16: the dtype of the Adam moment lists (momentum and
  // variance; Note [16-bit optimizer state] in cpu_adam/adam.h). The fp32
  // master and gradient-sum lists are always float32.
  DType state_dtype = DType::kFloat32;
  // Every tensor starts at a multiple of this many elements (64 bytes of
  // fp16, a cache line, so SIMD code and device kernels see aligned data).
  std::size_t alignment_elements = 32;
};

// Receives warnings meant for the user (the Python layer routes them to
// warnings.warn). Without a handler the store keeps them for take_warnings().
using WarningHandler = std::function<void(const std::string& message)>;

class ChunkStore {
 public:
  explicit ChunkStore(const ChunkStoreOptions& options = {});
  ChunkStore(ChunkStore&&) noexcept = default;
  ChunkStore& operator=(ChunkStore&&) noexcept = default;
  ChunkStore(const ChunkStore&) = delete;
  ChunkStore& operator=(const ChunkStore&) = delete;

  const ChunkStoreOptions& options() const { return options_; }
  // Elements per (regular) chunk in every list.
  std::size_t chunk_elements() const { return layout_.chunk_elements(); }

  // ---- registration -------------------------------------------------------
  // Appends a tensor of `numel` (> 0) elements after all registered ones; its
  // slots start FREE in every list. `name` must be non-empty and unique. A
  // tensor larger than the chunk size gets a dedicated chunk and a warning.
  // Tensors of different pools never share a chunk (Note [Pools keep frozen
  // tensors apart] in chunk_layout.h).
  // with_previous: the next tensor of the module the previous one belongs to
  // (ChunkLayout::append).
  TensorId register_tensor(std::string name, std::size_t numel, std::uint8_t pool = 0,
                           bool with_previous = false);

  std::size_t num_tensors() const { return names_.size(); }
  // Chunks per list (every list has the same number).
  std::size_t num_chunks() const { return layout_.num_chunks(); }
  const ChunkLayout& layout() const { return layout_; }
  const std::string& tensor_name(TensorId tensor) const;
  std::size_t tensor_numel(TensorId tensor) const;
  const TensorPlacement& placement(TensorId tensor) const;
  // The tensors chunk `chunk` holds (in every list), in offset order.
  const std::vector<TensorId>& tensors_of(ChunkIndex chunk) const {
    return layout_.extent(chunk).tensors;
  }
  std::optional<TensorId> find_tensor(std::string_view name) const;

  // ---- chunks -------------------------------------------------------------
  const ChunkList& list(ChunkKind kind) const { return lists_[index_of(kind)]; }
  const Chunk& chunk(ChunkId id) const;
  ChunkId chunk_of(TensorRef ref) const;  // `ref` must be valid (not checked)
  // The tensors of chunk `id` whose slot is in `state`.
  std::vector<TensorId> tensors_in_state(ChunkId id, TensorState state) const;
  // For messages: "chunk 12 (param16 #3, 64.00 MiB (67108864 bytes), tensors
  // 'h.0.w' .. 'h.0.b' (5), on device)".
  std::string describe_chunk(ChunkId id) const;
  // For messages: "'a', 'b', 'c'" (at most 8 names, then "and N more").
  std::string describe_tensors(const std::vector<TensorId>& tensors) const;
  // Total chunks over the five lists, i.e. one past the largest ChunkId.
  std::size_t chunk_id_limit() const { return num_chunks() * kNumChunkKinds; }

  // ---- states -------------------------------------------------------------
  TensorState state(TensorRef ref) const;
  // Throws ValueError naming the tensor and both states unless the move is
  // in the table of Note [Chunk state machine]. Changes nothing.
  void check_transition(TensorRef ref, TensorState to) const;
  // check_transition, then the move; keeps the chunk's state counts.
  void set_state(TensorRef ref, TensorState to);

  // ---- payloads -----------------------------------------------------------
  // Records that chunk `id` now lives at `payload` in `space` (payload null
  // exactly when space is kNone). Refuses (ValueError) to move a chunk with a
  // COMPUTE slot and to drop the payload of a chunk that is not all FREE.
  void set_payload(ChunkId id, void* payload, MemorySpace space);
  // The first element of the tensor's slot, or null when its chunk has no
  // payload in memory (none, or on disk).
  void* tensor_data(TensorRef ref) const;
  std::size_t tensor_bytes(TensorRef ref) const;
  // Bytes and number of chunks whose payload is in `space`.
  std::size_t bytes_in(MemorySpace space) const { return bytes_in_[index_of(space)]; }
  std::size_t chunks_in(MemorySpace space) const { return chunks_in_[index_of(space)]; }

  // ---- warnings -----------------------------------------------------------
  void set_warning_handler(WarningHandler handler) { warning_handler_ = std::move(handler); }
  // Warnings issued while no handler was set, oldest first; clears them.
  std::vector<std::string> take_warnings();

  // ---- checks -------------------------------------------------------------
  // Checks every invariant; InternalError naming the first broken one:
  // * layout: tensors in registration order, aligned, inside their chunk,
  //   not overlapping; dedicated chunks hold one tensor sized to it;
  // * the five lists: same chunk count, same capacity in elements and the
  //   same tensors in chunk i, capacity bytes = elements * element size;
  // * states: every chunk's counts equal a recount of its slots;
  // * payloads: a chunk has a payload exactly when its space is not kNone,
  //   no slot holds data (or is COMPUTE) in a chunk without a payload, the
  //   bytes and chunk counts per memory space add up.
  void validate() const;

 private:
  Chunk& mutable_chunk(ChunkId id);
  void check_ref(TensorRef ref, const char* what) const;
  [[noreturn]] void throw_bad_ref(TensorRef ref, const char* what) const;
  [[noreturn]] void throw_bad_chunk(ChunkId id) const;
  void warn(std::string message);
  void debug_validate() const;

  ChunkStoreOptions options_;
  ChunkLayout layout_;
  std::array<ChunkList, kNumChunkKinds> lists_;
  std::vector<std::string> names_;
  std::unordered_map<std::string, TensorId> ids_by_name_;
  std::array<std::vector<TensorState>, kNumChunkKinds> states_;
  std::array<std::size_t, kNumMemorySpaces> bytes_in_{};
  std::array<std::size_t, kNumMemorySpaces> chunks_in_{};
  WarningHandler warning_handler_;
  std::vector<std::string> pending_warnings_;
};

// The accessors on the access/release path are inline; their error
// branches are out of line.

inline void ChunkStore::check_ref(TensorRef ref, const char* what) const {
  if (index_of(ref.kind) >= kNumChunkKinds || ref.tensor >= names_.size()) [[unlikely]] {
    throw_bad_ref(ref, what);
  }
}

inline const Chunk& ChunkStore::chunk(ChunkId id) const {
  if (id >= chunk_id_limit()) [[unlikely]] throw_bad_chunk(id);
  return lists_[index_of(kind_of(id))].chunks_[index_of_chunk(id)];
}

inline ChunkId ChunkStore::chunk_of(TensorRef ref) const {
  return make_chunk_id(ref.kind, layout_.placement(ref.tensor).chunk);
}

inline TensorState ChunkStore::state(TensorRef ref) const {
  check_ref(ref, "chunk store: state");
  return states_[index_of(ref.kind)][ref.tensor];
}

inline void* ChunkStore::tensor_data(TensorRef ref) const {
  check_ref(ref, "chunk store: tensor_data");
  const TensorPlacement& at = layout_.placement(ref.tensor);
  const Chunk& c = lists_[index_of(ref.kind)].chunks_[at.chunk];
  if (!c.has_payload() || c.space() == MemorySpace::kDisk) return nullptr;
  return static_cast<char*>(c.payload()) + at.offset * element_size(c.dtype());
}

}  // namespace tidal
