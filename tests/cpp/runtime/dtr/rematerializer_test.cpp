#include "runtime/dtr/rematerializer.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <vector>

namespace tidal::dtr {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

DtrOptions opts(std::size_t threshold, ScorerKind scorer = ScorerKind::kDtrEq) {
  DtrOptions o;
  o.eviction_threshold = threshold;
  o.scorer = scorer;
  return o;
}

// Records y = f(x) with one fresh output of `bytes`.
TensorId unary(Rematerializer& r, TensorId x, std::size_t bytes, double cost = 1e-3) {
  std::vector<TensorId> out;
  const std::size_t sizes[] = {bytes};
  const TensorId ins[] = {x};
  r.tick();
  r.record_op(std::span<const TensorId>(ins, x == kNoTensor ? 0 : 1), sizes, cost, true, &out);
  return out.at(0);
}

// Records a gradient-like tensor g = f(x) made during backward (a
// last-resort candidate, Note [Last-resort candidates]).
TensorId gradient(Rematerializer& r, TensorId x, std::size_t bytes = kMiB) {
  std::vector<TensorId> out;
  const std::size_t sizes[] = {bytes};
  const TensorId ins[] = {x};
  r.tick();
  r.record_op(ins, sizes, 1e-3, true, &out, /*last_resort=*/true);
  return out.at(0);
}

// A chain x -> t0 -> t1 -> ... of n tensors of 1 MiB each.
std::vector<TensorId> chain(Rematerializer& r, TensorId x, int n) {
  std::vector<TensorId> ts;
  TensorId prev = x;
  for (int i = 0; i < n; ++i) {
    prev = unary(r, prev, kMiB);
    ts.push_back(prev);
  }
  return ts;
}

TEST(Rematerializer, TracksBytesAndPeak) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(10 * kMiB);
  auto ts = chain(r, x, 4);
  EXPECT_EQ(r.stats().tracked_bytes, 4 * kMiB);  // external not counted
  EXPECT_EQ(r.stats().peak_tracked_bytes, 4 * kMiB);
  EXPECT_FALSE(r.over_threshold());  // 0 = never on the threshold
  r.validate();
}

TEST(Rematerializer, EvictsLowestScoreUntilUnderThreshold) {
  Rematerializer r(opts(2 * kMiB, ScorerKind::kLru));
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 4);
  std::vector<TensorId> evicted;
  while (r.over_threshold()) {
    const TensorId e = r.choose_evictee();
    ASSERT_NE(e, kNoTensor);
    r.evict(e);
    evicted.push_back(e);
  }
  // LRU takes the oldest first.
  EXPECT_EQ(evicted, (std::vector<TensorId>{ts[0], ts[1]}));
  EXPECT_EQ(r.stats().tracked_bytes, 2 * kMiB);
  EXPECT_EQ(r.stats().evictions, 2u);
  r.validate();
}

TEST(Rematerializer, SmallPinnedLockedAndExternalAreNeverCandidates) {
  Rematerializer r(opts(1));
  const TensorId x = r.add_external(8 * kMiB);
  const TensorId small = unary(r, x, kMiB - 1);
  const TensorId pinned = unary(r, x, kMiB);
  std::vector<TensorId> out;
  const std::size_t sz[] = {kMiB};
  const TensorId ins[] = {x};
  r.record_op(ins, sz, 1e-3, /*replayable=*/false, &out);
  r.pin(pinned);
  EXPECT_EQ(r.choose_evictee(), kNoTensor);
  EXPECT_EQ(r.stats().locked_bytes, kMiB);
  r.unpin(pinned);
  EXPECT_EQ(r.choose_evictee(), pinned);
  (void)small;
}

TEST(Rematerializer, RegenerationPlanIsTopologicalAndDeep) {
  // A 20000-deep chain: the explicit stack must not overflow.
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 20000);
  for (TensorId t : ts) r.evict(t);
  const TensorId last[] = {ts.back()};
  auto plan = r.regeneration_plan(last);
  ASSERT_EQ(plan.size(), ts.size());
  for (std::size_t i = 0; i < plan.size(); ++i) {
    ASSERT_EQ(r.op(plan[i].op).outputs.size(), 1u);
    EXPECT_EQ(r.op(plan[i].op).outputs[0], ts[i]);
    const auto installed = r.on_replayed(plan[i], 1e-6);
    EXPECT_EQ(installed, std::vector<TensorId>{ts[i]});
  }
  EXPECT_EQ(r.stats().recomputes, ts.size());
  EXPECT_EQ(r.stats().tracked_bytes, ts.size() * kMiB);
  r.validate();
}

