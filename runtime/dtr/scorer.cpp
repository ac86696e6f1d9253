#include "runtime/dtr/scorer.h"

#include "runtime/core/error.h"

namespace tidal::dtr {
namespace {

// Costs are measured; a free op (a factory, a cheap view-like kernel) still
// gets a tiny cost so that size and staleness break ties between such tensors.
constexpr double kMinCost = 1e-9;

class DtrEqScorer final : public Scorer {
 public:
  double score(const ScoreInput& in) const override {
    return (in.cost + in.neighbourhood_cost + kMinCost) /
           (static_cast<double>(in.bytes) * static_cast<double>(in.staleness));
  }
  bool needs_neighbourhood() const override { return true; }
};

class LocalScorer final : public Scorer {
 public:
  double score(const ScoreInput& in) const override {
    return (in.cost + kMinCost) / (static_cast<double>(in.bytes) * static_cast<double>(in.staleness));
  }
};

class LruScorer final : public Scorer {
 public:
  double score(const ScoreInput& in) const override { return 1.0 / static_cast<double>(in.staleness); }
};

class SizeScorer final : public Scorer {
 public:
  double score(const ScoreInput& in) const override { return 1.0 / static_cast<double>(in.bytes); }
};

}  // namespace

std::unique_ptr<Scorer> make_scorer(ScorerKind kind) {
  switch (kind) {
    case ScorerKind::kDtrEq: return std::make_unique<DtrEqScorer>();
    case ScorerKind::kLocal: return std::make_unique<LocalScorer>();
    case ScorerKind::kLru: return std::make_unique<LruScorer>();
    case ScorerKind::kSize: return std::make_unique<SizeScorer>();
  }
  TIDAL_INTERNAL_ASSERT(false, "unknown ScorerKind ", static_cast<int>(kind));
}

ScorerKind parse_scorer(std::string_view name) {
  if (name == "dtr_eq") return ScorerKind::kDtrEq;
  if (name == "local") return ScorerKind::kLocal;
  if (name == "lru") return ScorerKind::kLru;
  if (name == "size") return ScorerKind::kSize;
  TIDAL_CHECK(false, "unknown DTR scorer '", name, "'; expected one of 'dtr_eq', 'local', 'lru', 'size'");
  return ScorerKind::kDtrEq;
}

const char* scorer_name(ScorerKind kind) {
  switch (kind) {
    case ScorerKind::kDtrEq: return "dtr_eq";
    case ScorerKind::kLocal: return "local";
    case ScorerKind::kLru: return "lru";
    case ScorerKind::kSize: return "size";
  }
  return "?";
}

}  // namespace tidal::dtr
