// The C++ interception of tidal.dtr without Python: real aten ops and C++
// autograd run through the fallback on DispatchKey::Fake. References are
// the same computations with no session.
#include "hooks/dtr/interceptor.h"

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/library.h>

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "runtime/core/error.h"

namespace tidal::hooks::dtr {
namespace {

constexpr std::size_t kKiB = 1024;

tidal::dtr::DtrOptions opts(std::size_t threshold) {
  tidal::dtr::DtrOptions o;
  o.eviction_threshold = threshold;
  o.evictee_minimum_size = kKiB;
  return o;
}

// Activates a session for one test and always deactivates it.
class Active {
 public:
  explicit Active(Session& s) : s_(s) { s_.activate(); }
  ~Active() { s_.deactivate(); }

 private:
  Session& s_;
};

struct Mlp {
  std::vector<at::Tensor> w;
  explicit Mlp(int layers) {
    at::manual_seed(0);
    for (int i = 0; i < layers; ++i) w.push_back((at::randn({64, 64}) * 0.1).set_requires_grad(true));
  }
  at::Tensor loss(const at::Tensor& x) const {
    at::Tensor h = x;
    for (const auto& wi : w) h = at::tanh(at::mm(h, wi));
    return h.square().mean();
  }
  std::vector<at::Tensor> grads(const at::Tensor& x) const {
    at::Tensor l = loss(x);
    return torch::autograd::grad({l}, w);
  }
};

TEST(DtrInterceptor, TheKeyIsFreeAndOursOnceActive) {
  EXPECT_EQ(interception_status(), "");
  Session s(opts(0));
  {
    Active on(s);
    EXPECT_TRUE(c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(c10::DispatchKey::Fake));
    EXPECT_TRUE(s.active());
    EXPECT_EQ(interception_status(), "");  // our own fallback does not count against us
  }
  EXPECT_FALSE(s.active());
}

// An engine's side as the session sees it (hooks/engine_dtr.h): an arbiter,
// and the sessions it was told route ops.
class CheapChunks final : public ChunkArbiter {
 public:
  double chunk_seconds_per_byte() const override {
    return left > 0 ? 1e-12 : std::numeric_limits<double>::infinity();
  }
  std::size_t evict_chunk() override {
    if (left == 0) return 0;
    --left;
    ++evicted;
    session->set_eviction_threshold(threshold += 64 * kKiB);  // the room the chunk left
    return 64 * kKiB;
  }
  Session* session = nullptr;
  std::size_t threshold = 0;
  int left = 0;
  int evicted = 0;
};

class FakeEngine final : public ParamProvider {
 public:
  explicit FakeEngine(std::weak_ptr<ChunkArbiter> arbiter) : arbiter_(std::move(arbiter)) {}
  std::int64_t alias(const at::Tensor&) override { return -1; }
  at::Tensor view(std::int64_t, at::IntArrayRef, at::IntArrayRef, std::int64_t) override {
    TIDAL_THROW(InternalError, "no parameters here");
  }
  void end_replay_step() override {}
  std::uint64_t weights_epoch() const override { return 0; }
  std::string param_name(std::int64_t) const override { return "none"; }
  std::weak_ptr<ChunkArbiter> arbiter() const override { return arbiter_; }
  void session_changed(ActivationRoom* routing) override {
    told.push_back(routing == nullptr ? "none" : routing == expected ? "it" : "another");
  }
  ActivationRoom* expected = nullptr;
  std::vector<std::string> told;

