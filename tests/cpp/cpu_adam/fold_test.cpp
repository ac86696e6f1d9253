// CPU Adam: fold_gradients(), gradient accumulation's pass over a chunk (Note
// [Gradient sums in chunks] in cpu_adam/adam.h), on every runnable target
// against the definition written out element by element here.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/float16.h"
#include "cpu_adam/reference.h"
#include "runtime/core/error.h"
#include "tests/cpp/cpu_adam/adam_test_util.h"

namespace tidal::cpu_adam {
namespace {

using namespace test_util;  // NOLINT: test helpers

struct FoldData {
  DType half_dtype;
  std::vector<float> sum, master;
  std::vector<std::uint8_t> half;

  FoldData(DType t, std::size_t n, std::uint32_t seed)
      : half_dtype(t), sum(n), master(n), half(n * dtype_size(t)) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] = 100.0f * normal(rng);
      master[i] = normal(rng);
      encode(t, half.data(), i, 1000.0f * normal(rng));
    }
  }
  FoldSpan span(std::size_t offset, std::size_t count, bool first) {
    return FoldSpan{sum.data() + offset, half.data() + offset * dtype_size(half_dtype),
                    master.data() + offset, count, first};
  }
};

// One span of a test's fold, by offset into its FoldData.
struct FoldRange {
  std::size_t offset, count;
  bool first;
};

// The definition: sum = (first ? 0 : sum) + widen(half); half = round(master).
void expect_folded(const FoldData& before, const FoldData& after, std::size_t offset,
                   std::size_t count, bool first, const std::string& what) {
  const DType t = before.half_dtype;
  for (std::size_t i = offset; i < offset + count; ++i) {
    const float g = decode(t, before.half.data(), i);
    const float want = first ? g : before.sum[i] + g;
    ASSERT_EQ(std::memcmp(&after.sum[i], &want, 4), 0)
        << what << " sum at " << i << ": " << after.sum[i] << " vs " << want;
    if (t == DType::kFloat32) {
      ASSERT_EQ(std::memcmp(after.half.data() + 4 * i, &before.master[i], 4), 0) << what << " at " << i;
    } else {
      std::uint16_t bits;
      std::memcpy(&bits, after.half.data() + 2 * i, 2);
      const std::uint16_t want_bits =
          t == DType::kFloat16 ? f32_to_f16_rne(before.master[i]) : f32_to_bf16_rne(before.master[i]);
      ASSERT_EQ(bits, want_bits) << what << " half at " << i;
    }
  }
}

TEST(FoldGradients, EveryTargetAddsOrWritesTheSumsAndRoundsTheMastersBack) {
  TargetGuard guard;
  const std::size_t numel = 2 * kBlockElements + 777;
  // Odd offsets and lengths, one across a block boundary, an empty span.
  const std::vector<FoldRange> ranges = {{1, 7, false}, {9, 33, true}, {100, kBlockElements + 5, false},
                                 {kBlockElements + 200, 0, true}, {numel - 1001, 1001, true}};
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (DType t : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      FoldData got(t, numel, 3);
      const FoldData before = got;
      std::vector<FoldSpan> spans;
      for (const FoldRange& r : ranges) spans.push_back(got.span(r.offset, r.count, r.first));
      fold_gradients(t, spans);
      const std::string what = target + ", " + dtype_name(t);
      std::vector<bool> inside(numel, false);
      for (const FoldRange& r : ranges) {
        expect_folded(before, got, r.offset, r.count, r.first, what);
        for (std::size_t i = r.offset; i < r.offset + r.count; ++i) inside[i] = true;
      }
      const std::size_t hs = dtype_size(t);
      for (std::size_t i = 0; i < numel; ++i) {
        if (inside[i]) continue;
        ASSERT_EQ(std::memcmp(&got.sum[i], &before.sum[i], 4), 0) << what << " wrote sum " << i;
        ASSERT_EQ(std::memcmp(got.half.data() + hs * i, before.half.data() + hs * i, hs), 0)
            << what << " wrote half " << i;
      }
    }
  }
}

