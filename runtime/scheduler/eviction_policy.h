// Eviction policies: which resident chunk leaves a memory space when room is
// needed. The scheduler hands a policy the candidates (movable chunks in the
// space) and a context to look up the trace and recency; policies are
// pluggable (ChunkSchedulerOptions::policy).
//
// Note [OPT eviction]
// ~~~~~~~~~~~~~~~~~~~
// With a trace, the best chunk to evict is the one whose next use is
// farthest in the future (Belady's OPT): for a repeated sequence and chunks
// of one size it moves the fewest chunks of any policy. The trace repeats
// every step, so "next use" wraps into the next step; a chunk the trace
// never uses is the farthest of all. Without a trace (the first step), or
// once the step departed from it (a dynamic graph), the future is unknown
// and OPT falls back to LRU: evict the chunk used least recently. Ties in
// next use (chunks never used again) also go to the least recently used.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/chunk_store.h"
#include "chunk/memory_space.h"
#include "runtime/scheduler/access_trace.h"

namespace tidal {

// What a policy may look at. Built by the scheduler for one decision.
class EvictionContext {
 public:
  EvictionContext(const ChunkStore& store, const AccessTrace* trace, std::int64_t moment,
                  const std::vector<std::uint64_t>& last_use)
      : store_(&store), trace_(trace), moment_(moment), last_use_(&last_use) {}

  const ChunkStore& store() const { return *store_; }
  // The moment a decision is made for: the latest access before the one
  // that needs room (for a prefetch, before the access that will use it).
  std::int64_t moment() const { return moment_; }
  // True when the trace predicts the rest of this step.
  bool has_trace() const { return trace_ != nullptr; }
  // Next moment `chunk` is used after moment() per the trace, or
  // AccessTrace::kNever. Requires has_trace().
  std::int64_t next_use(ChunkId chunk) const { return trace_->next_use(chunk, moment_); }
  // Logical time of the last access of `chunk` (larger is more recent; 0: never).
  std::uint64_t last_use(ChunkId chunk) const { return (*last_use_)[chunk]; }

 private:
  const ChunkStore* store_;
  const AccessTrace* trace_;
  std::int64_t moment_;
  const std::vector<std::uint64_t>* last_use_;
};

class EvictionPolicy {
 public:
  virtual ~EvictionPolicy() = default;
  virtual const char* name() const = 0;
  // Returns one of `candidates` (never empty): the chunks resident in
  // `space` but the one being brought in; for a demand access only movable
  // ones, for a prefetch all of them, judged as of context.moment() (the
  // scheduler then waits if the choice is in use now; Note [Prefetch]).
  virtual ChunkId choose_victim(const EvictionContext& context, MemorySpace space,
                                std::span<const ChunkId> candidates) = 0;
};

// Least recently used; ignores the trace.
class LruPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "lru"; }
  ChunkId choose_victim(const EvictionContext& context, MemorySpace space,
                        std::span<const ChunkId> candidates) override;
};

// Farthest next use per the trace, LRU without one. See Note [OPT eviction].
class OptPolicy final : public EvictionPolicy {
 public:
  const char* name() const override { return "opt"; }
  ChunkId choose_victim(const EvictionContext& context, MemorySpace space,
                        std::span<const ChunkId> candidates) override;
};

// "opt" or "lru"; ValueError naming the value and the choices otherwise.
std::shared_ptr<EvictionPolicy> make_eviction_policy(std::string_view name);

}  // namespace tidal
