// CPU Adam: streaming stores of the param copy (Note [Streaming the param
// copy]) on every runnable target at awkward lengths and misalignments, and
// adam_chunk_step(), the chunk engine's one-call step, against the scalar
// reference range by range.
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

// Streamed and cached copies are the same values, and both match the
// reference, for every head/tail split the alignment peel can produce.
TEST(AdamStreaming, EveryTargetStreamsTheCopyBitwiseLikeTheCachedPathAtAnyAlignment) {
  TargetGuard guard;
  const std::size_t lengths[] = {1, 7, 16, 17, 31, 33, 64, 65, 1000, 4099};
  const std::size_t offsets[] = {0, 1, 2, 3, 5, 7, 8, 13, 16, 17};
  const AdamHyperParams h = non_default_hyper(true, true);
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (const AdamDTypes& d : all_dtype_combos()) {
      if (!d.param_copy) continue;
      for (std::size_t n : lengths) {
        for (std::size_t off : offsets) {
          SpanData streamed(d, n, off, static_cast<std::uint32_t>(n * 31 + off));
          SpanData cached = streamed;
          SpanData want = streamed;
          for (std::int64_t step = 1; step <= 2; ++step) {
            for (SpanData* s : {&streamed, &cached, &want}) {
              s->set_grads(static_cast<std::uint32_t>(200 + step), static_cast<float>(kLossScale));
            }
            const AdamSpan a = streamed.span(step);
            const AdamSpan b = cached.span(step);
            adam_update(h, d, {&a, 1}, kGradScale, ExecOptions{0, CopyStores::kStream});
            adam_update(h, d, {&b, 1}, kGradScale, ExecOptions{0, CopyStores::kCache});
            reference::adam_update(h, d, want.span(step), kGradScale);
          }
          ASSERT_TRUE(same_bytes(streamed, cached))
              << "target " << target << ", " << describe(d) << ", n " << n << ", offset " << off;
          ASSERT_TRUE(span_close(streamed, want))
              << "target " << target << ", " << describe(d) << ", n " << n << ", offset " << off;
          // Nothing after the span was written (the copy's sentinel survives).
          for (std::size_t i = (off + n) * 2; i < streamed.copy.size(); ++i) {
            ASSERT_EQ(streamed.copy[i], 0xAB) << "wrote past the span";
          }
        }
      }
    }
  }
}

// A large multi-block call takes the streaming path by default (kAuto).
TEST(AdamStreaming, LargeCallsStreamByDefaultAndMatchTheCachedPath) {
  const AdamDTypes d{DType::kFloat16, DType::kFloat32, DType::kFloat16};
  const std::size_t n = kStreamCopyMinElements + 2 * kBlockElements + 9;
  SpanData a(d, n, 3, 5);
  SpanData b = a;
  const AdamHyperParams h = non_default_hyper(true, true);
  const AdamSpan sa = a.span(1);
  const AdamSpan sb = b.span(1);
  adam_update(h, d, {&sa, 1}, kGradScale);
  adam_update(h, d, {&sb, 1}, kGradScale, ExecOptions{0, CopyStores::kCache});
  EXPECT_TRUE(same_bytes(a, b));
  for (std::size_t i = 0; i < n; i += 997) {
    ASSERT_EQ(reinterpret_cast<const std::uint16_t*>(a.cp())[i], f32_to_f16_rne(a.p()[i]));
  }
}

// One chunk: four buffers of `numel` elements, a few tensors at offsets with
// gaps (padding) between them.
struct ChunkData {
  DType half_dtype;
  DType state_dtype;
  std::size_t numel;
  std::vector<float> param;
  std::vector<std::uint8_t> m, v, half;