TEST(Rematerializer, PlanSkipsResidentInputsAndSharedProducers) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const TensorId a = unary(r, x, kMiB);
  std::vector<TensorId> outs;
  const std::size_t two[] = {kMiB, kMiB};
  const TensorId ins[] = {a};
  r.record_op(ins, two, 1e-3, true, &outs);  // (b, c) = g(a)
  r.evict(outs[0]);
  r.evict(outs[1]);
  r.evict(a);
  auto plan = r.regeneration_plan(outs);  // both outputs: g once, after f
  ASSERT_EQ(plan.size(), 2u);
  EXPECT_EQ(r.op(plan[0].op).outputs[0], a);
  const auto& g_outputs = r.op(plan[1].op).outputs;
  EXPECT_EQ(std::vector<TensorId>(g_outputs.begin(), g_outputs.end()), outs);
}

TEST(Rematerializer, FakeDeletionKeepsRecipeUntilNoOneNeedsIt) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 3);  // x -> a -> b -> c
  // a's last reference dies while b (alive) may need it to be recomputed.
  EXPECT_FALSE(r.on_storage_dead(ts[0]));
  EXPECT_TRUE(r.contains(ts[0]));
  EXPECT_EQ(r.tensor(ts[0]).state, TensorState::kDeleted);
  EXPECT_EQ(r.stats().fake_deleted, 1u);
  EXPECT_EQ(r.stats().tracked_bytes, 2 * kMiB);
  r.evict(ts[1]);
  const TensorId want[] = {ts[1]};
  auto plan = r.regeneration_plan(want);
  ASSERT_EQ(plan.size(), 2u);  // a regenerated first, then b
  EXPECT_EQ(r.on_replayed(plan[0], 0).at(0), ts[0]);
  r.on_replayed(plan[1], 0);
  // a is resident again but owned only by the caller: it dies again.
  r.on_storage_dead(ts[0]);
  r.validate();
  // Cascading real deletion: c dies (nothing reads it), then b, then a.
  r.on_storage_dead(ts[2]);
  EXPECT_FALSE(r.contains(ts[2]));
  EXPECT_TRUE(r.contains(ts[1]));
  r.on_storage_dead(ts[1]);
  EXPECT_FALSE(r.contains(ts[1]));
  EXPECT_FALSE(r.contains(ts[0]));
  std::vector<TensorId> released_tensors;
  std::vector<OpId> released_ops;
  r.take_released_tensors(&released_tensors);
  r.take_released_ops(&released_ops);
  EXPECT_EQ(released_tensors.size(), 3u);
  EXPECT_EQ(released_ops.size(), 3u);
  EXPECT_FALSE(r.has_released());
  r.on_storage_dead(x);
  EXPECT_EQ(r.stats().live_tensors, 0u);
  EXPECT_EQ(r.stats().live_ops, 0u);
  EXPECT_EQ(r.stats().tracked_bytes, 0u);
  r.validate();
}

TEST(Rematerializer, ManyStepsReturnToBaseline) {
  Rematerializer r(opts(3 * kMiB));
  const TensorId w = r.add_external(kMiB);
  for (int step = 0; step < 1000; ++step) {
    auto ts = chain(r, w, 8);
    while (r.over_threshold()) r.evict(r.choose_evictee());
    // "backward": the tensors die in reverse order, regenerating as needed.
    for (auto it = ts.rbegin(); it != ts.rend(); ++it) {
      if (r.tensor(*it).state != TensorState::kResident) {
        const TensorId want[] = {*it};
        for (const auto& s : r.regeneration_plan(want)) {
          for (TensorId t : r.on_replayed(s, 0)) {
            if (!r.tensor(t).alive) r.on_storage_dead(t);  // temporaries
          }
        }
      }
      r.on_storage_dead(*it);
    }
    std::vector<TensorId> released_tensors;
    std::vector<OpId> released_ops;
    r.take_released_tensors(&released_tensors);
    r.take_released_ops(&released_ops);
  }
  const auto s = r.stats();
  EXPECT_EQ(s.live_tensors, 1u);  // w
  EXPECT_EQ(s.live_ops, 0u);
  EXPECT_EQ(s.tracked_bytes, 0u);
  EXPECT_EQ(s.fake_deleted, 0u);
  EXPECT_GT(s.evictions, 0u);
  r.validate();
}