TEST(FoldGradients, WithoutAMasterEveryTargetLeavesTheGradientInTheHalfBuffer) {
  // (Note [The weights' image instead of the restore] in hooks/gradient_sums.h.)
  TargetGuard guard;
  const std::size_t numel = 2 * kBlockElements + 777;
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (DType t : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      for (const bool first : {false, true}) {
        FoldData got(t, numel, 4);
        const FoldData before = got;
        FoldSpan s = got.span(3, numel - 5, first);
        s.master = nullptr;
        fold_gradients(t, {&s, 1});
        const std::string what = target + ", " + dtype_name(t) + (first ? ", first" : "");
        for (std::size_t i = 0; i < numel; ++i) {
          const bool inside = i >= 3 && i < numel - 2;
          const float g = decode(t, before.half.data(), i);
          const float want = !inside ? before.sum[i] : first ? g : before.sum[i] + g;
          ASSERT_EQ(std::memcmp(&got.sum[i], &want, 4), 0) << what << " sum at " << i;
        }
        ASSERT_EQ(got.half, before.half) << what << ": the gradients were overwritten";
        ASSERT_EQ(got.master, before.master) << what;
      }
    }
  }
}

TEST(FoldGradients, InfAndNaNGradientsReachTheSums) {
  // fp16's overflow check happens at the step, on the sums: a non-finite
  // micro-batch gradient must survive the fold.
  FoldData d(DType::kFloat16, 64, 5);
  encode(DType::kFloat16, d.half.data(), 3, std::numeric_limits<float>::infinity());
  encode(DType::kFloat16, d.half.data(), 40, std::numeric_limits<float>::quiet_NaN());
  const FoldSpan s = d.span(0, 64, false);
  fold_gradients(DType::kFloat16, {&s, 1});
  EXPECT_TRUE(std::isinf(d.sum[3]));
  EXPECT_TRUE(std::isnan(d.sum[40]));
}

TEST(FoldGradients, ResultsDoNotDependOnTheThreadCount) {
  const std::size_t numel = 5 * kBlockElements + 3;
  FoldData a(DType::kBFloat16, numel, 8);
  FoldData b = a;
  const FoldSpan sa = a.span(0, numel, false);
  const FoldSpan sb = b.span(0, numel, false);
  fold_gradients(DType::kBFloat16, {&sa, 1}, ExecOptions{1});
  fold_gradients(DType::kBFloat16, {&sb, 1}, ExecOptions{0});
  EXPECT_EQ(a.sum, b.sum);
  EXPECT_EQ(a.half, b.half);
}