  ChunkData(DType half_t, DType state_t, std::size_t n, std::uint32_t seed)
      : half_dtype(half_t), state_dtype(state_t), numel(n), param(n) {
    m.resize(n * dtype_size(state_t));
    v.resize(n * dtype_size(state_t));
    half.resize(n * dtype_size(half_t));
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < n; ++i) {
      param[i] = normal(rng);
      encode(state_t, m.data(), i, 0.1f * normal(rng));
      encode(state_t, v.data(), i, 0.01f * std::fabs(normal(rng)));
      encode(half_t, half.data(), i, static_cast<float>(kLossScale) * normal(rng));
    }
  }
  AdamChunk chunk() {
    return AdamChunk{param.data(), m.data(), v.data(), half.data(), numel, half_dtype,
                     state_dtype};
  }
  // fp32 mode (half_dtype kFloat32) has no param copy: the step copies the
  // params in after the update.
  AdamDTypes dtypes() const {
    AdamDTypes d{half_dtype, state_dtype, half_dtype};
    if (half_dtype == DType::kFloat32) d.param_copy.reset();
    return d;
  }
  AdamSpan span(const ChunkRange& r) {
    const std::size_t ss = dtype_size(state_dtype);
    std::uint8_t* h = half.data() + r.offset * dtype_size(half_dtype);
    return AdamSpan{param.data() + r.offset, m.data() + r.offset * ss, v.data() + r.offset * ss,
                    h, half_dtype == DType::kFloat32 ? nullptr : h, r.count, r.step};
  }
  bool same(const ChunkData& o) const {
    return param == o.param && m == o.m && v == o.v && half == o.half;
  }
};

double clip_coef_of(double sum_squares, double max_norm) {
  const double c = std::min(1.0, max_norm / (std::sqrt(sum_squares) + 1e-6));
  return std::isfinite(c) ? c : 1.0;
}

TEST(AdamChunkStep, UpdatesEveryRangeLikeTheReferenceAndLeavesTheGapsAlone) {
  TargetGuard guard;
  const std::size_t numel = 3 * kBlockElements + 1000;
  // Unsorted, odd offsets and lengths, a range across block boundaries, an
  // empty one, different steps (a tensor that skipped steps).
  const std::vector<ChunkRange> ranges = {{kBlockElements + 5, 2 * kBlockElements - 3, 4},
                                          {3, 17, 4},
                                          {40, 1001, 2},
                                          {2000, 0, 1},
                                          {numel - 7, 7, 4}};
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (DType half_t : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      const std::size_t hs = dtype_size(half_t);
      for (DType state_t : {DType::kFloat32, DType::kBFloat16}) {
        for (bool adamw : {true, false}) {
          const AdamHyperParams h = non_default_hyper(adamw, true);
          ChunkData got(half_t, state_t, numel, 7);
          ChunkData want = got;
          const ChunkData before = got;
          AdamStepOptions opt;
          opt.loss_scale = kLossScale;
          opt.max_grad_norm = 50.0;
          const AdamStepResult r = adam_chunk_step(h, got.chunk(), ranges, opt);
          ASSERT_FALSE(r.overflow);
          // The reference: the norm over exactly the ranges, then each range.
          double sum = 0.0;
          for (const ChunkRange& cr : ranges) {
            sum += reference::grad_stats(half_t, want.half.data() + cr.offset * hs, cr.count,
                                         1.0 / kLossScale)
                       .sum_squares;
          }
          EXPECT_NEAR(r.grad_norm, std::sqrt(sum), 2e-5 * std::sqrt(sum)) << target;
          ASSERT_LT(r.clip_coef, 1.0) << "the test should clip";
          for (const ChunkRange& cr : ranges) {
            reference::adam_update(h, want.dtypes(), want.span(cr), r.clip_coef / kLossScale);
          }
          const std::string what = target + ", half " + dtype_name(half_t) + ", state " +
                                   dtype_name(state_t) + ", adamw " + std::to_string(adamw);
          const std::size_t ss = dtype_size(state_t);
          for (const ChunkRange& cr : ranges) {
            ASSERT_TRUE(all_close("param", DType::kFloat32,
                                  reinterpret_cast<const std::uint8_t*>(got.param.data() + cr.offset),
                                  reinterpret_cast<const std::uint8_t*>(want.param.data() + cr.offset),
                                  cr.count))
                << what;
            ASSERT_TRUE(all_close("exp_avg", state_t, got.m.data() + cr.offset * ss,
                                  want.m.data() + cr.offset * ss, cr.count))
                << what;
            ASSERT_TRUE(all_close("exp_avg_sq", state_t, got.v.data() + cr.offset * ss,
                                  want.v.data() + cr.offset * ss, cr.count))
                << what;
            // The 16-bit slot now holds the new params, rounded to nearest
            // even (fp32 mode: the params exactly).
            for (std::size_t i = cr.offset; i < cr.offset + cr.count; ++i) {
              if (half_t == DType::kFloat32) {
                ASSERT_EQ(std::memcmp(got.half.data() + 4 * i, &got.param[i], 4), 0)
                    << what << " at " << i;
                continue;
              }
              std::uint16_t bits;
              std::memcpy(&bits, got.half.data() + 2 * i, 2);
              const std::uint16_t expect = half_t == DType::kFloat16 ? f32_to_f16_rne(got.param[i])
                                                                     : f32_to_bf16_rne(got.param[i]);
              ASSERT_EQ(bits, expect) << what << " at " << i;
            }
          }
          // Elements outside every range: bitwise untouched.
          std::vector<bool> inside(numel, false);
          for (const ChunkRange& cr : ranges) {
            for (std::size_t i = cr.offset; i < cr.offset + cr.count; ++i) inside[i] = true;
          }
          for (std::size_t i = 0; i < numel; ++i) {
            if (inside[i]) continue;
            ASSERT_EQ(std::memcmp(&got.param[i], &before.param[i], 4), 0) << what << " at " << i;
            ASSERT_EQ(std::memcmp(got.m.data() + i * ss, before.m.data() + i * ss, ss), 0) << i;
            ASSERT_EQ(std::memcmp(got.v.data() + i * ss, before.v.data() + i * ss, ss), 0) << i;
            ASSERT_EQ(std::memcmp(got.half.data() + hs * i, before.half.data() + hs * i, hs), 0) << i;
          }
        }
      }
    }
  }
}