TEST(Rematerializer, MultiOutputOpOutlivesOneOfItsOutputs) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const TensorId a = unary(r, x, kMiB);
  std::vector<TensorId> outs;
  const std::size_t two[] = {kMiB, kMiB};
  const TensorId ins[] = {a};
  r.record_op(ins, two, 1e-3, true, &outs);  // (b, c) = g(a)
  r.on_storage_dead(outs[1]);                 // c really deleted at once: nothing reads it
  EXPECT_FALSE(r.contains(outs[1]));
  const TensorId d = unary(r, outs[0], kMiB);  // d reads b
  r.on_storage_dead(a);                        // a fake-deleted: g still live
  r.evict(outs[0]);
  const TensorId want[] = {outs[0]};
  auto plan = r.regeneration_plan(want);
  ASSERT_EQ(plan.size(), 2u);
  r.on_replayed(plan[0], 0);
  EXPECT_EQ(r.on_replayed(plan[1], 0), std::vector<TensorId>{outs[0]});  // c is not brought back
  r.on_storage_dead(a);
  r.on_storage_dead(d);
  r.validate();
  EXPECT_EQ(r.choose_evictee(), outs[0]);
}

TEST(Rematerializer, BackwardTensorsAreLastResortCandidates) {
  Rematerializer r(opts(0, ScorerKind::kLru));
  const TensorId x = r.add_external(kMiB);
  const TensorId grad = gradient(r, x);  // oldest: LRU would pick it
  const TensorId act = unary(r, x, kMiB);
  EXPECT_EQ(r.choose_evictee(), act);
  r.evict(act);
  EXPECT_EQ(r.choose_evictee(), grad);  // nothing else is left
}

TEST(Rematerializer, LastResortCandidatesAreScoredByTheirWholePlan) {
  // Two gradients of one size: g_long reads the end of a chain whose
  // tensors are all dead (bringing it back replays the chain), g_short an
  // input that is resident. g_long is staler, so a score that counts only its
  // own op would pick it.
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const auto ts = chain(r, x, 10);
  const TensorId g_long = gradient(r, ts.back());
  const TensorId g_short = gradient(r, x);
  for (TensorId t : ts) EXPECT_FALSE(r.on_storage_dead(t));  // fake deletion: recipes kept, memory dropped
  r.tick();
  EXPECT_NEAR(r.regeneration_cost(g_long), 11e-3, 1e-12);  // the chain and its own op
  EXPECT_NEAR(r.regeneration_cost(g_short), 1e-3, 1e-12);
  EXPECT_EQ(r.choose_evictee(), g_short);
  r.evict(g_short);
  EXPECT_EQ(r.choose_evictee(), g_long);  // still possible once nothing else is left
  r.validate();
}

TEST(Rematerializer, SettledGradientIsNeitherTrackedNorEvicted) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const TensorId grad = gradient(r, x);
  EXPECT_EQ(r.stats().tracked_bytes, kMiB);
  EXPECT_TRUE(r.settle(grad));
  EXPECT_EQ(r.stats().tracked_bytes, 0u);
  EXPECT_EQ(r.choose_evictee(), kNoTensor);
  r.validate();
  const TensorId act = unary(r, x, kMiB);
  r.evict(act);
  EXPECT_FALSE(r.settle(act));  // evicted: stays an activation
  r.validate();
}

