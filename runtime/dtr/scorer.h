// Scores of eviction candidates. No libtorch: the rematerializer hands the
// scorer plain numbers about one resident tensor.
//
// Note [DTR scores]
// ~~~~~~~~~~~~~~~~~
// DTR (Kirisame et al., arXiv 2006.09616) evicts the resident tensor with the
// lowest h(t) = cost(t) / (size(t) * staleness(t)). Variants:
//   * dtr_eq: cost(t) also counts the evicted neighbourhood that evicting t
//     would make more expensive to bring back: the summed cost of every
//     evicted equivalence class adjacent to t (inputs of t's recipe and
//     results of the ops that read t). Classes are kept with union-find: an
//     evicted tensor is merged with its evicted neighbours, and a
//     rematerialized tensor subtracts its cost from its class without
//     splitting it (the paper's h_DTR^eq approximation).
//   * local: cost(t) alone (h_DTR^local).
//   * lru: 1 / staleness (oldest access first).
//   * size: 1 / size (largest first).
// Staleness is measured in ops since the last access, plus one, so a tensor
// the current op touched still has a finite score. A fragmentation term
// (MegEngine weighs the free space around a tensor) would be one more field
// of ScoreInput and one more Scorer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "runtime/dtr/dtr_options.h"

namespace tidal::dtr {

struct ScoreInput {
  std::size_t bytes = 0;
  std::uint64_t staleness = 1;       // >= 1
  double cost = 0.0;                 // seconds to recompute the tensor itself
  double neighbourhood_cost = 0.0;   // seconds of adjacent evicted classes (dtr_eq only)
};

class Scorer {
 public:
  virtual ~Scorer() = default;
  // Lower is evicted first. Must be finite for bytes > 0.
  virtual double score(const ScoreInput& in) const = 0;
  // Whether score() reads neighbourhood_cost (the caller skips the walk if not).
  virtual bool needs_neighbourhood() const { return false; }
};

std::unique_ptr<Scorer> make_scorer(ScorerKind kind);

}  // namespace tidal::dtr
