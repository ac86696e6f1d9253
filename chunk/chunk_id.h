// Names for tensors and chunks in the chunk store. See Note [One layout, five lists].
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>

namespace tidal {

// The five chunk lists. Their order is the order of ChunkId interleaving.
enum class ChunkKind : std::uint8_t {
  kParam16 = 0,    // fp16/bf16 parameters; gradients overwrite them after backward
  kParam32 = 1,    // fp32 master parameters
  kMomentum = 2,   // Adam first moment (m)
  kVariance = 3,   // Adam second moment (v)
  kGradAccum = 4,  // fp32 gradient sums over micro-batches (gradient accumulation only)
};

inline constexpr std::size_t kNumChunkKinds = 5;
inline constexpr ChunkKind kAllChunkKinds[kNumChunkKinds] = {
    ChunkKind::kParam16, ChunkKind::kParam32, ChunkKind::kMomentum, ChunkKind::kVariance,
    ChunkKind::kGradAccum};

constexpr std::size_t index_of(ChunkKind kind) { return static_cast<std::size_t>(kind); }

constexpr const char* to_string(ChunkKind kind) {
  switch (kind) {
    case ChunkKind::kParam16:
      return "param16";
    case ChunkKind::kParam32:
      return "param32";
    case ChunkKind::kMomentum:
      return "adam_m";
    case ChunkKind::kVariance:
      return "adam_v";
    case ChunkKind::kGradAccum:
      return "grad32";
  }
  return "unknown chunk kind";
}

// Tensors are numbered in registration order, which is also placement order.
using TensorId = std::uint32_t;
// Position of a chunk inside its list; the same for all five lists.
using ChunkIndex = std::uint32_t;

inline constexpr TensorId kNoTensor = std::numeric_limits<TensorId>::max();

// One chunk of one list, numbered across the five lists as index * 5 + kind.
// NB: interleaving keeps every id stable while lists grow, so per-chunk arrays
// of the scheduler only ever append.
using ChunkId = std::uint32_t;
inline constexpr ChunkId kNoChunk = std::numeric_limits<ChunkId>::max();

constexpr ChunkId make_chunk_id(ChunkKind kind, ChunkIndex index) {
  return static_cast<ChunkId>(index * kNumChunkKinds + index_of(kind));
}
constexpr ChunkKind kind_of(ChunkId id) { return static_cast<ChunkKind>(id % kNumChunkKinds); }
constexpr ChunkIndex index_of_chunk(ChunkId id) {
  return static_cast<ChunkIndex>(id / kNumChunkKinds);
}

// A tensor's slot in one list: the unit that has a state and is accessed.
struct TensorRef {
  ChunkKind kind = ChunkKind::kParam16;
  TensorId tensor = kNoTensor;

  friend constexpr bool operator==(const TensorRef&, const TensorRef&) = default;
};

}  // namespace tidal