TEST(Rematerializer, SettledGradientLetsGoOfItsRecipe) {
  // A backward op (g, h) = f(a) where a is a dead activation kept for f's
  // sake (fake deletion): once g is settled, only h keeps f, and once h is
  // gone too, f and a are released although g lives on.
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const TensorId a = unary(r, x, kMiB);
  std::vector<TensorId> outs;
  const std::size_t two[] = {kMiB, kMiB};
  const TensorId ins[] = {a};
  r.tick();
  const OpId f = r.record_op(ins, two, 1e-3, true, &outs, /*last_resort=*/true);
  const TensorId g = outs[0], h = outs[1];
  EXPECT_FALSE(r.on_storage_dead(a));
  EXPECT_TRUE(r.contains(a));  // f reads it
  EXPECT_TRUE(r.settle(g));
  EXPECT_TRUE(r.tensor(g).recipe.empty());
  r.validate();
  r.evict(h);  // h still comes back through f
  const TensorId want[] = {h};
  auto plan = r.regeneration_plan(want);
  ASSERT_EQ(plan.size(), 2u);
  r.on_replayed(plan[0], 0);
  EXPECT_EQ(r.on_replayed(plan[1], 0), std::vector<TensorId>{h});  // g is not installed again
  EXPECT_FALSE(r.on_storage_dead(h));
  EXPECT_FALSE(r.contains(a));
  EXPECT_TRUE(r.contains(g));
  std::vector<OpId> released;
  r.take_released_ops(&released);
  EXPECT_NE(std::find(released.begin(), released.end(), f), released.end());
  const auto s = r.stats();
  EXPECT_EQ(s.live_ops, 0u);
  EXPECT_EQ(s.fake_deleted, 0u);
  EXPECT_EQ(s.tracked_bytes, 0u);
  r.validate();
}

TEST(Rematerializer, LockedDeadTensorKeepsMemoryWhileNeeded) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  std::vector<TensorId> out;
  const std::size_t sz[] = {kMiB};
  const TensorId ins[] = {x};
  r.record_op(ins, sz, 1e-3, /*replayable=*/false, &out);  // e.g. an op with side effects
  const TensorId y = unary(r, out[0], kMiB);
  EXPECT_TRUE(r.on_storage_dead(out[0]));  // y's recipe needs it, and it has none
  EXPECT_EQ(r.stats().tracked_bytes, 2 * kMiB);
  r.on_storage_dead(y);
  EXPECT_FALSE(r.contains(out[0]));
  EXPECT_EQ(r.stats().tracked_bytes, 0u);
  r.validate();
}

TEST(Rematerializer, InPlaceUpdateOfUnreadTensorJoinsRecipe) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const TensorId m = unary(r, kNoTensor, kMiB);  // mask = empty_like(...)
  auto plan = r.prepare_mutation(m, true);     // bernoulli_(mask)
  EXPECT_TRUE(plan.chain);
  EXPECT_TRUE(plan.regenerate.empty());
  const TensorId none[] = {x};
  r.commit_mutation(m, none, 1e-3, true, plan);
  EXPECT_EQ(r.tensor(m).recipe.size(), 2u);
  const TensorId y = unary(r, m, kMiB);
  r.evict(m);
  const TensorId want[] = {m};
  auto steps = r.regeneration_plan(want);
  ASSERT_EQ(steps.size(), 2u);
  EXPECT_EQ(steps[0].chained, std::vector<TensorId>{m});
  EXPECT_EQ(r.on_replayed(steps[0], 0), std::vector<TensorId>{m});
  EXPECT_TRUE(r.on_replayed(steps[1], 0).empty());
  (void)y;
  r.validate();
}

TEST(Rematerializer, InPlaceUpdateOfReadTensorLocksDependants) {
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 3);  // a -> b -> c
  r.evict(ts[2]);            // c needs b's current value
  r.on_storage_dead(ts[1]);  // b dead while resident: fake-deleted, memory gone
  // Now a is updated in place: c (evicted) reads a through dead b.
  auto plan = r.prepare_mutation(ts[0], true);
  EXPECT_FALSE(plan.chain);
  EXPECT_EQ(plan.regenerate, std::vector<TensorId>{ts[2]});
  for (const auto& s : r.regeneration_plan(plan.regenerate)) {
    for (TensorId t : r.on_replayed(s, 0)) {
      if (!r.tensor(t).alive) r.on_storage_dead(t);
    }
  }
  r.commit_mutation(ts[0], {}, 0, true, plan);
  EXPECT_TRUE(r.tensor(ts[0]).locked);
  EXPECT_TRUE(r.tensor(ts[2]).locked);
  EXPECT_EQ(r.choose_evictee(), kNoTensor);
  r.validate();
}

