// The storage runtime driven by hand, as its drivers do: the test runs the
// ops, records them, and replays the plans the runtime returns. References
// are the same ops run without the runtime.
#include "hooks/dtr/storage_runtime.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>
#include <memory>
#include <vector>

#include "runtime/core/error.h"

namespace tidal::hooks::dtr {
namespace {

constexpr std::size_t kKiB = 1024;

tidal::dtr::DtrOptions opts(std::size_t threshold, std::size_t minimum = kKiB) {
  tidal::dtr::DtrOptions o;
  o.eviction_threshold = threshold;
  o.evictee_minimum_size = minimum;
  return o;
}

// The test's recipe: which unary op produced the output.
struct UnaryRecipe final : Recipe {
  explicit UnaryRecipe(at::Tensor (*f)(const at::Tensor&)) : fn(f) {}
  at::Tensor (*fn)(const at::Tensor&);
};

at::Tensor sin_of(const at::Tensor& x) { return at::sin(x); }
at::Tensor exp_of(const at::Tensor& x) { return at::exp(x); }

// Runs y = fn(x) through the runtime as an interceptor would.
at::Tensor run(StorageRuntime& rt, at::Tensor (*fn)(const at::Tensor&), const at::Tensor& x) {
  std::vector<TensorId> ids, missing;
  const at::Tensor inputs[] = {x};
  rt.begin_op(inputs, &ids, &missing);
  EXPECT_TRUE(missing.empty());
  at::Tensor y = fn(x);
  const at::Tensor outputs[] = {y};
  rt.record(inputs, ids, outputs, 1e-3, true, std::make_shared<UnaryRecipe>(fn), false);
  rt.end_op("test.unary");
  return y;
}

// Brings `targets` back by replaying the plan.
void regenerate(StorageRuntime& rt, const std::vector<TensorId>& targets) {
  for (const auto& item : rt.plan(targets)) {
    const auto& r = dynamic_cast<const UnaryRecipe&>(*item.recipe);
    auto inputs = rt.replay_inputs(item.op);
    ASSERT_EQ(inputs.size(), 1u);
    const at::Tensor out = r.fn(inputs[0]);
    inputs.clear();
    const at::Tensor outputs[] = {out};
    rt.replayed(item, outputs, 1e-3);
  }
  rt.end_plan();
}

TEST(StorageRuntime, GivesUpRatherThanThrash) {
  // Note [DTR gives up rather than thrash]: a chain of 10 ops (11 with the
  // one that reads it) whose tensors are evicted after every regeneration of
  // its end: each regeneration replays the 10 ops, and the bound (2 x 11)
  // lets two through and refuses the third before running any of it.
  for (const double ratio : {2.0, 0.0}) {
    auto o = opts(0);
    o.max_recompute_ratio = ratio;
    StorageRuntime rt(o);
    const at::Tensor x = at::randn({64, 64});
    std::vector<at::Tensor> chain{run(rt, sin_of, x)};
    for (int i = 1; i < 10; ++i) chain.push_back(run(rt, sin_of, chain.back()));
    const at::Tensor expected = chain.back().clone();
    std::vector<TensorId> ids, missing;
    const at::Tensor inputs[] = {chain.back()};
    rt.begin_op(inputs, &ids, &missing);  // op 11 reads the chain's end
    rt.end_op("test.read");
    int regenerations = 0;
    try {
      for (; regenerations < 5; ++regenerations) {
        for (const at::Tensor& t : chain) rt.evict_tensor(t);
        regenerate(rt, {rt.lookup(chain.back())});
        EXPECT_TRUE(at::equal(chain.back(), expected));
      }
    } catch (const tidal::OutOfMemoryError& e) {
      const std::string msg = e.what();
      EXPECT_NE(msg.find("30 recomputes, more than max_recompute_ratio=2 x 11 ops"), std::string::npos) << msg;
      EXPECT_NE(msg.find("eviction_threshold=0"), std::string::npos) << msg;
    }
    EXPECT_EQ(regenerations, ratio > 0 ? 2 : 5) << "ratio " << ratio;
    EXPECT_EQ(rt.stats().recomputes, static_cast<std::uint64_t>(10 * regenerations));
    rt.validate();
  }
}

TEST(StorageRuntime, EvictionFreesTheStorageAndReplayRefillsIt) {
  StorageRuntime rt(opts(0));
  const at::Tensor x = at::randn({64, 64});
  at::Tensor y = run(rt, sin_of, x);
  at::Tensor z = run(rt, exp_of, y);
  const at::Tensor y_ref = at::sin(x);
  const at::Tensor z_ref = at::exp(y_ref);
  const at::Tensor y_view = y.view({-1});  // shares y's storage
  rt.evict_tensor(y);
  rt.evict_tensor(z);
  EXPECT_EQ(y.storage().nbytes(), 0u);
  EXPECT_EQ(rt.state_of(rt.lookup(y)), "evicted");
  EXPECT_EQ(rt.tracked_bytes(), 0u);
  rt.validate();
  regenerate(rt, {rt.lookup(z)});
  EXPECT_TRUE(at::equal(z, z_ref));
  EXPECT_EQ(rt.state_of(rt.lookup(z)), "resident");
  // y came back on the way to z and stays: a user still holds it.
  EXPECT_TRUE(rt.evicted_alive().empty());
  EXPECT_TRUE(at::equal(y_view.view({64, 64}), y_ref));  // the same StorageImpl got the data back
  const auto s = rt.stats();
  EXPECT_EQ(s.evictions, 2u);
  EXPECT_EQ(s.recomputes, 2u);  // sin, then exp
  rt.validate();
}

TEST(StorageRuntime, ExternalInputsAreNotTrackedAndNeverEvicted) {
  StorageRuntime rt(opts(0));
  const at::Tensor x = at::randn({64, 64});
  const at::Tensor y = run(rt, sin_of, x);
  EXPECT_EQ(rt.tracked_bytes(), y.nbytes());
  const auto records = rt.records();
  ASSERT_EQ(records.size(), 2u);
  EXPECT_TRUE(records[0].external && records[0].locked);
  EXPECT_THROW(rt.evict_tensor(at::randn({2})), tidal::Error);  // not a record
}

TEST(StorageRuntime, ThresholdEvictsAtTheEndOfEachOp) {
  const at::Tensor x = at::randn({64, 64});  // 16 KiB per tensor
  StorageRuntime rt(opts(40 * kKiB));
  std::vector<at::Tensor> ys;
  at::Tensor h = x;
  for (int i = 0; i < 6; ++i) {
    h = run(rt, i % 2 ? sin_of : exp_of, h);
    ys.push_back(h);
  }
  // Kept: at most the threshold plus the working set of the last op.
  EXPECT_LE(rt.tracked_bytes(), 40 * kKiB + 2 * 16 * kKiB);
  EXPECT_GT(rt.stats().evictions, 0u);
  rt.set_eviction_threshold(0);
  regenerate(rt, rt.evicted_alive());
  at::Tensor ref = x;
  for (int i = 0; i < 6; ++i) {
    ref = i % 2 ? at::sin(ref) : at::exp(ref);
    EXPECT_TRUE(at::equal(ys[static_cast<std::size_t>(i)], ref)) << i;
  }
  rt.validate();
}

TEST(StorageRuntime, DeadTensorReadByALiveOpIsFakeDeleted) {
  StorageRuntime rt(opts(0));
  const at::Tensor x = at::randn({64, 64});
  at::Tensor y = run(rt, sin_of, x);
  const at::Tensor z = run(rt, exp_of, y);
  y.reset();  // the last user reference
  EXPECT_EQ(rt.stats().fake_deleted, 1u);
  rt.evict_tensor(z);
  regenerate(rt, {rt.lookup(z)});  // needs y, which only its recipe can bring back
  EXPECT_TRUE(at::equal(z, at::exp(at::sin(x))));
  rt.validate();
}

TEST(StorageRuntime, OverThresholdWithNothingToEvictNamesTheOp) {
  StorageRuntime rt(opts(20 * kKiB, /*minimum=*/1 << 20));  // nothing is big enough to evict
  const at::Tensor x = at::randn({64, 64});
  const at::Tensor y = run(rt, sin_of, x);
  std::vector<TensorId> ids, missing;
  const at::Tensor inputs[] = {y};
  rt.begin_op(inputs, &ids, &missing);
  const at::Tensor z = at::exp(y);
  const at::Tensor outputs[] = {z};
  rt.record(inputs, ids, outputs, 1e-3, true, std::make_shared<UnaryRecipe>(exp_of), false);
  try {
    rt.end_op("aten.exp.default");
    // y and z are the working set (32 KiB over 20): allowed for this op.
  } catch (const tidal::OutOfMemoryError&) {
    FAIL() << "the running op's working set must be allowed over the threshold";
  }
  // An op that adds nothing did not cause the overrun: it does not raise
  // (Note [One budget error per overrun]).
  rt.begin_op({}, &ids, &missing);
  EXPECT_NO_THROW(rt.end_op("profiler._record_function_exit._RecordFunction"));
  // One that adds 16 KiB does: 48 KiB tracked, 16 KiB of them its working set.
  rt.begin_op({}, &ids, &missing);
  const at::Tensor w = at::zeros({64, 64});
  const at::Tensor fresh[] = {w};
  rt.record({}, {}, fresh, 1e-3, true, nullptr, false);
  try {
    rt.end_op("aten.next.default");
    FAIL() << "expected tidal::OutOfMemoryError";
  } catch (const tidal::OutOfMemoryError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("aten.next.default"), std::string::npos) << msg;
    EXPECT_NE(msg.find("eviction_threshold="), std::string::npos) << msg;
    EXPECT_NE(msg.find("evictee_minimum_size="), std::string::npos) << msg;
    EXPECT_NE(msg.find("at least 32.00 KiB (32768 bytes)"), std::string::npos) << msg;
  }
}

// Chunks of `chunk` bytes that leave at `seconds_per_byte`, each raising
// the runtime's threshold by its bytes, as the engine's arbiter does.
class FakeArbiter final : public ChunkArbiter {
 public:
  FakeArbiter(StorageRuntime& rt, double seconds_per_byte, std::size_t chunk, int chunks)
      : rt_(rt), cost_(seconds_per_byte), chunk_(chunk), left_(chunks) {
    rt_.set_arbiter(this);
  }
  ~FakeArbiter() override { rt_.set_arbiter(nullptr); }
  double chunk_seconds_per_byte() const override {
    return left_ > 0 ? cost_ : std::numeric_limits<double>::infinity();
  }
  std::size_t evict_chunk() override {
    if (left_ == 0) return 0;
    --left_;
    ++evicted;
    rt_.set_eviction_threshold(rt_.options().eviction_threshold + chunk_);
    return chunk_;
  }
  int evicted = 0;