// Two chunks of one model: stats gathered per chunk and summed, then one
// pass per chunk. Equals the update with the global clip coefficient.
TEST(AdamChunkStep, KnownStatsOfEveryChunkMakeOnePassWithTheGlobalClip) {
  const std::size_t numel = 2 * kBlockElements + 77;
  const AdamHyperParams h = non_default_hyper(true, true);
  ChunkData c0(DType::kFloat16, DType::kFloat32, numel, 1);
  ChunkData c1(DType::kFloat16, DType::kFloat32, numel, 2);
  ChunkData w0 = c0, w1 = c1;
  const std::vector<ChunkRange> all = {{0, numel, 3}};
  GradStats global;
  for (ChunkData* c : {&c0, &c1}) {
    const GradSpan g{c->half.data(), numel};
    const GradStats s = grad_stats(DType::kFloat16, {&g, 1}, 1.0 / kLossScale);
    global.finite = global.finite && s.finite;
    global.sum_squares += s.sum_squares;
  }
  AdamStepOptions opt;
  opt.loss_scale = kLossScale;
  opt.max_grad_norm = 100.0;
  opt.known_stats = global;
  const AdamStepResult r0 = adam_chunk_step(h, c0.chunk(), all, opt);
  const AdamStepResult r1 = adam_chunk_step(h, c1.chunk(), all, opt);
  const double coef = clip_coef_of(global.sum_squares, opt.max_grad_norm);
  ASSERT_LT(coef, 1.0);
  EXPECT_EQ(r0.clip_coef, coef);
  EXPECT_EQ(r1.clip_coef, coef);
  EXPECT_EQ(r0.grad_norm, std::sqrt(global.sum_squares));
  // The same kernels with the same fp32 grad scale: bitwise equal.
  const AdamDTypes d{DType::kFloat16, DType::kFloat32, DType::kFloat16};
  for (ChunkData* w : {&w0, &w1}) {
    const AdamSpan s = w->span(all[0]);
    adam_update(h, d, {&s, 1}, coef / kLossScale);
  }
  EXPECT_TRUE(c0.same(w0));
  EXPECT_TRUE(c1.same(w1));

  // A non-finite global stat skips the step: nothing written anywhere.
  ChunkData c2(DType::kFloat16, DType::kFloat32, numel, 3);
  const ChunkData before = c2;
  opt.known_stats = GradStats{false, 1.0};
  const AdamStepResult r2 = adam_chunk_step(h, c2.chunk(), all, opt);
  EXPECT_TRUE(r2.overflow);
  EXPECT_TRUE(c2.same(before));
}

TEST(AdamChunkStep, AnInfInAnyRangeSkipsTheWholeChunk) {
  const std::size_t numel = kBlockElements + 100;
  ChunkData c(DType::kFloat16, DType::kFloat32, numel, 4);
  encode(DType::kFloat16, c.half.data(), numel - 1, std::numeric_limits<float>::infinity());
  const ChunkData before = c;
  const std::vector<ChunkRange> ranges = {{0, 100, 1}, {numel - 10, 10, 1}};
  AdamStepOptions opt;
  opt.loss_scale = kLossScale;
  const AdamStepResult r = adam_chunk_step(non_default_hyper(true, true), c.chunk(), ranges, opt);
  EXPECT_TRUE(r.overflow);
  EXPECT_TRUE(c.same(before));
}

