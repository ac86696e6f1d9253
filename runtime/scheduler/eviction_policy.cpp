#include "runtime/scheduler/eviction_policy.h"

#include <string>

#include "runtime/core/error.h"

namespace tidal {

ChunkId LruPolicy::choose_victim(const EvictionContext& context, MemorySpace /*space*/,
                                 std::span<const ChunkId> candidates) {
  ChunkId best = candidates.front();
  std::uint64_t best_time = context.last_use(best);
  for (ChunkId chunk : candidates.subspan(1)) {
    const std::uint64_t time = context.last_use(chunk);
    if (time < best_time) {
      best = chunk;
      best_time = time;
    }
  }
  return best;
}

ChunkId OptPolicy::choose_victim(const EvictionContext& context, MemorySpace space,
                                 std::span<const ChunkId> candidates) {
  if (!context.has_trace()) return LruPolicy().choose_victim(context, space, candidates);
  ChunkId best = candidates.front();
  std::int64_t best_next = context.next_use(best);
  std::uint64_t best_time = context.last_use(best);
  for (ChunkId chunk : candidates.subspan(1)) {
    const std::int64_t next = context.next_use(chunk);
    const std::uint64_t time = context.last_use(chunk);
    if (next > best_next || (next == best_next && time < best_time)) {
      best = chunk;
      best_next = next;
      best_time = time;
    }
  }
  return best;
}

std::shared_ptr<EvictionPolicy> make_eviction_policy(std::string_view name) {
  if (name == "opt") return std::make_shared<OptPolicy>();
  if (name == "lru") return std::make_shared<LruPolicy>();
  TIDAL_THROW(ValueError, "unknown eviction policy '", std::string(name),
              "'; expected 'opt' (farthest next use in the trace, LRU without one) or 'lru'");
}

}  // namespace tidal