 private:
  std::weak_ptr<ChunkArbiter> arbiter_;
};

TEST(DtrInterceptor, ASessionTellsItsEnginesWhileItRoutesOpsWithNoGlobal) {
  auto a = std::make_shared<FakeEngine>(std::weak_ptr<ChunkArbiter>());
  auto b = std::make_shared<FakeEngine>(std::weak_ptr<ChunkArbiter>());
  {
    Session s(opts(0));
    a->expected = b->expected = &s;
    s.add_provider(a);
    EXPECT_TRUE(a->told.empty());  // not routing yet
    s.activate();
    s.add_provider(b);  // joins a session already routing
    s.deactivate();
    EXPECT_EQ(a->told, (std::vector<std::string>{"it", "none"}));
    EXPECT_EQ(b->told, (std::vector<std::string>{"it", "none"}));
    s.activate();
    s.remove_provider(a.get());
    EXPECT_EQ(a->told, (std::vector<std::string>{"it", "none", "it", "none"}));
    Session idle(opts(0));  // (not routing: it tells nothing)
    auto c = std::make_shared<FakeEngine>(std::weak_ptr<ChunkArbiter>());
    idle.add_provider(c);
    idle.remove_provider(c.get());
    EXPECT_TRUE(c->told.empty());
  }  // destroyed while routing
  EXPECT_EQ(b->told, (std::vector<std::string>{"it", "none", "it", "none"}));
}

// Note [The arbiter between chunks and activations]: the session asks the
// arbiters of the engines registered with it, the cheapest first, and one
// whose engine is gone is skipped.
TEST(DtrInterceptor, EvictionsGoToARegisteredEnginesChunksWhileTheyAreCheaper) {
  Session s(opts(40 * kKiB));
  auto cheap = std::make_shared<CheapChunks>();
  cheap->session = &s;
  cheap->threshold = 40 * kKiB;
  cheap->left = 2;
  auto gone = std::make_shared<CheapChunks>();
  gone->left = 100;
  auto engine = std::make_shared<FakeEngine>(cheap);
  s.add_provider(std::make_shared<FakeEngine>(gone));
  gone.reset();  // that engine is collected: its arbiter must not be asked
  s.add_provider(engine);
  std::vector<at::Tensor> ys;
  {
    Active on(s);
    at::Tensor h = at::randn({64, 64});
    // 16 KiB kept per round: 256 KiB past 40 KiB and the 128 KiB two chunks free.
    for (int i = 0; i < 16; ++i) ys.push_back(h = at::tanh(h) * 1.5);
  }
  EXPECT_EQ(cheap->evicted, 2);  // both chunks went before any activation
  const RuntimeStats st = s.with_runtime([](StorageRuntime& rt) { return rt.stats(); });
  EXPECT_EQ(st.chunk_evictions, 2u);
  EXPECT_GT(st.evictions, 0u);  // then activations
  s.regenerate_evicted();
}


TEST(DtrInterceptor, GradientsAreBitwiseEqualWithForcedEvictions) {
  const Mlp mlp(8);
  const at::Tensor x = at::randn({256, 64});  // 64 KiB activations
  const auto ref = mlp.grads(x);
  Session s(opts(200 * kKiB));
  std::vector<at::Tensor> got;
  {
    Active on(s);
    got = mlp.grads(x);
    s.regenerate_evicted();
  }
  const auto st = s.with_runtime([](StorageRuntime& r) { return r.stats(); });
  EXPECT_GT(st.evictions, 0u);
  EXPECT_GT(st.recomputes, 0u);
  ASSERT_EQ(got.size(), ref.size());
  for (std::size_t i = 0; i < ref.size(); ++i) EXPECT_TRUE(at::equal(got[i], ref[i])) << "layer " << i;
  s.with_runtime([](StorageRuntime& r) { r.validate(); });
}

TEST(DtrInterceptor, OnlyTheActivatingThreadIsIntercepted) {
  Session s(opts(0));
  const at::Tensor x = at::randn({64, 64});
  Active on(s);
  const auto before = s.with_runtime([](StorageRuntime& r) { return r.records().size(); });
  std::thread other([&] { (void)at::sin(x); });
  other.join();
  EXPECT_EQ(s.with_runtime([](StorageRuntime& r) { return r.records().size(); }), before);
  const at::Tensor y = at::sin(x);
  EXPECT_NE(s.with_runtime([&](StorageRuntime& r) { return r.lookup(y); }), tidal::dtr::kNoTensor);
  EXPECT_EQ(s.last_op(), "aten.sin.default");
}

TEST(DtrInterceptor, OutsideGuardKeepsOpsOut) {
  Session s(opts(0));
  const at::Tensor x = at::randn({64, 64});
  Active on(s);
  at::Tensor y;
  {
    OutsideGuard outside;
    y = at::sin(x);
  }
  EXPECT_EQ(s.with_runtime([&](StorageRuntime& r) { return r.lookup(y); }), tidal::dtr::kNoTensor);
}

TEST(DtrInterceptor, EvictedTensorsComeBackOnUseWithViewsAndInPlaceUpdates) {
  Session s(opts(0));
  const at::Tensor x = at::randn({64, 64});
  Active on(s);
  at::Tensor y = at::sin(x);
  y.mul_(2.0);                    // joins y's recipe (nothing read y yet)
  const at::Tensor v = y.t();     // a view of y's storage
  s.with_runtime([&](StorageRuntime& r) { r.evict_tensor(y); });
  EXPECT_EQ(y.storage().nbytes(), 0u);
  const at::Tensor z = at::cos(v);  // needs y back
  const at::Tensor y_ref = at::sin(x) * 2.0;
  EXPECT_TRUE(at::equal(y, y_ref));
  EXPECT_TRUE(at::equal(z, at::cos(y_ref.t())));
  s.with_runtime([](StorageRuntime& r) { r.validate(); });
}

TEST(DtrInterceptor, RandomOpsReplayTheirGeneratorState) {
  Session s(opts(0));
  at::manual_seed(7);
  const at::Tensor x = at::randn({64, 64});
  Active on(s);
  const at::Tensor y = at::dropout(x, 0.5, /*train=*/true);
  const at::Tensor y_ref = y.clone();
  const at::Tensor after = at::rand({4});  // the generator moved on
  s.with_runtime([&](StorageRuntime& r) { r.evict_tensor(y); });
  EXPECT_TRUE(at::equal(at::add(y, 0), y_ref));  // replayed with the saved generator state
  at::manual_seed(7);
  (void)at::randn({64, 64});
  (void)at::dropout(x, 0.5, true);
  EXPECT_TRUE(at::equal(at::rand({4}), after));  // and the generator was put back
}

std::atomic<int> g_flaky_failures{0};

at::Tensor flaky_double(const at::Tensor& x) {
  if (g_flaky_failures.load() > 0) {
    --g_flaky_failures;
    TORCH_CHECK_WITH(OutOfMemoryError, false, "simulated allocation failure");
  }
  return x * 2;
}

TORCH_LIBRARY(tidal_dtr_test, m) { m.def("flaky_double(Tensor x) -> Tensor"); }
TORCH_LIBRARY_IMPL(tidal_dtr_test, CPU, m) { m.impl("flaky_double", &flaky_double); }

TEST(DtrInterceptor, AllocationFailureEvictsAndRetries) {
  auto op = c10::Dispatcher::singleton()
                .findSchemaOrThrow("tidal_dtr_test::flaky_double", "")
                .typed<at::Tensor(const at::Tensor&)>();
  Session s(opts(0));  // no threshold: only failures evict
  const at::Tensor x = at::randn({64, 64});
  Active on(s);
  std::vector<at::Tensor> keep = {at::exp(x), at::sin(x), at::cos(x)};
  g_flaky_failures = 2;
  const at::Tensor y = op.call(x);
  EXPECT_EQ(g_flaky_failures.load(), 0);
  EXPECT_EQ(s.with_runtime([](StorageRuntime& r) { return r.stats().evictions; }), 2u);
  EXPECT_TRUE(at::equal(y, x * 2));
  g_flaky_failures = 100;  // every candidate goes, then the error surfaces
  EXPECT_THROW(op.call(x), c10::OutOfMemoryError);
  g_flaky_failures = 0;
  s.regenerate_evicted();
  EXPECT_TRUE(at::equal(keep[0], at::exp(x)));
  EXPECT_TRUE(at::equal(keep[2], at::cos(x)));
}

}  // namespace
}  // namespace tidal::hooks::dtr
