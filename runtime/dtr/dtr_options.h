// Options of the activation rematerializer, with MegEngine's names and meanings.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace tidal::dtr {

// How a resident tensor is scored; the lowest score is evicted first.
// See Note [DTR scores] in runtime/dtr/scorer.h.
enum class ScorerKind { kDtrEq, kLocal, kLru, kSize };

// "dtr_eq", "local", "lru", "size"; anything else is a ValueError naming it.
ScorerKind parse_scorer(std::string_view name);
const char* scorer_name(ScorerKind kind);

struct DtrOptions {
  // Evict while tracked bytes are above this. 0: never evict on the
  // threshold, only when an allocation fails (the caller reports that).
  std::size_t eviction_threshold = 0;
  // Tensors smaller than this are never eviction candidates (MegEngine: 1 MiB).
  std::size_t evictee_minimum_size = std::size_t{1} << 20;
  // Score only sqrt(n) randomly sampled candidates instead of all n.
  bool enable_sqrt_sampling = false;
  ScorerKind scorer = ScorerKind::kDtrEq;
  // DTR gives up (tidal::OutOfMemoryError) rather than thrash when the ops
  // it replays would exceed this many times the ops of one training step.
  // 0: no bound. See Note [DTR gives up rather than thrash] in
  // hooks/dtr/storage_runtime.h.
  double max_recompute_ratio = 10.0;
  // Seed of the sampling generator (sampling is deterministic per seed).
  std::uint64_t seed = 0x5eed;
};

}  // namespace tidal::dtr