TEST(FoldGradients, AMeasuringFoldGivesEachSpanTheStatsOfItsNewSums) {
  // Note [Measured in the fold] in python/tidal/engine/overlap.py: the
  // measure a fold makes is bitwise what grad_stats finds on the sums it
  // wrote, on every target, whatever the spans' offsets and lengths; and
  // close to the scalar reference, which sums in element order.
  TargetGuard guard;
  const std::size_t numel = 3 * kBlockElements + 999;
  const std::vector<FoldRange> ranges = {{1, 7, false},
                                 {9, kBlockElements + 33, true},
                                 {kBlockElements + 100, 0, true},
                                 {kBlockElements + 200, 2 * kBlockElements - 300, false},
                                 {numel - 99, 99, true}};
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (DType t : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      for (const bool restore : {true, false}) {
        FoldData got(t, numel, 11);
        FoldData plain = got;
        std::vector<FoldSpan> spans, plain_spans;
        for (const FoldRange& r : ranges) {
          spans.push_back(got.span(r.offset, r.count, r.first));
          plain_spans.push_back(plain.span(r.offset, r.count, r.first));
          if (!restore) spans.back().master = plain_spans.back().master = nullptr;
        }
        std::vector<GradStats> stats(spans.size(), GradStats{false, -1.0});
        fold_gradients(t, spans, ExecOptions{0}, stats);
        fold_gradients(t, plain_spans);
        const std::string what = target + ", " + dtype_name(t) + (restore ? "" : ", no master");
        ASSERT_EQ(got.sum, plain.sum) << what << ": measuring changed the sums";
        ASSERT_EQ(got.half, plain.half) << what << ": measuring changed the 16-bit buffer";
        for (std::size_t i = 0; i < ranges.size(); ++i) {
          const GradSpan g{got.sum.data() + ranges[i].offset, ranges[i].count};
          const GradStats want = grad_stats(DType::kFloat32, {&g, 1});
          const double ref =
              reference::grad_stats(DType::kFloat32, got.sum.data() + ranges[i].offset, ranges[i].count)
                  .sum_squares;
          EXPECT_EQ(stats[i].finite, want.finite) << what << ", span " << i;
          EXPECT_EQ(std::memcmp(&stats[i].sum_squares, &want.sum_squares, sizeof(double)), 0)
              << what << ", span " << i << ": " << stats[i].sum_squares << " vs grad_stats "
              << want.sum_squares;
          EXPECT_NEAR(stats[i].sum_squares, ref, 2e-5 * ref) << what << ", span " << i;
        }
        EXPECT_EQ(stats[2].sum_squares, 0.0) << what << ": the empty span";
        EXPECT_GT(stats[1].sum_squares, 0.0) << what;
      }
    }
  }
}

TEST(FoldGradients, AMeasureDoesNotDependOnTheThreadCountAndSeesANonFiniteSum) {
  const std::size_t numel = 5 * kBlockElements + 3;
  FoldData a(DType::kFloat16, numel, 12);
  encode(DType::kFloat16, a.half.data(), 4 * kBlockElements + 1, std::numeric_limits<float>::infinity());
  FoldData b = a;
  const FoldSpan sa[2] = {a.span(0, 2 * kBlockElements, false), a.span(2 * kBlockElements, numel - 2 * kBlockElements, false)};
  const FoldSpan sb[2] = {b.span(0, 2 * kBlockElements, false), b.span(2 * kBlockElements, numel - 2 * kBlockElements, false)};
  std::vector<GradStats> one(2), all(2);
  fold_gradients(DType::kFloat16, sa, ExecOptions{1}, one);
  fold_gradients(DType::kFloat16, sb, ExecOptions{0}, all);
  EXPECT_TRUE(one[0].finite);
  EXPECT_FALSE(one[1].finite) << "an inf gradient folded into the second span's sums";
  for (int i = 0; i < 2; ++i) {
    EXPECT_EQ(one[i].finite, all[i].finite);
    EXPECT_EQ(std::memcmp(&one[i].sum_squares, &all[i].sum_squares, sizeof(double)), 0) << i;
  }
}

TEST(FoldGradients, StatsForAnotherNumberOfSpansIsAValueError) {
  FoldData d(DType::kBFloat16, 64, 13);
  const FoldSpan s[2] = {d.span(0, 32, false), d.span(32, 32, false)};
  std::vector<GradStats> stats(1);
  const FoldData before = d;
  try {
    fold_gradients(DType::kBFloat16, s, ExecOptions{}, stats);
    FAIL() << "no ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.message()).find("1 stats for 2 spans"), std::string::npos) << e.message();
  }
  EXPECT_EQ(d.sum, before.sum) << "a refused fold wrote the sums";
}

TEST(FoldGradients, ASpanWithoutBuffersIsAValueError) {
  FoldSpan s{nullptr, nullptr, nullptr, 10, false};
  try {
    fold_gradients(DType::kFloat16, {&s, 1});
    FAIL() << "no ValueError";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.message()).find("fold span 0"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace tidal::cpu_adam