TEST(Rematerializer, MutationReadersAreWhatTheCommitLocks) {
  // Note [Evictions while an in-place op runs]: the readers of the target's
  // old value (through dead intermediates too) are pinned while the op runs;
  // the others stay candidates (d reads c, whose value the op leaves alone).
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 4);  // a -> b -> c -> d
  const TensorId other = unary(r, x, kMiB);
  r.on_storage_dead(ts[1]);  // b dead: c reads a through it
  auto plan = r.prepare_mutation(ts[0], true);
  EXPECT_TRUE(plan.regenerate.empty());
  auto readers = r.mutation_readers(ts[0]);
  std::sort(readers.begin(), readers.end());
  EXPECT_EQ(readers, (std::vector<TensorId>{ts[0], ts[2]}));
  for (TensorId t : readers) r.pin(t);
  for (int i = 0; i < 2; ++i) {  // d and other go; a and c stay
    const TensorId e = r.choose_evictee();
    EXPECT_TRUE(e == ts[3] || e == other) << e;
    r.evict(e);
  }
  EXPECT_EQ(r.choose_evictee(), kNoTensor);
  for (TensorId t : readers) r.unpin(t);
  r.commit_mutation(ts[0], {}, 0, true, plan);
  EXPECT_TRUE(r.tensor(ts[0]).locked);
  EXPECT_TRUE(r.tensor(ts[2]).locked);
  EXPECT_FALSE(r.tensor(ts[3]).locked);
  EXPECT_FALSE(r.tensor(other).locked);
  r.validate();
}

TEST(Rematerializer, InPlaceUpdateOfAnEvictedTargetBringsItBackFirst) {
  // Batch norm's running statistics are written without being inputs: an
  // evicted one must come back before the op writes into it.
  Rematerializer r(opts(0));
  const TensorId x = r.add_external(kMiB);
  const TensorId stat = unary(r, x, kMiB);
  r.evict(stat);
  auto plan = r.prepare_mutation(stat, /*op_replayable=*/true);
  EXPECT_FALSE(plan.chain);
  EXPECT_EQ(plan.regenerate, std::vector<TensorId>{stat});
  for (const auto& s : r.regeneration_plan(plan.regenerate)) r.on_replayed(s, 0);
  EXPECT_EQ(r.tensor(stat).state, TensorState::kResident);
  r.commit_mutation(stat, {}, 0, true, plan);
  EXPECT_TRUE(r.tensor(stat).locked);
  r.validate();
}

TEST(Rematerializer, DtrEqPrefersTensorsAwayFromEvictedNeighbours) {
  Rematerializer r(opts(0, ScorerKind::kDtrEq));
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 5);
  r.tick();
  for (TensorId t : ts) r.access(t);  // equally stale, equally costly
  r.evict(ts[1]);
  // ts[0] and ts[2] border the evicted class of ts[1]; ts[3] and ts[4] do
  // not, so one of them is cheaper to lose.
  const TensorId e = r.choose_evictee();
  EXPECT_TRUE(e == ts[3] || e == ts[4]) << e;
  Rematerializer local(opts(0, ScorerKind::kLocal));
  const TensorId lx = local.add_external(kMiB);
  auto lt = chain(local, lx, 5);
  local.evict(lt[1]);
  EXPECT_EQ(local.choose_evictee(), lt[0]);  // local: oldest of equal cost
}

TEST(Rematerializer, SqrtSamplingStillFindsACandidate) {
  DtrOptions o = opts(kMiB);
  o.enable_sqrt_sampling = true;
  Rematerializer r(o);
  const TensorId x = r.add_external(kMiB);
  auto ts = chain(r, x, 100);
  for (int i = 0; i < 99; ++i) r.pin(ts[i]);
  EXPECT_EQ(r.choose_evictee(), ts[99]);  // the only candidate, found by the fallback scan
  for (int i = 0; i < 99; ++i) r.unpin(ts[i]);
  int n = 0;
  while (r.over_threshold()) {
    r.evict(r.choose_evictee());
    ++n;
  }
  EXPECT_EQ(n, 99);
  r.validate();
}

}  // namespace
}  // namespace tidal::dtr