// Gradient accumulation (Note [Gradient sums in chunks]): the gradients come
// from a separate fp32 chunk of sums, and the 16-bit chunk only receives the
// new params. Against the scalar reference fed the sums as fp32 gradients.
TEST(AdamChunkStep, GradientSumsFromTheirOwnChunkAndTheHalfChunkTakesTheParams) {
  TargetGuard guard;
  const std::size_t numel = 2 * kBlockElements + 301;
  const std::vector<ChunkRange> ranges = {{5, kBlockElements + 3, 2}, {kBlockElements + 40, 900, 1},
                                          {numel - 13, 13, 3}};
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (DType half_t : {DType::kFloat16, DType::kBFloat16, DType::kFloat32}) {
      const AdamHyperParams h = non_default_hyper(true, true);
      ChunkData got(half_t, DType::kFloat32, numel, 11);
      ChunkData want = got;
      std::vector<float> sums(numel);
      std::mt19937 rng(12);
      std::normal_distribution<float> normal;
      for (float& x : sums) x = static_cast<float>(kLossScale) * 3.0f * normal(rng);
      const std::vector<float> sums_before = sums;
      AdamChunk chunk = got.chunk();
      chunk.grad = sums.data();
      AdamStepOptions opt;
      opt.loss_scale = kLossScale;
      opt.max_grad_norm = 40.0;
      const AdamStepResult r = adam_chunk_step(h, chunk, ranges, opt);
      ASSERT_FALSE(r.overflow);
      double sum = 0.0;
      for (const ChunkRange& cr : ranges) {
        sum += reference::grad_stats(DType::kFloat32, sums.data() + cr.offset, cr.count,
                                     1.0 / kLossScale)
                   .sum_squares;
      }
      EXPECT_NEAR(r.grad_norm, std::sqrt(sum), 2e-5 * std::sqrt(sum)) << target;
      ASSERT_LT(r.clip_coef, 1.0) << "the test should clip";
      const std::string what = target + ", half " + dtype_name(half_t);
      for (const ChunkRange& cr : ranges) {
        AdamSpan s = want.span(cr);
        s.grad = sums.data() + cr.offset;
        AdamDTypes d{DType::kFloat32, DType::kFloat32, half_t};
        if (half_t == DType::kFloat32) d.param_copy.reset();
        reference::adam_update(h, d, s, r.clip_coef / kLossScale);
        ASSERT_TRUE(all_close("param", DType::kFloat32,
                              reinterpret_cast<const std::uint8_t*>(got.param.data() + cr.offset),
                              reinterpret_cast<const std::uint8_t*>(want.param.data() + cr.offset),
                              cr.count))
            << what;
        for (std::size_t i = cr.offset; i < cr.offset + cr.count; ++i) {
          const float p = got.param[i];
          if (half_t == DType::kFloat32) {
            ASSERT_EQ(std::memcmp(got.half.data() + 4 * i, &p, 4), 0) << what << " at " << i;
            continue;
          }
          std::uint16_t bits;
          std::memcpy(&bits, got.half.data() + 2 * i, 2);
          ASSERT_EQ(bits, half_t == DType::kFloat16 ? f32_to_f16_rne(p) : f32_to_bf16_rne(p))
              << what << " at " << i;
        }
      }
      EXPECT_EQ(sums, sums_before) << what << ": the sums are read only";
    }
  }
}

TEST(AdamChunkStep, BadRangesAreValueErrorsNamingThem) {
  ChunkData c(DType::kFloat16, DType::kFloat32, 100, 5);
  const ChunkData before = c;
  auto message_of = [&](std::vector<ChunkRange> ranges) -> std::string {
    try {
      adam_chunk_step({}, c.chunk(), ranges);
    } catch (const ValueError& e) {
      return e.message();
    }
    return "(no ValueError)";
  };
  EXPECT_NE(message_of({{90, 11, 1}}).find("elements [90, 101) are out of range for a chunk of 100"),
            std::string::npos);
  EXPECT_NE(message_of({{0, 10, 1}, {50, 10, 1}, {5, 10, 1}}).find("overlap"), std::string::npos);
  EXPECT_NE(message_of({{0, 10, 0}}).find("step must be >= 1"), std::string::npos);
  EXPECT_TRUE(c.same(before)) << "a refused call wrote";
}

}  // namespace
}  // namespace tidal::cpu_adam