 private:
  StorageRuntime& rt_;
  double cost_;
  std::size_t chunk_;
  int left_;
};

// Six 16 KiB activations of 1 ms each (about 6e-8 s per byte) over a 40 KiB threshold.
std::vector<at::Tensor> six_activations(StorageRuntime& rt, const at::Tensor& x) {
  std::vector<at::Tensor> ys;
  at::Tensor h = x;
  for (int i = 0; i < 6; ++i) ys.push_back(h = run(rt, i % 2 ? sin_of : exp_of, h));
  return ys;
}

TEST(StorageRuntime, ArbiterMovesAChunkWhenItsRoundTripCostsLessPerByte) {
  StorageRuntime rt(opts(40 * kKiB));
  FakeArbiter arbiter(rt, /*seconds_per_byte=*/1e-9, 64 * kKiB, /*chunks=*/4);
  const at::Tensor x = at::randn({64, 64});
  const auto ys = six_activations(rt, x);
  const auto s = rt.stats();
  EXPECT_EQ(s.evictions, 0u);  // every eviction went to a chunk
  EXPECT_GT(arbiter.evicted, 0);
  EXPECT_EQ(s.chunk_evictions, static_cast<std::uint64_t>(arbiter.evicted));
  EXPECT_EQ(s.chunk_bytes_freed, static_cast<std::size_t>(arbiter.evicted) * 64 * kKiB);
  EXPECT_LE(rt.tracked_bytes(), rt.options().eviction_threshold + 2 * 16 * kKiB);
}

TEST(StorageRuntime, ArbiterEvictsActivationsWhenTheyAreCheaperToRecompute) {
  StorageRuntime rt(opts(40 * kKiB));
  FakeArbiter arbiter(rt, /*seconds_per_byte=*/1e-5, 64 * kKiB, /*chunks=*/4);
  const at::Tensor x = at::randn({64, 64});
  const auto ys = six_activations(rt, x);
  EXPECT_GT(rt.stats().evictions, 0u);
  EXPECT_EQ(arbiter.evicted, 0);
  EXPECT_LE(rt.tracked_bytes(), 40 * kKiB + 2 * 16 * kKiB);
}

TEST(StorageRuntime, ArbiterFallsBackToActivationsOnceNoChunkCanLeave) {
  StorageRuntime rt(opts(40 * kKiB));
  FakeArbiter arbiter(rt, /*seconds_per_byte=*/1e-9, 16 * kKiB, /*chunks=*/1);
  const at::Tensor x = at::randn({64, 64});
  const auto ys = six_activations(rt, x);
  EXPECT_EQ(arbiter.evicted, 1);
  EXPECT_GT(rt.stats().evictions, 0u);
  EXPECT_LE(rt.tracked_bytes(), rt.options().eviction_threshold + 2 * 16 * kKiB);
}

}  // namespace
}  // namespace tidal::hooks::dtr
