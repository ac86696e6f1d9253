// The parts of ModuleHooks that own state of their own and need no scheduler
// (hooks/module_hooks.h): the chunks in use, the gradients' measures and the
// writes to the parameters. ModuleHooks itself is driven from Python
// (tests/python/test_engine*.py).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "chunk/chunk_store.h"
#include "hooks/chunks_in_use.h"
#include "hooks/grad_norms.h"
#include "hooks/write_tracker.h"

namespace tidal::hooks {
namespace {

TEST(ChunksInUse, CountsAChunkOnceWhileAnyParameterHoldsIt) {
  ChunkStore store({.chunk_bytes = 1024});
  store.register_tensor("a", 300);
  store.register_tensor("b", 100);  // shares chunk 0 with a
  store.register_tensor("c", 300);  // chunk 1
  ChunksInUse chunks(&store);
  EXPECT_FALSE(chunks.in_use(0));
  chunks.add(0);
  chunks.add(0);
  EXPECT_EQ(chunks.bytes(), 1024u);
  chunks.add(1);
  EXPECT_EQ(chunks.bytes(), 2048u);
  chunks.remove(0);
  EXPECT_TRUE(chunks.in_use(0));
  EXPECT_EQ(chunks.bytes(), 2048u);
  chunks.remove(0);
  chunks.remove(1);
  EXPECT_FALSE(chunks.in_use(0));
  EXPECT_EQ(chunks.bytes(), 0u);
  EXPECT_EQ(chunks.peak_bytes(), 2048u);
  chunks.add(1);
  chunks.clear();
  EXPECT_EQ(chunks.bytes(), 0u);
  EXPECT_FALSE(chunks.in_use(1));
  EXPECT_EQ(chunks.peak_bytes(), 2048u);  // kept across clear and reset
  chunks.reset(&store);
  EXPECT_EQ(chunks.peak_bytes(), 2048u);
}

TEST(GradNorms, SumsTheSquaresOfEachParametersLastMeasure) {
  c10::NoGradGuard no_grad;
  GradNorms norms;
  for (int i = 0; i < 3; ++i) norms.add_param();
  norms.measure(0, at::full({4}, 1.0f));                         // 4
  norms.measure(1, at::full({2}, 3.0f, at::kHalf));              // 18
  norms.measure(2, at::full({2, 3}, 2.0f).t());                  // 24, through torch's norm
  norms.measure(0, at::full({4}, 2.0f));                         // replaces the 4 by 16
  const GradNorm n = norms.take();
  EXPECT_NEAR(n.sum_squares, 16.0 + 18.0 + 24.0, 1e-4);
  EXPECT_TRUE(n.finite);
  const GradNorm empty = norms.take();  // a take starts over
  EXPECT_EQ(empty.sum_squares, 0.0);
  EXPECT_TRUE(empty.finite);
}

TEST(GradNorms, SeesANonFiniteGradientAndSumsOfAccumulation) {
  c10::NoGradGuard no_grad;
  GradNorms norms;
  for (int i = 0; i < 3; ++i) norms.add_param();
  norms.measure(0, at::full({2}, std::numeric_limits<float>::infinity()));
  norms.measure(1, at::full({2}, 3.0f));
  GradNorm n = norms.take();
  EXPECT_FALSE(n.finite);
  norms.measure(1, at::full({2}, 1.0f));
  norms.measure(0, at::full({2}, 3.0f));          // an fp32 sum
  norms.measure(2, at::full({2, 2}, 1.0f).t());  // not contiguous: torch's norm, as on a GPU
  n = norms.take();
  EXPECT_TRUE(n.finite);
  EXPECT_NEAR(n.sum_squares, 2.0 + 18.0 + 4.0, 1e-5);
  norms.measure(0, at::full({2}, 5.0f));
  norms.clear();
  EXPECT_EQ(norms.take().sum_squares, 0.0);
}

TEST(GradNorms, AddsInParameterOrderWhateverOrderTheMeasuresCameIn) {
  // Note [Gradient norms as they land]: the clip factor must be the same bits
  // whichever parameters backward measured and which the step did. Squares
  // whose double sum depends on the order of the additions: 1 + 3 x 2^-54
  // is 1 with the 1 first and 1 + 2^-52 with it last.
  c10::NoGradGuard no_grad;
  const float small = std::ldexp(1.0f, -27);  // its square 2^-54
  const std::vector<float> values{1.0f, small, small, small};
  const std::vector<std::vector<std::size_t>> orders{{0, 1, 2, 3}, {3, 2, 1, 0}, {1, 2, 3, 0}, {2, 0, 3, 1}};
  std::vector<double> sums;
  for (const auto& order : orders) {
    GradNorms norms;
    for (std::size_t i = 0; i < values.size(); ++i) norms.add_param();
    for (std::size_t i : order) norms.measure(i, at::full({1}, values[i]));
    sums.push_back(norms.take().sum_squares);
  }
  for (double s : sums) EXPECT_EQ(s, sums[0]);
  EXPECT_EQ(sums[0], 1.0);  // 1 first, as parameter 0
}

TEST(WriteTracker, TellsWrittenFromLostAndForgetsWhatWasTaken) {
  c10::NoGradGuard no_grad;
  at::Tensor p = at::zeros({4});
  WriteTracker writes;
  writes.add(p);
  ParamWrites out;
  writes.take(0, out);
  EXPECT_TRUE(out.written.empty() && out.lost.empty());

  writes.attached(0, p);
  p.add_(1);  // while attached to its slot: the slot has it
  writes.detaching(0, p, /*on_slot=*/true);
  out = {};
  writes.take(0, out);
  EXPECT_EQ(out.written, std::vector<std::size_t>{0});
  EXPECT_TRUE(out.lost.empty());

  p.add_(1);  // while detached: nothing holds it
  writes.attached(0, p);
  writes.detaching(0, p, /*on_slot=*/true);
  out = {};
  writes.take(0, out);
  EXPECT_TRUE(out.written.empty());
  EXPECT_EQ(out.lost, std::vector<std::size_t>{0});

  writes.attached(0, p);
  p.add_(1);  // on a weight made from the master
  writes.detaching(0, p, /*on_slot=*/false);
  out = {};
  writes.take(0, out);
  EXPECT_EQ(out.lost, std::vector<std::size_t>{0});
}

TEST(WriteTracker, ALandingOverwritesWhatTheSlotHeldAndSeenForgets) {
  c10::NoGradGuard no_grad;
  at::Tensor p = at::zeros({4});
  WriteTracker writes;
  writes.add(p);
  writes.attached(0, p);
  p.add_(1);
  writes.landing(0, p, /*on_slot=*/true);  // the gradient overwrites the write
  ParamWrites out;
  writes.take(0, out);
  EXPECT_EQ(out.lost, std::vector<std::size_t>{0});

  p.add_(1);
  writes.look(0, p, /*attached=*/true, /*on_slot=*/true);
  out = {};
  writes.take(0, out);
  EXPECT_EQ(out.written, std::vector<std::size_t>{0});

  p.add_(1);
  writes.seen(0, p, /*attached=*/true, /*forget=*/true);
  writes.look(0, p, /*attached=*/true, /*on_slot=*/true);
  out = {};
  writes.take(0, out);
  EXPECT_TRUE(out.written.empty() && out.lost.empty());
}

}  // namespace
}  // namespace tidal::hooks
