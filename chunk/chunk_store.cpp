#include "chunk/chunk_store.h"

#include <utility>

#include "runtime/core/error.h"

namespace tidal {
namespace {

DType dtype_of(ChunkKind kind, const ChunkStoreOptions& options) {
  switch (kind) {
    case ChunkKind::kParam16:
      return options.param_dtype;
    case ChunkKind::kMomentum:
    case ChunkKind::kVariance:
      return options.state_dtype;
    default:
      return DType::kFloat32;
  }
}

std::size_t checked_chunk_elements(const ChunkStoreOptions& options) {
  // float32 is the engine's exactness mode: the compute copy is fp32 too.
  TIDAL_CHECK(options.param_dtype == DType::kFloat16 || options.param_dtype == DType::kBFloat16 ||
                  options.param_dtype == DType::kFloat32,
              "chunk store: the parameter list holds float16, bfloat16 or float32, got ",
              to_string(options.param_dtype));
  TIDAL_CHECK(options.state_dtype == DType::kFloat32 || options.state_dtype == DType::kBFloat16,
              "chunk store: the Adam moments are float32 or bfloat16, got ",
              to_string(options.state_dtype));
  const std::size_t elem = element_size(options.param_dtype);
  TIDAL_CHECK(options.chunk_bytes > 0 && options.chunk_bytes % elem == 0,
              "chunk store: chunk_bytes must be a positive multiple of ", elem, " bytes (one ",
              to_string(options.param_dtype), " element), got ", options.chunk_bytes);
  const std::size_t elements = options.chunk_bytes / elem;
  TIDAL_CHECK(options.alignment_elements > 0 && elements % options.alignment_elements == 0,
              "chunk store: chunk_bytes=", format_bytes(options.chunk_bytes), " holds ", elements,
              " elements, which is not a multiple of the tensor alignment of ",
              options.alignment_elements, " elements; pick a chunk size that is");
  return elements;
}

const char* transition_tip(TensorState from, TensorState to) {
  if (from == TensorState::kCompute && to == TensorState::kCompute) {
    return "it is already in use; release it before accessing it again";
  }
  if (from == TensorState::kFree) {
    return "a FREE slot holds no data; access it (COMPUTE) to write it first";
  }
  if (to == TensorState::kHoldAfterFwd || to == TensorState::kHoldAfterBwd) {
    return "only a release from COMPUTE leads there";
  }
  return "see the transition table of the chunk state machine";
}

}  // namespace

ChunkStore::ChunkStore(const ChunkStoreOptions& options)
    : options_(options),
      layout_(checked_chunk_elements(options), options.alignment_elements),
      lists_{ChunkList(ChunkKind::kParam16, dtype_of(ChunkKind::kParam16, options)),
             ChunkList(ChunkKind::kParam32, DType::kFloat32),
             ChunkList(ChunkKind::kMomentum, dtype_of(ChunkKind::kMomentum, options)),
             ChunkList(ChunkKind::kVariance, dtype_of(ChunkKind::kVariance, options)),
             ChunkList(ChunkKind::kGradAccum, DType::kFloat32)} {}

TensorId ChunkStore::register_tensor(std::string name, std::size_t numel, std::uint8_t pool,
                                     bool with_previous) {
  TIDAL_CHECK(!name.empty(), "chunk store: a tensor needs a non-empty name (tensor ",
              names_.size(), ", ", numel, " elements)");
  TIDAL_CHECK(ids_by_name_.find(name) == ids_by_name_.end(), "chunk store: tensor '", name,
              "' is already registered (as tensor ", ids_by_name_.at(name),
              "); names must be unique");
  TIDAL_CHECK(numel > 0, "chunk store: tensor '", name,
              "' has 0 elements; only non-empty tensors are placed in chunks");
  const std::size_t chunks_before = layout_.num_chunks();
  const TensorPlacement placement = layout_.append(numel, pool, with_previous);
  const auto tensor = static_cast<TensorId>(names_.size());
  const ChunkExtent& extent = layout_.extent(placement.chunk);

  for (ChunkList& list : lists_) {
    if (layout_.num_chunks() > chunks_before) {
      list.chunks_.emplace_back(list.kind(), placement.chunk, list.dtype(), extent.capacity,
                                extent.dedicated);
      ++chunks_in_[index_of(MemorySpace::kNone)];
    }
    Chunk& chunk = list.chunks_[placement.chunk];
    chunk.num_tensors_ = extent.num_tensors;
    chunk.used_elements_ = extent.used;
    ++chunk.state_counts_[index_of(TensorState::kFree)];
  }
  for (auto& states : states_) states.push_back(TensorState::kFree);
  ids_by_name_.emplace(name, tensor);
  names_.push_back(std::move(name));

  if (extent.dedicated) {
    const std::size_t elem = element_size(options_.param_dtype);
    warn(detail::str_cat("tensor '", names_.back(), "' has ", numel, " elements (",
                         format_bytes(numel * elem), " as ", to_string(options_.param_dtype),
                         "), more than the chunk size of ", layout_.chunk_elements(),
                         " elements (", format_bytes(options_.chunk_bytes),
                         "); it gets a dedicated chunk of its own, which moves as one block and "
                         "is not reused by other tensors. Tip: raise the chunk size (config key "
                         "tidal.chunk_size) to at least ", format_bytes(numel * elem),
                         " so that it shares a chunk with others"));
  }
  debug_validate();
  return tensor;
}

const std::string& ChunkStore::tensor_name(TensorId tensor) const {
  TIDAL_CHECK_INDEX(tensor < names_.size(), "chunk store: tensor id ", tensor,
                    " out of range; ", names_.size(), " tensors are registered");
  return names_[tensor];
}

std::size_t ChunkStore::tensor_numel(TensorId tensor) const {
  return placement(tensor).numel;
}

const TensorPlacement& ChunkStore::placement(TensorId tensor) const {
  TIDAL_CHECK_INDEX(tensor < names_.size(), "chunk store: tensor id ", tensor,
                    " out of range; ", names_.size(), " tensors are registered");
  return layout_.placement(tensor);
}

std::optional<TensorId> ChunkStore::find_tensor(std::string_view name) const {
  auto it = ids_by_name_.find(std::string(name));
  if (it == ids_by_name_.end()) return std::nullopt;
  return it->second;
}

void ChunkStore::throw_bad_chunk(ChunkId id) const {
  TIDAL_THROW(IndexError, "chunk store: chunk id ", id, " out of range; ", num_chunks(),
              " chunks per list");
}

Chunk& ChunkStore::mutable_chunk(ChunkId id) {
  return const_cast<Chunk&>(static_cast<const ChunkStore&>(*this).chunk(id));
}

void ChunkStore::throw_bad_ref(TensorRef ref, const char* what) const {
  TIDAL_CHECK_INDEX(index_of(ref.kind) < kNumChunkKinds, what, ": unknown chunk kind ",
                    static_cast<int>(ref.kind));
  TIDAL_THROW(IndexError, what, ": tensor id ", ref.tensor, " out of range; ", names_.size(),
              " tensors are registered");
}

void ChunkStore::check_transition(TensorRef ref, TensorState to) const {
  check_ref(ref, "chunk store: state transition");
  const TensorState from = states_[index_of(ref.kind)][ref.tensor];
  TIDAL_CHECK(is_legal_transition(from, to), "tensor '", names_[ref.tensor], "' (",
              to_string(ref.kind), " slot): illegal state transition ", to_string(from), " -> ",
              to_string(to), "; ", transition_tip(from, to));
}

void ChunkStore::set_state(TensorRef ref, TensorState to) {
  check_transition(ref, to);
  TensorState& slot = states_[index_of(ref.kind)][ref.tensor];
  if (slot == to) return;
  Chunk& chunk = mutable_chunk(chunk_of(ref));
  // A slot that holds data needs a payload to hold it in.
  TIDAL_CHECK(to == TensorState::kFree || chunk.has_payload(), "tensor '", names_[ref.tensor],
              "' (", to_string(ref.kind), " slot): cannot enter ", to_string(to),
              " while its chunk ", chunk.id(),
              " has no payload; the owner of chunk memory must place the chunk first");
  // Nothing computes on a chunk in the disk's file (its payload is a token).
  TIDAL_CHECK(to != TensorState::kCompute || chunk.space_ != MemorySpace::kDisk, "tensor '",
              names_[ref.tensor], "' (", to_string(ref.kind), " slot): cannot enter COMPUTE while its chunk ",
              chunk.id(), " is on disk; the owner of chunk memory must read it into host or device memory first");
  --chunk.state_counts_[index_of(slot)];
  ++chunk.state_counts_[index_of(to)];
  slot = to;
  debug_validate();
}

void ChunkStore::set_payload(ChunkId id, void* payload, MemorySpace space) {
  Chunk& chunk = mutable_chunk(id);
  TIDAL_CHECK((payload == nullptr) == (space == MemorySpace::kNone), "chunk ", id, " (",
              to_string(chunk.kind()), "): a payload pointer goes with a memory space and null "
              "with kNone; got ", payload, " in ", to_string(space));
  if (payload == chunk.payload_ && space == chunk.space_) return;
  if (chunk.has_payload()) {
    TIDAL_CHECK(chunk.movable(), describe_chunk(id), ": cannot move it to ", to_string(space),
                " while tensors are COMPUTE (", describe_tensors(tensors_in_state(id, TensorState::kCompute)),
                "); release them first");
  }
  if (space == MemorySpace::kNone) {
    TIDAL_CHECK(chunk.all_free(), describe_chunk(id), ": cannot drop its payload while ",
                chunk.num_tensors() - chunk.count(TensorState::kFree), " of its ",
                chunk.num_tensors(), " tensors are not FREE");
  }
  bytes_in_[index_of(chunk.space_)] -= chunk.space_ == MemorySpace::kNone ? 0 : chunk.capacity_bytes();
  --chunks_in_[index_of(chunk.space_)];
  chunk.payload_ = payload;
  chunk.space_ = space;
  bytes_in_[index_of(space)] += space == MemorySpace::kNone ? 0 : chunk.capacity_bytes();
  ++chunks_in_[index_of(space)];
  debug_validate();
}

std::vector<TensorId> ChunkStore::tensors_in_state(ChunkId id, TensorState state) const {
  const Chunk& c = chunk(id);
  const auto& states = states_[index_of(c.kind())];
  std::vector<TensorId> out;
  for (TensorId t : tensors_of(c.index())) {
    if (states[t] == state) out.push_back(t);
  }
  return out;
}

std::string ChunkStore::describe_tensors(const std::vector<TensorId>& tensors) const {
  std::string out;
  constexpr std::size_t kMaxNamed = 8;
  for (std::size_t i = 0; i < tensors.size() && i < kMaxNamed; ++i) {
    out += detail::str_cat(i ? ", '" : "'", names_[tensors[i]], "'");
  }
  if (tensors.size() > kMaxNamed) out += detail::str_cat(" and ", tensors.size() - kMaxNamed, " more");
  return out;
}

std::string ChunkStore::describe_chunk(ChunkId id) const {
  const Chunk& c = chunk(id);
  const std::vector<TensorId>& ids = tensors_of(c.index());
  std::string tensors = ids.size() == 1
                            ? detail::str_cat("tensor '", names_[ids.front()], "'")
                            : detail::str_cat("tensors '", names_[ids.front()], "' .. '",
                                              names_[ids.back()], "' (", ids.size(), ")");
  return detail::str_cat("chunk ", id, " (", to_string(c.kind()), " #", c.index(), ", ",
                         format_bytes(c.capacity_bytes()), c.dedicated() ? ", dedicated" : "",
                         ", ", tensors, ", ",
                         c.has_payload() ? detail::str_cat("on ", to_string(c.space()))
                                         : std::string("no payload"),
                         ")");
}

std::size_t ChunkStore::tensor_bytes(TensorRef ref) const {
  check_ref(ref, "chunk store: tensor_bytes");
  return layout_.placement(ref.tensor).numel * element_size(lists_[index_of(ref.kind)].dtype());
}

void ChunkStore::warn(std::string message) {
  if (warning_handler_) {
    warning_handler_(message);
  } else {
    pending_warnings_.push_back(std::move(message));
  }
}

std::vector<std::string> ChunkStore::take_warnings() {
  std::vector<std::string> out;
  out.swap(pending_warnings_);
  return out;
}

void ChunkStore::debug_validate() const {
#if defined(TIDAL_DEBUG_FULL)
  validate();
#endif
}

void ChunkStore::validate() const {
  const std::size_t align = layout_.alignment_elements();
  const std::size_t num_chunks = layout_.num_chunks();
  TIDAL_INTERNAL_ASSERT(names_.size() == layout_.num_tensors(), names_.size(), " names for ",
                        layout_.num_tensors(), " placed tensors");
  TIDAL_INTERNAL_ASSERT(ids_by_name_.size() == names_.size(), "name index out of step");

  // Layout: each chunk's tensors are ordered, aligned and non-overlapping
  // inside its capacity, and every tensor is listed by the chunk it is
  // placed in, once.
  std::size_t listed = 0;
  std::size_t total_capacity = 0;
  for (ChunkIndex c = 0; c < num_chunks; ++c) {
    const ChunkExtent& extent = layout_.extent(c);
    TIDAL_INTERNAL_ASSERT(extent.num_tensors > 0 && extent.num_tensors == extent.tensors.size(),
                          "chunk ", c, " lists ", extent.tensors.size(), " tensors, counts ",
                          extent.num_tensors);
    TIDAL_INTERNAL_ASSERT(extent.capacity % align == 0, "chunk ", c, " capacity ", extent.capacity,
                          " not aligned");
    if (extent.dedicated) {
      TIDAL_INTERNAL_ASSERT(extent.num_tensors == 1, "dedicated chunk ", c, " holds ",
                            extent.num_tensors, " tensors");
      const std::size_t numel = layout_.placement(extent.tensors.front()).numel;
      TIDAL_INTERNAL_ASSERT(numel > layout_.chunk_elements() &&
                                extent.capacity == round_up(numel, align),
                            "dedicated chunk ", c, " of ", extent.capacity, " elements for a tensor of ",
                            numel);
    } else {
      TIDAL_INTERNAL_ASSERT(extent.capacity == layout_.chunk_elements(), "chunk ", c, " capacity ",
                            extent.capacity);
    }
    std::size_t end = 0;
    for (TensorId t : extent.tensors) {
      const TensorPlacement& p = layout_.placement(t);
      TIDAL_INTERNAL_ASSERT(p.chunk == c, "tensor ", t, " placed in chunk ", p.chunk,
                            " but listed in chunk ", c);
      TIDAL_INTERNAL_ASSERT(p.offset % align == 0, "tensor ", t, " offset ", p.offset,
                            " not aligned to ", align);
      TIDAL_INTERNAL_ASSERT(p.offset >= end, "tensor ", t, " overlaps its predecessor");
      TIDAL_INTERNAL_ASSERT(p.numel > 0 && p.offset + p.numel <= extent.capacity, "tensor ", t,
                            " [", p.offset, ", ", p.offset + p.numel, ") outside chunk ", c,
                            " of ", extent.capacity, " elements");
      end = p.offset + p.numel;
    }
    TIDAL_INTERNAL_ASSERT(extent.used == end, "chunk ", c, " used ", extent.used, " != ", end);
    listed += extent.num_tensors;
    total_capacity += extent.capacity;
  }
  // (Each tensor's placement names one chunk, which lists it: so the counts
  // adding up means each is listed once.)
  TIDAL_INTERNAL_ASSERT(listed == layout_.num_tensors(), "chunks list ", listed,
                        " tensors of ", layout_.num_tensors());
  TIDAL_INTERNAL_ASSERT(total_capacity == layout_.total_capacity(), "capacity sum");

  // The five lists mirror the layout; states and payloads add up.
  std::array<std::size_t, kNumMemorySpaces> bytes{};
  std::array<std::size_t, kNumMemorySpaces> chunks{};
  for (const ChunkList& list : lists_) {
    const auto& states = states_[index_of(list.kind())];
    TIDAL_INTERNAL_ASSERT(list.size() == num_chunks, to_string(list.kind()), " list has ",
                          list.size(), " chunks, the layout ", num_chunks);
    TIDAL_INTERNAL_ASSERT(states.size() == names_.size(), to_string(list.kind()), " has ",
                          states.size(), " states for ", names_.size(), " tensors");
    TIDAL_INTERNAL_ASSERT(list.dtype() == dtype_of(list.kind(), options_),
                          to_string(list.kind()), " list dtype");
    for (ChunkIndex c = 0; c < num_chunks; ++c) {
      const Chunk& chunk = list[c];
      const ChunkExtent& extent = layout_.extent(c);
      TIDAL_INTERNAL_ASSERT(chunk.kind() == list.kind() && chunk.index() == c &&
                                chunk.dtype() == list.dtype(),
                            "chunk ", c, " of ", to_string(list.kind()), " misfiled");
      TIDAL_INTERNAL_ASSERT(chunk.capacity_elements() == extent.capacity &&
                                chunk.num_tensors() == extent.num_tensors &&
                                chunk.used_elements() == extent.used &&
                                chunk.dedicated() == extent.dedicated,
                            to_string(list.kind()), " chunk ", c, " differs from the shared layout");
      TIDAL_INTERNAL_ASSERT(chunk.capacity_bytes() == extent.capacity * element_size(list.dtype()),
                            "chunk ", chunk.id(), " capacity bytes");
      std::array<std::uint32_t, kNumTensorStates> counts{};
      for (TensorId t : extent.tensors) ++counts[index_of(states[t])];
      for (TensorState s : kAllTensorStates) {
        TIDAL_INTERNAL_ASSERT(counts[index_of(s)] == chunk.count(s), "chunk ", chunk.id(),
                              " counts ", chunk.count(s), " ", to_string(s),
                              " slots, a recount finds ", counts[index_of(s)]);
      }
      TIDAL_INTERNAL_ASSERT(chunk.has_payload() == (chunk.space() != MemorySpace::kNone), "chunk ",
                            chunk.id(), " is both resident and evicted: payload ", chunk.payload(),
                            " in space ", to_string(chunk.space()));
      TIDAL_INTERNAL_ASSERT(chunk.has_payload() || chunk.all_free(), "chunk ", chunk.id(),
                            " has no payload but ", chunk.num_tensors() - chunk.count(TensorState::kFree),
                            " slots hold data");
      TIDAL_INTERNAL_ASSERT(chunk.space() != MemorySpace::kDisk || chunk.count(TensorState::kCompute) == 0,
                            "chunk ", chunk.id(), " is on disk with COMPUTE slots");
      bytes[index_of(chunk.space())] += chunk.has_payload() ? chunk.capacity_bytes() : 0;
      ++chunks[index_of(chunk.space())];
    }
  }
  for (std::size_t s = 0; s < kNumMemorySpaces; ++s) {
    TIDAL_INTERNAL_ASSERT(bytes[s] == bytes_in_[s], "bytes in ",
                          to_string(static_cast<MemorySpace>(s)), ": recorded ", bytes_in_[s],
                          ", chunks add up to ", bytes[s]);
    TIDAL_INTERNAL_ASSERT(chunks[s] == chunks_in_[s], "chunks in ",
                          to_string(static_cast<MemorySpace>(s)), ": recorded ", chunks_in_[s],
                          ", counted ", chunks[s]);
  }
}

}  // namespace tidal
