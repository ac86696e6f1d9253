#include "runtime/scheduler/chunk_scheduler.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <utility>

#include "runtime/core/error.h"

namespace tidal {
namespace {

std::shared_ptr<Device> checked_device(std::shared_ptr<Device> device) {
  TIDAL_CHECK(device != nullptr, "chunk scheduler: expected a device, got null");
  return device;
}

bool is_placeable(MemorySpace space) {
  return space == MemorySpace::kHost || space == MemorySpace::kDevice;
}

}  // namespace

ChunkScheduler::ChunkScheduler(ChunkStore store, std::shared_ptr<Device> device,
                               ChunkSchedulerOptions options)
    : device_(checked_device(std::move(device))),
      options_(std::move(options)),
      store_(std::move(store)),
      policy_(options_.policy ? options_.policy : std::make_shared<OptPolicy>()),
      h2d_stream_(device_->create_stream("tidal.chunk.h2d")),
      d2h_stream_(device_->create_stream("tidal.chunk.d2h")),
      pool_(device_, options_.pin_host_memory) {
  TIDAL_CHECK(store_.chunks_in(MemorySpace::kHost) == 0 && store_.chunks_in(MemorySpace::kDevice) == 0,
              "chunk scheduler: the store already has chunks with payloads (",
              store_.chunks_in(MemorySpace::kHost), " on host, ",
              store_.chunks_in(MemorySpace::kDevice),
              " on device) that nobody owns; give the scheduler a fresh store");
  TIDAL_CHECK(!options_.prefetch || options_.prefetch_depth > 0,
              "chunk scheduler: prefetch_depth must be at least 1 when prefetch is on, got 0");
  host_keep_blocks_ = kKeepEveryHostBlock;  // Note [Host blocks for a steady step]: until two steps ended
  if (!options_.disk_path.empty()) {
    DiskTierOptions d;
    d.dir = options_.disk_path;
    d.budget_bytes = options_.disk_budget_bytes;
    d.threads = options_.disk_threads;
    d.request_bytes = options_.disk_request_bytes;
    d.allow_buffered = options_.disk_allow_buffered;
    d.backend = options_.disk_backend;
    disk_ = std::make_unique<DiskTier>(d);
    budget_[index_of(MemorySpace::kDisk)] = disk_->budget_bytes();
  }
  pool_.set_image_wanted([this](std::int64_t chunk, std::uint64_t version) { return image_wanted(chunk, version); });
  budget_[index_of(MemorySpace::kHost)] = options_.host_budget_bytes;
  budget_[index_of(MemorySpace::kDevice)] =
      options_.device_budget_bytes > 0 ? options_.device_budget_bytes : device_->capacity();
  sync_slots();
  debug_validate();
}

// Note [Destructors after a device error]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A destructor runs during stack unwinding (e.g. after an OutOfMemoryError or
// a device fault); if it threw, std::terminate would end the process and hide
// the first error. So teardown in runtime/scheduler catches every exception,
// reports the first one once to stderr and goes on releasing what is left.
// After a device error the device's memory is in an unknown state anyway; the
// aim is only that the process keeps the original error and does not abort.
ChunkScheduler::~ChunkScheduler() {
  // After a disk failure (Note [Chunks on NVMe: after a failure] in
  // disk_tier.h), which was raised already, teardown meets its echoes (blocks
  // whose I/O failed): they are not reported again.
  bool reported = disk_ && disk_->failed();
  auto guarded = [&reported](auto&& step) {
    try {
      step();
    } catch (const std::exception& e) {
      if (!reported) {
        std::fprintf(stderr, "tidal: ChunkScheduler teardown after a device error: %s\n", e.what());
        reported = true;
      }
    } catch (...) {
      if (!reported) {
        std::fprintf(stderr, "tidal: ChunkScheduler teardown after an unknown device error\n");
        reported = true;
      }
    }
  };
  // Every copy lands before any memory goes (Note [Block fences]).
  for (Slot& slot : slots_) {
    if (slot.block) guarded([&] { slot.block->wait_on_host(); });
  }
  guarded([&] { h2d_stream_->synchronize(); });
  guarded([&] { d2h_stream_->synchronize(); });
  if (disk_ && disk_->failed()) {
    // The pool's host blocks with failed I/O go here, quietly, not in its
    // destructor (trim_one takes each block out before it waits).
    for (bool more = true; more;) guarded([&] { more = pool_.trim_one(MemorySpace::kHost); });
  }
}

TensorId ChunkScheduler::register_tensor(std::string name, std::size_t numel, std::uint8_t pool,
                                         bool with_previous) {
  const TensorId tensor = store_.register_tensor(std::move(name), numel, pool, with_previous);
  sync_slots();
  return tensor;
}

void ChunkScheduler::sync_slots() {
  const std::size_t n = store_.chunk_id_limit();
  if (slots_.size() < n) {
    slots_.resize(n);
    last_use_.resize(n, 0);
  }
}

// ---- access / release -------------------------------------------------------

void* ChunkScheduler::access(TensorRef ref, MemorySpace space, AccessMode mode, bool wait_for_copy) {
  TIDAL_CHECK(is_placeable(space), "chunk scheduler: access of tensor ", ref.tensor,
              " to memory space '", to_string(space), "'; expected host or device");
  store_.check_transition(ref, TensorState::kCompute);
  // (A FREE slot's bytes are undefined: its user writes them.)
  const bool writes = mode == AccessMode::kWrite || store_.state(ref) == TensorState::kFree;
  check_disk();  // Note [Chunks on NVMe: after a failure]
  const ChunkId id = store_.chunk_of(ref);
  const std::int64_t moment = moment_ + 1;
  if (options_.use_trace) follow(moment, TraceEntry{id, space});

  // Host blocks whose copies finished since the last call go now.
  if (pool_.cached_blocks(MemorySpace::kHost) > host_keep_blocks_) trim_host_cache();
  RoomRequest request;
  request.space = space;
  request.bytes = store_.chunk(id).capacity_bytes();
  request.chunk = id;
  request.tensor = ref;
  request.has_tensor = true;
  place(id, space, request);  // throws with nothing committed

  moment_ = moment;
  if (options_.use_trace && !following_) recording_.push_back(TraceEntry{id, space});
  Block& block = *slots_[id].block;
  if (options_.compute_stream != nullptr && space == MemorySpace::kDevice) {
    block.order_before(*options_.compute_stream);
  } else if (!wait_for_copy && space == MemorySpace::kHost && !block.io) {
    // Note [A pin that does not wait]: the caller synchronizes on copy_fence().
  } else if (!block.ready()) {
    const auto start = std::chrono::steady_clock::now();
    block.wait_on_host();
    ++stats_.copy_waits;
    stats_.copy_wait_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } else {
    block.wait_on_host();  // settles the finished fence (and disk I/O) without waiting
  }
  store_.set_state(ref, TensorState::kCompute);
  if (writes) slots_[id].written();  // Note [Chunks on NVMe: clean chunks]
  last_use_[id] = ++tick_;
  ++stats_.accesses;
  if (options_.prefetch && following_) prefetch_unless_disk_failed();
  debug_validate();
  return store_.tensor_data(ref);
}

void ChunkScheduler::release(TensorRef ref, TensorState state) { release_with(ref, state, nullptr); }

bool ChunkScheduler::release_taking_image(TensorRef ref, TensorState state, std::uint64_t version) {
  return release_with(ref, state, &version);
}

bool ChunkScheduler::release_with(TensorRef ref, TensorState state, const std::uint64_t* image_version) {
  const TensorState from = store_.state(ref);
  TIDAL_CHECK(from == TensorState::kCompute, "chunk scheduler: release of tensor '",
              store_.tensor_name(ref.tensor), "' (", to_string(ref.kind), " slot), which is ",
              to_string(from), ", not COMPUTE; release() ends an access()");
  store_.set_state(ref, state);
  const ChunkId id = store_.chunk_of(ref);
  const Chunk& chunk = store_.chunk(id);
  bool taken = false;
  if (chunk.movable()) {
    // (Before anything may move the chunk.)
    if (image_version != nullptr) taken = take_back_image(id, *image_version);
    if (options_.compute_stream != nullptr && chunk.space() == MemorySpace::kDevice) {
      // A later copy out of this block waits for the compute issued so far.
      slots_[id].block->record_fence(*options_.compute_stream);
    }
    if (options_.drop_free_chunks && chunk.all_free() && chunk.has_payload()) drop_payload(id);
    if (!leave_after_use_.empty()) leave_after_use(id);  // Note [Chunks leave ahead of a lowering]
  }
  ++stats_.releases;
  // The chunk may have been what held a prefetch back.
  if (prefetch_blocked_ && following_ && chunk.movable()) prefetch_unless_disk_failed();
  debug_validate();
  return taken;
}

void ChunkScheduler::set_state(TensorRef ref, TensorState state) {
  const TensorState from = store_.state(ref);
  TIDAL_CHECK(from != TensorState::kCompute && state != TensorState::kCompute,
              "chunk scheduler: set_state of tensor '", store_.tensor_name(ref.tensor), "' (",
              to_string(ref.kind), " slot) from ", to_string(from), " to ", to_string(state),
              "; COMPUTE is entered by access() and left by release()");
  store_.set_state(ref, state);
  const ChunkId id = store_.chunk_of(ref);
  const Chunk& chunk = store_.chunk(id);
  if (options_.drop_free_chunks && chunk.all_free() && chunk.has_payload()) drop_payload(id);
  debug_validate();
}

// ---- trace ------------------------------------------------------------------

void ChunkScheduler::follow(std::int64_t moment, TraceEntry entry) {
  if (!following_) return;
  const auto length = static_cast<std::int64_t>(trace_.size());
  if (moment < length && trace_.entries()[static_cast<std::size_t>(moment)] == entry) return;
  // The step departs from the trace: LRU from here, and record the step
  // (its prefix is the trace's) to adopt at end_step().
  following_ = false;
  ++stats_.trace_divergences;
  recording_.assign(trace_.entries().begin(),
                    trace_.entries().begin() + std::min(moment, length));
  clear_plan();  // (planned from the trace)
}

void ChunkScheduler::end_step() {
  ++stats_.steps;
  clear_plan();  // (this step's: Note [Chunks leave ahead of a lowering])
  if (options_.use_trace && moment_ >= 0) {
    const auto length = static_cast<std::size_t>(moment_ + 1);
    if (following_ && length != trace_.size()) {
      // Ended early: a departure too.
      following_ = false;
      ++stats_.trace_divergences;
      recording_.assign(trace_.entries().begin(), trace_.entries().begin() + length);
    }
    if (!following_) {
      trace_ = AccessTrace(std::move(recording_));
      ++stats_.trace_adoptions;
      clear_all_prefetched();
      prefetch_cursor_ = 0;
    } else {
      prefetch_cursor_ = std::max<std::int64_t>(0, prefetch_cursor_ - static_cast<std::int64_t>(length));
    }
  }
  recording_.clear();
  moment_ = -1;
  // Note [Host blocks for a steady step].
  // Kept by size: a step that takes the model's large dedicated chunks'
  // blocks besides the common ones must find both.
  std::map<std::size_t, std::size_t> taken;
  for (const auto& [bytes, n] : pool_.handed_out_by_size(MemorySpace::kHost)) {
    const auto start = step_start_host_blocks_.find(bytes);
    const std::uint64_t before = start == step_start_host_blocks_.end() ? 0 : start->second;
    if (n > before) taken[bytes] = static_cast<std::size_t>(n - before);
  }
  step_start_host_blocks_ = pool_.handed_out_by_size(MemorySpace::kHost);
  if (++steps_ended_ >= 2) {
    host_keep_by_size_.clear();
    std::size_t keep = 0;
    for (const auto& [bytes, n] : taken) {
      const auto last = last_step_host_blocks_.find(bytes);
      const std::size_t k = last == last_step_host_blocks_.end() ? 0 : std::min(n, last->second);
      if (k > 0) host_keep_by_size_[bytes] = k;
      keep += k;
    }
    host_keep_blocks_ = std::max(options_.host_cache_blocks, keep);
  }
  last_step_host_blocks_ = std::move(taken);
  trim_host_cache();
  following_ = options_.use_trace && !trace_.empty();
  restore_host_reserve();
  if (options_.prefetch && following_) prefetch_unless_disk_failed();
  debug_validate();
}

void ChunkScheduler::restore_host_reserve() {
  const std::size_t reserve = options_.host_eviction_reserve_bytes;
  if (reserve == 0) return;
  const std::size_t host_budget = budget_[index_of(MemorySpace::kHost)];
  const std::size_t device_budget = device_budget_now();
  for (;;) {
    const std::size_t host_live =
        pool_.held_bytes(MemorySpace::kHost) - pool_.cached_bytes(MemorySpace::kHost);
    if (host_live + reserve <= host_budget) return;
    // The movable host chunk with data that the next step needs first.
    ChunkId best = kNoChunk;
    std::int64_t best_use = AccessTrace::kNever;
    for (ChunkId id : resident_[index_of(MemorySpace::kHost)]) {
      const Chunk& chunk = store_.chunk(id);
      if (!chunk.movable() || chunk.all_free()) continue;
      const std::int64_t use = trace_.empty() ? AccessTrace::kNever - 1 : trace_.next_use(id, -1);
      if (best == kNoChunk || use < best_use) {
        best = id;
        best_use = use;
      }
    }
    if (best == kNoChunk) return;
    const std::size_t bytes = store_.chunk(best).capacity_bytes();
    BlockPtr block = reuse_block(MemorySpace::kDevice, bytes);
    if (!block) {
      for (;;) {
        const std::size_t held = pool_.held_bytes(MemorySpace::kDevice);
        if (held <= device_budget && bytes <= device_budget - held) break;
        if (!pool_.trim_one(MemorySpace::kDevice)) return;  // never evicts
      }
      try {
        block = pool_.allocate(MemorySpace::kDevice, bytes);
      } catch (const OutOfMemoryError&) {
        return;
      }
    }
    move(best, MemorySpace::kDevice, std::move(block));
  }
}

// ---- placement ----------------------------------------------------------------

bool ChunkScheduler::place(ChunkId id, MemorySpace space, const RoomRequest& request) {
  // Note [Chunks on NVMe: after a failure]: a prefetch moves nothing once the
  // tier failed (a block it would move may hold a failed read).
  if (request.prefetch && disk_ && disk_->failed()) return false;
  const Chunk& chunk = store_.chunk(id);
  Slot& slot = slots_[id];
  if (chunk.space() == space) {
    if (!request.prefetch) {
      if (slot.prefetched) {
        ++stats_.prefetch_hits;
        clear_prefetched(id, /*wasted=*/false);
      } else {
        ++stats_.hits;
      }
    }
    return true;
  }
  if (!chunk.has_payload()) {
    BlockPtr block = acquire_block(request);
    if (!block) return false;
    attach(id, std::move(block));
    if (!request.prefetch) ++stats_.materializations;
    return true;
  }
  if (chunk.space() == MemorySpace::kDisk) {
    // Note [Chunks on NVMe: the tier]: read into the host; a chunk wanted on
    // the device goes on up from there (a prefetch stops at the host, so it
    // never blocks on the read).
    RoomRequest host = request;
    host.space = MemorySpace::kHost;
    BlockPtr block = acquire_block(host);
    if (!block) return false;
    read_from_disk(id, std::move(block));
    if (request.prefetch && space == MemorySpace::kDevice) slot.staged = true;
    if (space == MemorySpace::kHost || request.prefetch) {
      if (!request.prefetch) ++stats_.misses;
      return true;
    }
  }
  // A prefetch that read the chunk from disk to the host for this access
  // counts as a prefetch hit; the rest of the way up is not another miss.
  const bool staged = slot.staged && !request.prefetch;
  if (staged) {
    ++stats_.prefetch_hits;
    clear_prefetched(id, /*wasted=*/false);
  }
  TIDAL_CHECK(chunk.movable(), "chunk scheduler: ",
              request.has_tensor
                  ? detail::str_cat("tensor '", store_.tensor_name(request.tensor.tensor), "' (",
                                    to_string(request.tensor.kind), " slot) is wanted on ")
                  : std::string("a chunk is wanted on "),
              to_string(space), ", but its ", store_.describe_chunk(id),
              " is pinned there by COMPUTE tensors ",
              store_.describe_tensors(store_.tensors_in_state(id, TensorState::kCompute)),
              "; release them before using the chunk on ", to_string(space));
  if (space == MemorySpace::kHost && come_down_clean(id)) {
    if (!request.prefetch && !staged) ++stats_.misses;
    return true;
  }
  BlockPtr block = acquire_block(request);
  if (!block) return false;
  move(id, space, std::move(block));
  if (!request.prefetch && !staged) ++stats_.misses;
  return true;
}

// Note [Swaps through the host's last chunk]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With host and device full, a chunk coming up from the host needs a device
// victim to go down, and the victim needs host room that only the incoming
// chunk's leaving will free: a swap with no room on either side. So
// evictions fill the host only up to its budget less one fp32 chunk (the
// swap room, at most the reserve), except an eviction made for a chunk that
// comes from the host, which may use up to the incoming chunk's own bytes of
// that room: the victim's copy down lands there, the incoming chunk's copy up
// then goes into the victim's device block (Note [Block fences] orders the
// two), and the incoming chunk's host block goes back to the pool. The host
// holds at most its budget throughout.
std::size_t ChunkScheduler::eviction_host_budget(ChunkId incoming) const {
  const std::size_t budget = budget_[index_of(MemorySpace::kHost)];
  const std::size_t swap_room =
      std::min(options_.host_eviction_reserve_bytes,
               store_.chunk_elements() * element_size(DType::kFloat32));
  std::size_t allowed = budget > swap_room ? budget - swap_room : 0;
  if (incoming != kNoChunk) {
    const Chunk& chunk = store_.chunk(incoming);
    // (budget may be SIZE_MAX: no limit; the sum saturates at the budget.)
    if (chunk.space() == MemorySpace::kHost) {
      allowed = chunk.capacity_bytes() >= budget - allowed ? budget : allowed + chunk.capacity_bytes();
    }
  }
  return allowed;
}

std::size_t ChunkScheduler::device_budget_now() const {
  const std::size_t budget = budget_[index_of(MemorySpace::kDevice)];
  return ceiling_ ? std::min(budget, ceiling_()) : budget;
}

std::size_t ChunkScheduler::budget_for(const RoomRequest& request) const {
  const MemorySpace space = request.space;
  std::size_t budget = space == MemorySpace::kDevice ? device_budget_now() : budget_[index_of(space)];
  if (space == MemorySpace::kHost && request.chunk != kNoChunk &&
      !store_.chunk(request.chunk).has_payload()) {
    // Note [One place per chunk]: the reserve is for moves down.
    const std::size_t reserve = options_.host_eviction_reserve_bytes;
    budget = budget > reserve ? budget - reserve : 0;
  } else if (space == MemorySpace::kHost && request.evicting_for != kNoChunk) {
    budget = eviction_host_budget(request.evicting_for);
  }
  return budget;
}

bool ChunkScheduler::make_room(const RoomRequest& request) {
  const MemorySpace space = request.space;
  std::size_t budget = budget_for(request);
  // Note [Chunks leave ahead of a lowering]: a prefetch to the device keeps
  // within the lowest budget planned before the use it serves.
  std::size_t planned = std::numeric_limits<std::size_t>::max();
  if (request.prefetch && space == MemorySpace::kDevice && !lowerings_.empty()) {
    planned = planned_budget_before(request.needed_at);
    budget = std::min(budget, planned);
  }
  for (;;) {
    if (pool_.has_cached(space, request.bytes) && may_reuse(space, request.bytes) &&
        store_.bytes_in(space) <= planned && request.bytes <= planned - store_.bytes_in(space)) {
      return true;
    }
    const std::size_t held = pool_.held_bytes(space);
    if (held <= budget && request.bytes <= budget - held) return true;
    if (pool_.trim_one_ready(space)) continue;
    // Cached blocks still being copied out of (Note [Blocks leaving over a
    // lowered budget]): waited for only where freeing them all would make
    // the room; otherwise a chunk must leave anyway, and its block may serve
    // this request.
    const std::size_t resident = store_.bytes_in(space);
    const bool cache_makes_room = resident <= budget && request.bytes <= budget - resident;
    const ChunkId victim = cache_makes_room ? kNoChunk : choose_victim(request);
    // A prefetch to the device that no eviction may make room for gives up:
    // freeing cached blocks cannot make it, so it waits for none (those left
    // are all still being copied out of: a put-off).
    if (victim == kNoChunk && !cache_makes_room && request.prefetch && space == MemorySpace::kDevice) {
      if (pool_.cached_bytes(space) > 0) ++stats_.prefetches_put_off;
      return false;
    }
    // A prefetch to the device does not wait for blocks a lowering left, or
    // ones over the budget planned before its use (Note [Prefetch]): it
    // gives up, and the cursor tries again after the next access.
    if (victim == kNoChunk && request.prefetch && space == MemorySpace::kDevice &&
        held > std::min(budget_[index_of(space)], planned)) {
      ++stats_.prefetches_put_off;
      return false;
    }
    if (victim == kNoChunk && pool_.trim_one(space)) continue;
    if (victim == kNoChunk) {
      if (spill_to_device(request)) continue;
      if (write_to_disk_for(request)) continue;
      if (request.prefetch) return false;
      throw_no_room(request, nullptr);
    }
    if (!evict(victim, request)) return false;
  }
}

ChunkId ChunkScheduler::pick(const RoomRequest& request, MemorySpace space) {
  // A prefetch decides as the access it serves would, at the moment before
  // it (Note [Prefetch]); otherwise the policy sees the step as it is now.
  const std::int64_t moment = request.prefetch ? request.needed_at - 1 : moment_;
  const EvictionContext context(store_, request.prefetch ? &trace_ : live_trace(), moment, last_use_);
  const ChunkId victim = policy_->choose_victim(context, space, candidates_);
  TIDAL_CHECK(std::find(candidates_.begin(), candidates_.end(), victim) != candidates_.end(),
              "eviction policy '", policy_->name(), "' chose chunk ", victim,
              ", which is not one of the ", candidates_.size(), " candidates it was given");
  return victim;
}

bool ChunkScheduler::spill_to_device(const RoomRequest& request) {
  // Not for a prefetch (it waits instead) nor while making host room for an
  // eviction: Note [One place per chunk].
  if (request.space != MemorySpace::kHost || request.prefetch || request.evicting_for != kNoChunk) {
    return false;
  }
  candidates_.clear();
  for (ChunkId id : resident_[index_of(MemorySpace::kHost)]) {
    if (id == request.chunk || !store_.chunk(id).movable() || on_disk_list(id)) continue;
    candidates_.push_back(id);
  }
  if (candidates_.empty()) return false;
  const ChunkId victim = pick(request, MemorySpace::kHost);
  if (store_.chunk(victim).all_free()) {
    drop_payload(victim);
    return true;
  }
  const std::size_t bytes = store_.chunk(victim).capacity_bytes();
  BlockPtr block = reuse_block(MemorySpace::kDevice, bytes);
  if (!block) {
    // Free device blocks the pool keeps (of other sizes) are room too.
    const std::size_t budget = device_budget_now();
    for (;;) {
      const std::size_t held = pool_.held_bytes(MemorySpace::kDevice);
      if (held <= budget && bytes <= budget - held) break;
      if (!pool_.trim_one(MemorySpace::kDevice)) return false;
    }
    try {
      block = pool_.allocate(MemorySpace::kDevice, bytes);
    } catch (const OutOfMemoryError&) {
      return false;  // the device itself is full: the host budget is the limit
    }
  }
  move(victim, MemorySpace::kDevice, std::move(block));
  ++stats_.spills;
  return true;
}

bool ChunkScheduler::may_reuse(MemorySpace space, std::size_t bytes) const {
  const std::size_t resident = store_.bytes_in(space);
  const std::size_t budget = budget_[index_of(space)];
  return resident <= budget && bytes <= budget - resident;
}

BlockPtr ChunkScheduler::reuse_block(MemorySpace space, std::size_t bytes, bool pinned) {
  return may_reuse(space, bytes) ? pool_.take_cached(space, bytes, pinned) : nullptr;
}

bool ChunkScheduler::crosses_again(ChunkId id) const {
  return counts_crossings() && id != kNoChunk && slots_[id].crossings >= 1;
}

BlockPtr ChunkScheduler::acquire_block(const RoomRequest& request) {
  // A host block for a chunk coming down that crosses again: a pinned one
  // (Note [Pinned at the second crossing]).
  const bool pinned = request.space == MemorySpace::kHost && request.chunk != kNoChunk &&
                      slots_[request.chunk].block != nullptr && crosses_again(request.chunk);
  for (;;) {
    if (!make_room(request)) return nullptr;
    if (request.space == MemorySpace::kHost && pool_.has_cached(request.space, request.bytes) &&
        !pool_.has_cached_without_wanted_image(request.space, request.bytes)) {
      // Note [Images someone still wants]: every cached block of the size
      // is an image someone will take back; a new one where the budget has
      // the room without freeing any (the steady step's count keeps it).
      const std::size_t held = pool_.held_bytes(request.space);
      const std::size_t budget = budget_for(request);
      if (held <= budget && request.bytes <= budget - held) {
        try {
          BlockPtr block = pool_.allocate(request.space, request.bytes);
          ++stats_.blocks_for_images;
          return block;
        } catch (const OutOfMemoryError&) {
          // (Taken from the cache after all.)
        }
      }
    }
    if (BlockPtr block = reuse_block(request.space, request.bytes, pinned)) return block;
    try {
      return pool_.allocate(request.space, request.bytes);
    } catch (const OutOfMemoryError& e) {
      // The budget had room but the memory space did not (its capacity is
      // below the budget, others use it, or it is fragmented): free what
      // can be freed and try again.
      if (pool_.trim_one(request.space)) continue;
      const ChunkId victim = choose_victim(request);
      if (victim != kNoChunk) {
        if (!evict(victim, request)) return nullptr;
        continue;
      }
      if (request.prefetch) return nullptr;
      throw_no_room(request, e.message().c_str());
    }
  }
}

ChunkId ChunkScheduler::choose_victim(const RoomRequest& request) {
  // Host chunks have nowhere to go (Note [Chunk budgets]).
  if (request.space != MemorySpace::kDevice) return kNoChunk;
  candidates_.clear();
  // Note [Victims the host can take]: an evicted chunk goes to the host, and
  // a full host cannot spill for an eviction (Note [One place per chunk]). A
  // chunk larger than the host's free room (its budget less the bytes of
  // live blocks: cached free blocks can be trimmed) cannot leave, so the
  // policy chooses among those that can, when there are any. With host and
  // device both nearly full, this keeps the fp32 chunks spilled to the
  // device there (they would not fit back) and moves 16-bit chunks instead.
  const std::size_t host_budget = eviction_host_budget(request.chunk);
  const std::size_t host_live =
      pool_.held_bytes(MemorySpace::kHost) - pool_.cached_bytes(MemorySpace::kHost);
  const std::size_t host_room = host_budget > host_live ? host_budget - host_live : 0;
  bool any_fits = false;
  for (ChunkId id : resident_[index_of(MemorySpace::kDevice)]) {
    if (id == request.chunk) continue;
    // A prefetch decides as a demand access would at the moment the chunk is
    // needed, when the chunks in use now may be free again: see Note [Prefetch].
    if (request.prefetch || store_.chunk(id).movable()) {
      candidates_.push_back(id);
      any_fits = any_fits || store_.chunk(id).all_free() ||
                 store_.chunk(id).capacity_bytes() <= host_room;
    }
  }
  if (any_fits) {
    std::erase_if(candidates_, [&](ChunkId id) {
      return !store_.chunk(id).all_free() && store_.chunk(id).capacity_bytes() > host_room;
    });
  }
  if (candidates_.empty()) return kNoChunk;
  const ChunkId victim = pick(request, request.space);
  if (request.prefetch) {
    // Evict now only what the access at needed_at would evict anyway, and
    // only if nothing before it still uses it; otherwise wait.
    if (!store_.chunk(victim).movable() || trace_.next_use(victim, moment_) <= request.needed_at) {
      return kNoChunk;
    }
  }
  return victim;
}

bool ChunkScheduler::evict(ChunkId victim, const RoomRequest& request) {
  const Chunk& chunk = store_.chunk(victim);
  if (chunk.all_free()) {
    drop_payload(victim);  // no data to keep
    return true;
  }
  RoomRequest host;
  host.space = MemorySpace::kHost;
  host.bytes = chunk.capacity_bytes();
  host.chunk = victim;
  host.evicting_for = request.chunk;
  host.prefetch = request.prefetch;
  host.needed_at = request.needed_at;
  const bool sent_ahead = slots_[victim].prefetched && slots_[victim].ahead;
  if (!come_down_clean(victim)) {
    BlockPtr block = acquire_block(host);
    if (!block) return false;
    move(victim, MemorySpace::kHost, std::move(block));
  }
  if (sent_ahead) ahead_wasted_.push_back(victim);
  ++stats_.evictions;
  return true;
}

// Note [A clean chunk goes down without a copy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk's host block goes back to the pool when the chunk moves up (Note
// [One place per chunk]), with its bytes still in it: the copy read it and
// nothing writes a cached block. The block is tagged with the chunk and its
// write count (Slot::writes, counted by Slot::written wherever Note [Chunks
// on NVMe: clean chunks] clears disk_current: a write access, an access of a
// FREE slot, mark_written, a payload dropped), and the pool hands tagged blocks to
// other users last (take_cached clears the tag of a block it hands out).
// When the chunk leaves the device with its write count unchanged and its
// tagged block still cached, it takes that block back as its payload and
// nothing is copied: its device block goes to the pool (its fence covers
// the compute that read it), as after a copy. Forward only reads the 16-bit
// chunks (the hooks attach them for reading and mark them written where a
// parameter changed while attached), so where forward evicts them for the
// activations they leave without crossing the link; ZeRO-3's parameter
// offload frees a gathered parameter after use the same way, the host
// keeping its copy. In step_overlap_clip's GPT on the simulated device that
// is 16 of a steady step's 38 MiB down (benchmarks/clean_down.py). It costs
// no host memory: only blocks the pool keeps anyway (Note [Host blocks for a
// steady step]) serve, and one it frees is no longer an image. The tag is
// trusted exactly as far as the disk tier's clean flag is: a write that
// reaches neither (through `p.data` of a parameter inside a forward, a
// tensor with a version counter of its own) is not seen. So only chunks of
// the pools in clean_copy_pools skip: the engine names the trainable
// parameters' pool, whose fp32 master the step makes the next 16-bit copy
// from (such a write never reached it: docs/parameters.md), not the frozen
// one, whose chunks are their tensors' only copy. Not with a disk tier
// (whose host room the tier's reads and writes plan for), nor with
// skip_clean_copies off.
bool ChunkScheduler::may_skip_copies(ChunkId id) const {
  return options_.skip_clean_copies && !disk_ &&
         ((options_.clean_copy_pools >> store_.layout().extent(index_of_chunk(id)).pool) & 1u) != 0;
}

bool ChunkScheduler::come_down_clean(ChunkId id) {
  if (!may_skip_copies(id)) return false;
  const Chunk& chunk = store_.chunk(id);
  if (chunk.space() != MemorySpace::kDevice || !chunk.has_payload()) return false;
  BlockPtr image = pool_.take_image(chunk.capacity_bytes(), static_cast<std::int64_t>(id), slots_[id].writes);
  if (!image) return false;
  swap_to_image(id, std::move(image));
  rewind_prefetch(id);
  ++stats_.moves_device_to_host;
  ++stats_.copies_down_skipped;
  stats_.bytes_down_skipped += chunk.capacity_bytes();
  if (slots_[id].prefetched) clear_prefetched(id, /*wasted=*/true);
  return true;
}

void ChunkScheduler::swap_to_image(ChunkId id, BlockPtr image) {
  BlockPtr replaced = detach(id);
  attach(id, std::move(image));
  pool_.give_back(std::move(replaced));
}

void ChunkScheduler::move(ChunkId id, MemorySpace to, BlockPtr destination) {
  const bool h2d = to == MemorySpace::kDevice;
  Stream& stream = h2d ? *h2d_stream_ : *d2h_stream_;
  // A disk read into the source or a write out of the destination that
  // failed throws here, before anything moved (Note [Chunks on NVMe: after a
  // failure] in disk_tier.h); the destination goes back to the pool.
  // Note [Pinned at the second crossing]: the host block is pinned, if it
  // is, before the copy, and before anything moved when pinning fails.
  try {
    slots_[id].block->finish_io();
    destination->finish_io();
    Block& host_side = h2d ? *slots_[id].block : *destination;
    if (pool_.prepare_crossing(host_side, crosses_again(id))) {
      ++stats_.host_pins;
      stats_.host_bytes_pinned += host_side.bytes;
    }
    if (!host_side.host.registered()) ++stats_.pageable_copies;
  } catch (...) {
    pool_.give_back(std::move(destination));
    throw;
  }
  if (counts_crossings()) ++slots_[id].crossings;
  BlockPtr source = detach(id);
  const std::size_t bytes = source->bytes;
  TIDAL_INTERNAL_ASSERT(destination->bytes == bytes && destination->space == to,
                        "destination block of ", destination->bytes, " bytes in ",
                        to_string(destination->space), " for a chunk of ", bytes);
  // Note [Block fences]: the copy waits for whatever touched either block
  // last, and both fences then cover the copy.
  source->order_before(stream);
  destination->order_before(stream);
  device_->copy_async(destination->data, source->data, bytes,
                      h2d ? CopyKind::kHostToDevice : CopyKind::kDeviceToHost, stream);
  source->record_fence(stream);
  destination->record_fence(stream);
  attach(id, std::move(destination));
  // Note [A clean chunk goes down without a copy]: the host block keeps the
  // bytes it was copied up from.
  source->image_of = h2d && may_skip_copies(id) ? static_cast<std::int64_t>(id) : -1;
  source->image_version = slots_[id].writes;
  pool_.give_back(std::move(source));
  if (h2d) trim_host_cache();  // Note [One place per chunk]
  rewind_prefetch(id);
  if (h2d) {
    ++stats_.moves_host_to_device;
    stats_.bytes_host_to_device += bytes;
  } else {
    ++stats_.moves_device_to_host;
    stats_.bytes_device_to_host += bytes;
  }
  if (slots_[id].prefetched) clear_prefetched(id, /*wasted=*/true);
}

void ChunkScheduler::drop_payload(ChunkId id) {
  BlockPtr block = detach(id);
  slots_[id].written();  // all FREE: the next payload is a fresh one
  store_.set_payload(id, nullptr, MemorySpace::kNone);
  const bool host = block->space == MemorySpace::kHost;
  // A chunk on disk keeps its home for when it comes back.
  if (block->space != MemorySpace::kDisk) pool_.give_back(std::move(block));
  if (host) trim_host_cache();
  ++stats_.payload_drops;
  if (slots_[id].prefetched) clear_prefetched(id, /*wasted=*/true);
}

void ChunkScheduler::attach(ChunkId id, BlockPtr block) {
  const MemorySpace space = block->space;
  store_.set_payload(id, block->data, space);
  Slot& slot = slots_[id];
  slot.block = std::move(block);
  auto& resident = resident_[index_of(space)];
  slot.resident_pos = static_cast<std::uint32_t>(resident.size());
  resident.push_back(id);
  auto& peak = stats_.peak_resident_bytes[index_of(space)];
  peak = std::max(peak, store_.bytes_in(space));
}

BlockPtr ChunkScheduler::detach(ChunkId id) {
  Slot& slot = slots_[id];
  TIDAL_INTERNAL_ASSERT(slot.block != nullptr, "detach of chunk ", id, " without payload");
  auto& resident = resident_[index_of(slot.block->space)];
  const ChunkId last = resident.back();
  resident[slot.resident_pos] = last;
  slots_[last].resident_pos = slot.resident_pos;
  resident.pop_back();
  return std::move(slot.block);
}

// ---- budgets, errors, stats -------------------------------------------------------

void ChunkScheduler::set_budget(MemorySpace space, std::size_t bytes, BlockFrees frees) {
  TIDAL_CHECK(is_placeable(space), "chunk scheduler: set_budget of memory space '",
              to_string(space), "'; expected host or device");
  const std::size_t old = budget_[index_of(space)];
  // (Blocks an earlier lowering left, still cached over the old budget.)
  const std::size_t left_before = pool_.held_bytes(space) > old ? pool_.held_bytes(space) - old : 0;
  budget_[index_of(space)] = bytes;
  try {
    while (pool_.held_bytes(space) > bytes) {
      if (frees == BlockFrees::kNow ? pool_.trim_one(space) : pool_.trim_one_ready(space)) continue;
      // Note [Blocks leaving over a lowered budget]: the blocks cached now
      // are still being copied out of; they go when their room is needed.
      if (frees == BlockFrees::kWhenNeeded && store_.bytes_in(space) <= bytes) {
        const std::size_t left = pool_.held_bytes(space) - bytes;
        stats_.bytes_left_leaving += left > left_before ? left - left_before : 0;
        break;
      }
      RoomRequest request;
      request.space = space;
      const ChunkId victim = choose_victim(request);
      if (victim == kNoChunk) {
        if (write_to_disk_for(request)) continue;
        throw_no_room(request, "shrinking the budget");
      }
      evict(victim, request);
    }
  } catch (...) {
    budget_[index_of(space)] = old;
    throw;
  }
  debug_validate();
}

bool ChunkScheduler::free_leaving_block(MemorySpace space) {
  if (pool_.held_bytes(space) <= budget_[index_of(space)]) return false;
  const bool freed = pool_.trim_one(space);
  debug_validate();
  return freed;
}

void ChunkScheduler::throw_no_room(const RoomRequest& request, const char* why) const {
  const MemorySpace space = request.space;
  const std::size_t budget = budget_[index_of(space)];
  std::string message = detail::str_cat("chunk scheduler: no room on ", to_string(space));
  if (request.chunk != kNoChunk) {
    message += detail::str_cat(" for ", store_.describe_chunk(request.chunk));
  }
  if (request.has_tensor) {
    message += detail::str_cat(", needed by tensor '", store_.tensor_name(request.tensor.tensor),
                               "' (", to_string(request.tensor.kind), " slot)");
  }
  if (request.evicting_for != kNoChunk) {
    message += detail::str_cat(", which is being evicted from the device to make room for ",
                               store_.describe_chunk(request.evicting_for));
  }
  message += detail::str_cat(": ", to_string(space), " budget ", format_bytes(budget),
                             ", resident ", format_bytes(store_.bytes_in(space)), " in ",
                             store_.chunks_in(space), " chunks");
  if (why != nullptr) message += detail::str_cat(" (", why, ")");
  if (request.bytes > budget) {
    message += detail::str_cat("; the chunk alone (", format_bytes(request.bytes),
                               ") is larger than the budget");
  }
  std::size_t pinned_bytes = 0;
  std::string pinned;
  for (ChunkId id : resident_[index_of(space)]) {
    const Chunk& chunk = store_.chunk(id);
    if (chunk.movable()) continue;
    pinned_bytes += chunk.capacity_bytes();
    pinned += detail::str_cat(pinned.empty() ? "" : "; ", store_.describe_chunk(id), " by ",
                              store_.describe_tensors(store_.tensors_in_state(id, TensorState::kCompute)));
  }
  if (space == MemorySpace::kHost && disk_) {
    message += detail::str_cat("; no host chunk can go to disk (", format_bytes(disk_->held_bytes()),
                               " in '", disk_->path(), "'): the others are in use or of lists kept off disk");
  } else if (space == MemorySpace::kHost) {
    message += "; chunks on the host have nowhere to be evicted to (no NVMe tier)";
  } else {
    message += detail::str_cat("; nothing left to evict: pinned in COMPUTE: ",
                               pinned.empty() ? std::string("nothing") : pinned);
  }
  message += detail::str_cat(". Tip: raise the ", to_string(space), " budget");
  if (space == MemorySpace::kDevice && request.bytes > 0) {
    message += detail::str_cat(" to at least ", format_bytes(pinned_bytes + request.bytes),
                               " (the chunks in use at once plus this one)");
  }
  message += ", release tensors sooner, or lower the chunk size";
  TIDAL_THROW(OutOfMemoryError, message);
}

bool ChunkScheduler::chunk_ready(ChunkId id) const {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  const Slot& slot = slots_[id];
  return slot.block == nullptr || slot.block->ready();
}

std::uint64_t ChunkScheduler::write_count(ChunkId id) const {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  return slots_[id].writes;
}

bool ChunkScheduler::image_cached(ChunkId id, std::uint64_t version) const {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  return may_skip_copies(id) &&
         pool_.has_image(store_.chunk(id).capacity_bytes(), static_cast<std::int64_t>(id), version);
}

// Note [Images someone still wants]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A cached host block tagged as a chunk's image (Note [A clean chunk goes
// down without a copy]) is worth keeping only while someone may take it
// back: the chunk coming down clean (it is on the device and its write
// count is the image's), or a fold of its gradients that leaves the
// weights' rewrite out (Note [The weights' image instead of the restore]
// in hooks/gradient_sums.h), which wants the count before the landings
// (expect_image; the landings raised the chunk's count since). Any other
// image is stale: its chunk was written or came down another way since, and
// its count can only grow. So the pool hands out, and frees, blocks holding
// no wanted image before those holding one. Before, it told only tagged
// from untagged, and a chunk coming down with its gradients in a step
// with no untagged block free took the newest image, often the one its own
// fold would take back a moment later (issue 52's accumulating shape: 23
// of 32 folds a steady step took their image, while the images of chunks
// updated on the device and of the wte chunk, written since, stayed cached).
// And where every cached block of the size holds a wanted image, a chunk
// coming down takes a new block if the host budget has the room without
// freeing one (ChunkSchedulerStats::blocks_for_images): the step that took
// it counts it (Note [Host blocks for a steady step]), so the next steps
// find it cached and pin nothing; a host without the room takes the image
// (its fold restores from the masters, as before).
bool ChunkScheduler::image_wanted(std::int64_t chunk, std::uint64_t version) const {
  if (chunk < 0 || static_cast<std::size_t>(chunk) >= slots_.size()) return false;
  const auto id = static_cast<ChunkId>(chunk);
  const Slot& slot = slots_[id];
  if (slot.image_expected && slot.expected_image_version == version) return true;
  return slot.writes == version && slot.block != nullptr && slot.block->space == MemorySpace::kDevice;
}

void ChunkScheduler::expect_image(ChunkId id, std::uint64_t version) {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  slots_[id].image_expected = true;
  slots_[id].expected_image_version = version;
}

void ChunkScheduler::forget_expected_image(ChunkId id) {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  slots_[id].image_expected = false;
}

bool ChunkScheduler::take_back_image(ChunkId id, std::uint64_t version) {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  const Chunk& chunk = store_.chunk(id);
  if (!may_skip_copies(id) || chunk.space() != MemorySpace::kHost || !chunk.has_payload() || !chunk.movable()) {
    return false;
  }
  BlockPtr image = pool_.take_image(chunk.capacity_bytes(), static_cast<std::int64_t>(id), version);
  if (!image) return false;
  swap_to_image(id, std::move(image));
  slots_[id].written();
  ++stats_.images_taken_back;
  stats_.bytes_images_taken_back += chunk.capacity_bytes();
  debug_validate();
  return true;
}

const Event* ChunkScheduler::copy_fence(ChunkId id) const {
  TIDAL_CHECK_INDEX(id < slots_.size(), "chunk scheduler: chunk id ", id, " out of range");
  const Slot& slot = slots_[id];
  if (slot.block == nullptr || !slot.block->maybe_pending || slot.block->fence->query()) return nullptr;
  return slot.block->fence.get();
}

ChunkSchedulerStats ChunkScheduler::stats() const {
  ChunkSchedulerStats out = stats_;
  out.host_block_allocations = pool_.allocations(MemorySpace::kHost) - pool_base_.host_block_allocations;
  out.host_block_bytes_allocated =
      pool_.allocated_bytes(MemorySpace::kHost) - pool_base_.host_block_bytes_allocated;
  out.device_block_allocations = pool_.allocations(MemorySpace::kDevice) - pool_base_.device_block_allocations;
  out.block_waits = pool_.trim_waits() - pool_base_.block_waits;
  out.block_wait_seconds = pool_.trim_wait_seconds() - pool_base_.block_wait_seconds;
  for (MemorySpace space : {MemorySpace::kHost, MemorySpace::kDevice}) {
    const std::size_t s = index_of(space);
    out.resident_bytes[s] = store_.bytes_in(space);
    out.held_bytes[s] = pool_.held_bytes(space);
    out.budget_bytes[s] = budget_[s];
  }
  if (disk_) {
    const std::size_t s = index_of(MemorySpace::kDisk);
    out.resident_bytes[s] = store_.bytes_in(MemorySpace::kDisk);
    out.held_bytes[s] = disk_->held_bytes();
    out.budget_bytes[s] = budget_[s];
  }
  return out;
}

void ChunkScheduler::reset_stats() {
  stats_ = ChunkSchedulerStats{};
  pool_base_.host_block_allocations = pool_.allocations(MemorySpace::kHost);
  pool_base_.host_block_bytes_allocated = pool_.allocated_bytes(MemorySpace::kHost);
  pool_base_.device_block_allocations = pool_.allocations(MemorySpace::kDevice);
  pool_base_.block_waits = pool_.trim_waits();
  pool_base_.block_wait_seconds = pool_.trim_wait_seconds();
  for (MemorySpace space : {MemorySpace::kHost, MemorySpace::kDevice, MemorySpace::kDisk}) {
    stats_.peak_resident_bytes[index_of(space)] = store_.bytes_in(space);
  }
}

}  // namespace tidal
