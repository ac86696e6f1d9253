#include "runtime/dtr/scorer.h"

#include <gtest/gtest.h>

#include "runtime/core/error.h"

namespace tidal::dtr {
namespace {

TEST(Scorer, DtrEqCountsNeighbourhood) {
  auto s = make_scorer(ScorerKind::kDtrEq);
  ScoreInput a{1000, 2, 1.0, 0.0};
  ScoreInput b{1000, 2, 1.0, 3.0};
  EXPECT_LT(s->score(a), s->score(b));
  EXPECT_TRUE(s->needs_neighbourhood());
  EXPECT_DOUBLE_EQ(s->score(b), (4.0 + 1e-9) / 2000.0);
}

TEST(Scorer, LocalIgnoresNeighbourhood) {
  auto s = make_scorer(ScorerKind::kLocal);
  EXPECT_DOUBLE_EQ(s->score({1000, 2, 1.0, 0.0}), s->score({1000, 2, 1.0, 5.0}));
  // Bigger and staler is evicted first.
  EXPECT_LT(s->score({2000, 2, 1.0, 0.0}), s->score({1000, 2, 1.0, 0.0}));
  EXPECT_LT(s->score({1000, 4, 1.0, 0.0}), s->score({1000, 2, 1.0, 0.0}));
}

TEST(Scorer, LruAndSize) {
  auto lru = make_scorer(ScorerKind::kLru);
  EXPECT_LT(lru->score({10, 9, 100.0, 0.0}), lru->score({100000, 2, 0.0, 0.0}));
  auto size = make_scorer(ScorerKind::kSize);
  EXPECT_LT(size->score({100000, 1, 100.0, 0.0}), size->score({10, 9, 0.0, 0.0}));
}

TEST(Scorer, ParseNames) {
  EXPECT_EQ(parse_scorer("dtr_eq"), ScorerKind::kDtrEq);
  EXPECT_EQ(parse_scorer("lru"), ScorerKind::kLru);
  EXPECT_STREQ(scorer_name(ScorerKind::kSize), "size");
  try {
    parse_scorer("belady");
    FAIL() << "expected ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("belady"), std::string::npos);
  }
}

}  // namespace
}  // namespace tidal::dtr
