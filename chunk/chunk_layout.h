// Where each tensor sits: chunk index and offset, shared by the five chunk
// lists. See Note [One layout, five lists].
//
// Note [One layout, five lists]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The store keeps five chunk lists: 16-bit parameters (the gradient is
// written into the same slot after backward), fp32 master parameters, Adam m,
// Adam v, and fp32 gradient sums (used only with gradient accumulation: its
// chunks get a payload when a sum is first written and give it back at the
// step, so without accumulation the list costs nothing). One ChunkLayout
// places every tensor once, in elements, and all five lists use it: tensor i
// sits in chunk c at element offset o in every list. So the optimizer finds a tensor's master copy, m and v by index
// arithmetic, and chunk c of every list holds the same tensors. A list's
// chunk holds the same number of elements as in every other list; only the
// bytes differ (2 per element in the 16-bit list, 4 in the fp32 lists).
//
// Placement (append in registration order, which is first-use order):
// * Every tensor belongs to a pool (Note [Pools keep frozen tensors apart]);
//   each pool has at most kOpenChunks open chunks, the last regular chunks
//   opened for it.
// * The next tensor goes into the first (oldest) of its pool's open chunks
//   where it fits, at the first offset that is a multiple of
//   alignment_elements; a tensor registered "with the previous" (the next
//   tensor of the same module) tries the previous tensor's chunk first, so a
//   module's tensors share a chunk where they can.
// * Otherwise a new chunk of chunk_elements opens for its pool (the oldest
//   open one closes) and the tensor sits at 0.
// Two open chunks, not one: a tensor that does not fit the last chunk's tail
// opens the next chunk, and the next module's tensors may still fill that
// tail. With one open chunk, a GPT whose weights are an eighth of a chunk
// left 8% of every list as padding (tails no later tensor could use); with
// two, 2%.
// * A small tensor (at most 1/1024 of a chunk: biases, LayerNorms) goes to
//   the fullest open chunk where it fits, not beside its module's weight.
//   Beside it, the bias of a weight of half a chunk left less than half a
//   chunk, so the next half-chunk weight never paired with it: gpt-1.3b
//   (hidden 2048, MLP weights of 32 MiB in bf16) padded 33% at 64 MiB chunks,
//   10% now. The bias still sits in one of the two chunks opened last, which
//   are used around the same time.
// * A tensor larger than chunk_elements gets a dedicated chunk sized to it
//   (rounded up to the alignment). Nothing else joins a dedicated chunk, and
//   the pool's open chunks stay open across it: the tensors after it fill
//   their tails. A GPT whose qkv and MLP weights are larger than a chunk has
//   only its small tensors (the attention projection, LayerNorms, biases)
//   between them; when each dedicated chunk closed the open ones, every block
//   opened two regular chunks for half a chunk of tensors, and the padding was
//   41% of gpt-6.7b's states at 64 MiB chunks, 23% of gpt-13b's and 22% of
//   gpt-20b's (3%, 2% and 0.1% now, with the small tensors' rule above;
//   benchmarks/results/chunk_padding-cpu-2c.json, the old layout's in
//   history/). So chunk index order is first-use
//   order up to the open chunks' tails, as it is without dedicated chunks.
//
// Note [Pools keep frozen tensors apart]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A frozen parameter needs only its 16-bit slot, a trainable one all four
// slots. Chunks are allocated whole in every list a tensor of theirs uses,
// so one trainable tensor in a chunk of frozen ones costs the chunk's fp32
// master, momentum and variance in full: a LoRA model, whose small adapters
// sit between the frozen weights of every layer, would pay 14 bytes per
// parameter of its base. The engine puts trainable and frozen tensors in
// different pools, so they never share a chunk: a frozen chunk costs 2 bytes
// per element and nothing in the other lists.
// The chunk-size advisor runs this same code over candidate sizes, so its
// waste figure is the waste the store will have.
#pragma once

#include <cstddef>
#include <array>
#include <cstdint>
#include <vector>

#include "chunk/chunk_id.h"

namespace tidal {

struct TensorPlacement {
  ChunkIndex chunk = 0;
  std::size_t offset = 0;  // elements from the start of the chunk
  std::size_t numel = 0;
};

struct ChunkExtent {
  std::size_t capacity = 0;  // elements
  std::uint8_t pool = 0;     // Note [Pools keep frozen tensors apart]
  std::size_t used = 0;      // elements up to the end of the last tensor
  // Its tensors in placement (offset) order. Not a contiguous run of ids:
  // pools and the second open chunk interleave chunks' tensors.
  std::vector<TensorId> tensors;
  std::size_t num_tensors = 0;
  bool dedicated = false;  // holds one tensor larger than chunk_elements
};

class ChunkLayout {
 public:
  // chunk_elements must be a positive multiple of alignment_elements, which
  // must be a power of two; ValueError otherwise.
  ChunkLayout(std::size_t chunk_elements, std::size_t alignment_elements);

  // Places a tensor of `numel` (> 0) elements of pool `pool` after every
  // tensor placed so far (Note [Pools keep frozen tensors apart]).
  TensorPlacement append(std::size_t numel, std::uint8_t pool = 0, bool with_previous = false);

  std::size_t chunk_elements() const { return chunk_elements_; }
  std::size_t alignment_elements() const { return alignment_; }
  std::size_t num_tensors() const { return placements_.size(); }
  std::size_t num_chunks() const { return extents_.size(); }
  const TensorPlacement& placement(TensorId tensor) const { return placements_[tensor]; }
  const ChunkExtent& extent(ChunkIndex chunk) const { return extents_[chunk]; }

  std::size_t total_numel() const { return total_numel_; }
  // Sum of the capacities of all chunks, in elements (of one list).
  std::size_t total_capacity() const { return total_capacity_; }
  // Elements allocated but holding no tensor: alignment padding and the
  // unused tails of chunks.
  std::size_t waste_elements() const { return total_capacity_ - total_numel_; }
  std::size_t dedicated_chunks() const { return dedicated_chunks_; }

 private:
  std::size_t chunk_elements_;
  std::size_t alignment_;
  std::vector<TensorPlacement> placements_;
  std::vector<ChunkExtent> extents_;
  std::size_t total_numel_ = 0;
  std::size_t total_capacity_ = 0;
  std::size_t dedicated_chunks_ = 0;
  // Each pool's open chunk (kNoChunk: none).
  static constexpr ChunkIndex kNoChunk = static_cast<ChunkIndex>(-1);
  static constexpr std::size_t kOpenChunks = 2;
  // At most chunk_elements / kSmallTensorDivisor elements: a small tensor.
  static constexpr std::size_t kSmallTensorDivisor = 1024;
  std::vector<std::array<ChunkIndex, kOpenChunks>> open_;  // oldest first
  std::vector<ChunkIndex> last_;  // each pool's last tensor's chunk
};

constexpr std::size_t round_up(std::size_t value, std::size_t multiple) {
  return (value + multiple - 1) / multiple * multiple;
}

}  // namespace tidal
