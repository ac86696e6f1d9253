// CPU Adam: every runnable kernel target against the scalar reference
// (elementwise, relative + absolute tolerance), the reference against a
// textbook Adam in double, overflow and clipping contracts, errors, target
// selection. The multi-threaded contracts are in adam_threads_test.cpp.
#include "cpu_adam/adam.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu_adam/float16.h"
#include "cpu_adam/reference.h"
#include "cpu_adam/simd_target.h"
#include "tests/cpp/cpu_adam/adam_test_util.h"
#include "runtime/core/error.h"

namespace tidal::cpu_adam {
namespace {

using namespace test_util;  // NOLINT: test helpers

TEST(AdamKernels, EveryTargetMatchesReferenceOnAwkwardLengths) {
  TargetGuard guard;
  const std::size_t lengths[] = {1, 3, 7, 15, 16, 17, 63, 64, 1000};
  const std::size_t offsets[] = {0, 1, 3};
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (const AdamDTypes& d : all_dtype_combos()) {
      for (bool adamw : {true, false}) {
        for (bool bias : {true, false}) {
          const AdamHyperParams h = non_default_hyper(adamw, bias);
          for (std::size_t n : lengths) {
            for (std::size_t off : offsets) {
              SpanData got(d, n, off, static_cast<std::uint32_t>(n * 7 + off));
              SpanData want = got;
              steps_public(h, got);
              steps_reference(h, want);
              ASSERT_TRUE(span_close(got, want))
                  << "target " << target << ", " << describe(d) << ", adamw " << adamw
                  << ", bias_correction " << bias << ", n " << n << ", offset " << off;
            }
          }
        }
      }
    }
  }
}

TEST(AdamKernels, EveryTargetMatchesReferenceOnALargeMisalignedSpan) {
  TargetGuard guard;
  const std::size_t n = (std::size_t{1} << 20) + 3;
  constexpr std::int64_t kLargeSteps = 2;  // the short lengths run 3 steps
  struct Case {
    AdamDTypes dtypes;
    bool adamw;
  };
  const Case cases[] = {
      {{DType::kFloat16, DType::kFloat32, DType::kFloat16}, true},
      {{DType::kBFloat16, DType::kBFloat16, DType::kBFloat16}, false},
      {{DType::kFloat32, DType::kFloat32, std::nullopt}, true},
  };
  for (const Case& c : cases) {
    {
      const AdamDTypes& d = c.dtypes;
      const bool adamw = c.adamw;
      const AdamHyperParams h = non_default_hyper(adamw, true);
      SpanData initial(d, n, 1, 42);
      // The steps' gradients, generated once (the RNG dominates otherwise).
      std::vector<std::vector<std::uint8_t>> grads;
      for (std::int64_t step = 1; step <= kLargeSteps; ++step) {
        SpanData tmp = initial;
        tmp.set_grads(static_cast<std::uint32_t>(100 + step), static_cast<float>(kLossScale));
        grads.push_back(tmp.g);
      }
      SpanData want = initial;
      for (std::int64_t step = 1; step <= kLargeSteps; ++step) {
        want.g = grads[step - 1];
        reference::adam_update(h, d, want.span(step), kGradScale);
      }
      for (const std::string& target : targets_to_test()) {
        set_kernel_target(target);
        SpanData got = initial;
        for (std::int64_t step = 1; step <= kLargeSteps; ++step) {
          got.g = grads[step - 1];
          const AdamSpan s = got.span(step);
          adam_update(h, d, {&s, 1}, kGradScale);
        }
        ASSERT_TRUE(span_close(got, want)) << "target " << target << ", " << describe(d)
                                            << ", adamw " << adamw;
        // kernel_table.h promises more than the tolerance: with fp-contract
        // off, every target performs the reference's IEEE operations.
        EXPECT_TRUE(same_bytes(got, want)) << "target " << target << " is close to the "
                                           << "reference but not bitwise equal, " << describe(d);
      }
    }
  }
}

// The fp16 chunk holds the gradients and then receives the new params:
// param_copy == grad must give what separate buffers give.
TEST(AdamKernels, TheCopyMayOverwriteTheGradientsInPlace) {
  TargetGuard guard;
  for (DType t : {DType::kFloat16, DType::kBFloat16}) {
    const AdamDTypes d{t, DType::kFloat32, t};
    for (const std::string& target : targets_to_test()) {
      set_kernel_target(target);
      for (std::size_t n : {std::size_t{5}, std::size_t{1000}, 3 * kBlockElements + 7}) {
        SpanData separate(d, n, 1, 77);
        SpanData in_place = separate;
        const AdamSpan a = separate.span(2);
        adam_update(non_default_hyper(true, true), d, {&a, 1}, kGradScale);
        AdamSpan b = in_place.span(2);
        b.param_copy = in_place.gp();
        adam_update(non_default_hyper(true, true), d, {&b, 1}, kGradScale);
        EXPECT_EQ(separate.param, in_place.param) << target;
        EXPECT_EQ(separate.m, in_place.m) << target;
        EXPECT_EQ(separate.v, in_place.v) << target;
        EXPECT_TRUE(std::equal(separate.copy.begin() + 2, separate.copy.begin() + 2 + 2 * n,
                               in_place.g.begin() + 2))
            << target << " " << dtype_name(t) << " n " << n;
      }
    }
  }
}

// With beta1 = 0 the first moment becomes the gradient exactly (0 + 1*(g-0)),
// so exp_avg shows every target's widening of every 16-bit bit pattern.
TEST(AdamKernels, EveryTargetWidensEvery16BitGradientExactly) {
  TargetGuard guard;
  AdamHyperParams h;
  h.beta1 = 0.0;
  for (DType grad : {DType::kFloat16, DType::kBFloat16}) {
    const AdamDTypes d{grad, DType::kFloat32, std::nullopt};
    for (const std::string& target : targets_to_test()) {
      set_kernel_target(target);
      SpanData s(d, 65536, 1, 3);
      for (std::size_t i = 0; i < 65536; ++i) {
        const auto bits = static_cast<std::uint16_t>(i);
        std::memcpy(s.gp() + 2 * i, &bits, 2);
        encode(DType::kFloat32, s.mp(), i, 0.0f);
      }
      const AdamSpan span = s.span(1);
      adam_update(h, d, {&span, 1});
      for (std::size_t i = 0; i < 65536; ++i) {
        const auto bits = static_cast<std::uint16_t>(i);
        const float want = grad == DType::kFloat16 ? f16_to_f32(bits) : bf16_to_f32(bits);
        const float got = decode(DType::kFloat32, s.mp(), i);
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got)) << target << " " << std::hex << i;
        } else if (want == 0.0f) {
          ASSERT_EQ(got, 0.0f) << target;  // 0 + (-0 - 0) is +0: the sign cannot show
        } else {
          ASSERT_EQ(float_bits(got), float_bits(want)) << target << " " << dtype_name(grad)
                                                       << " bits " << std::hex << i;
        }
      }
    }
  }
}

// With lr = 0, eps = 1 and zero moments the param is left as it is, so the
// copy shows every target's rounding of chosen fp32 values: all fp16 values,
// the midpoints between them (ties) and their neighbours, overflow, inf, NaN.
TEST(AdamKernels, EveryTargetRoundsTheParamCopyToNearestEven) {
  TargetGuard guard;
  std::vector<float> values;
  for (std::uint32_t h = 0; h < 0x7C00u; h += 3) {
    const float a = f16_to_f32(static_cast<std::uint16_t>(h));
    const float b = f16_to_f32(static_cast<std::uint16_t>(h + 1));
    const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);
    for (float x : {a, mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e30f)}) {
      values.push_back(x);
      values.push_back(-x);
    }
    // bf16 ties and neighbours around the same magnitude.
    const std::uint32_t u = float_bits(a) & 0xFFFF0000u;
    values.push_back(bits_float(u | 0x8000u));
    values.push_back(bits_float(u | 0x18000u));
    values.push_back(bits_float(u | 0x7FFFu));
  }
  for (float x : {65504.0f, 65519.0f, 65520.0f, 1e38f, std::numeric_limits<float>::infinity(),
                  -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN(),
                  std::numeric_limits<float>::denorm_min(), 3.4e38f}) {
    values.push_back(x);
  }
  AdamHyperParams h;
  h.lr = 0.0;
  h.eps = 1.0;
  for (DType copy : {DType::kFloat16, DType::kBFloat16}) {
    const AdamDTypes d{DType::kFloat32, DType::kFloat32, copy};
    for (const std::string& target : targets_to_test()) {
      set_kernel_target(target);
      SpanData s(d, values.size(), 2, 5);
      for (std::size_t i = 0; i < values.size(); ++i) {
        s.p()[i] = values[i];
        encode(DType::kFloat32, s.mp(), i, 0.0f);
        encode(DType::kFloat32, s.vp(), i, 0.0f);
        encode(DType::kFloat32, s.gp(), i, 0.0f);
      }
      const AdamSpan span = s.span(1);
      adam_update(h, d, {&span, 1});
      for (std::size_t i = 0; i < values.size(); ++i) {
        std::uint16_t got;
        std::memcpy(&got, s.cp() + 2 * i, 2);
        const float x = values[i];
        ASSERT_EQ(float_bits(s.p()[i]), float_bits(x)) << "lr = 0 changed the param";
        if (std::isnan(x)) {
          ASSERT_TRUE(copy == DType::kFloat16 ? (got & 0x7C00u) == 0x7C00u && (got & 0x3FFu) != 0
                                              : (got & 0x7F80u) == 0x7F80u && (got & 0x7Fu) != 0)
              << target << " NaN became " << std::hex << got;
          continue;
        }
        const std::uint16_t want = copy == DType::kFloat16 ? f32_to_f16_rne(x) : f32_to_bf16_rne(x);
        ASSERT_EQ(got, want) << target << " " << dtype_name(copy) << " of " << x << " (bits "
                             << std::hex << float_bits(x) << ")";
      }
    }
  }
}

// The reference itself against Adam written out in double from the paper
// (Kingma & Ba, with decoupled decay as in Loshchilov & Hutter).
TEST(AdamReference, MatchesTextbookAdamInDouble) {
  for (bool adamw : {true, false}) {
    for (bool bias : {true, false}) {
      const AdamHyperParams h = non_default_hyper(adamw, bias);
      const AdamDTypes d{DType::kFloat32, DType::kFloat32, std::nullopt};
      float p = 0.75f, m = 0.0f, v = 0.0f;
      double pd = 0.75, md = 0.0, vd = 0.0;
      const float grads[] = {0.5f, -1.25f, 0.125f, 2.0f, -0.03125f};
      for (int t = 1; t <= 5; ++t) {
        float g = grads[t - 1];
        reference::adam_update(h, d, AdamSpan{&p, &m, &v, &g, nullptr, 1, t});
        double gd = grads[t - 1];
        if (!adamw) gd += h.weight_decay * pd;
        if (adamw) pd *= 1.0 - h.lr * h.weight_decay;
        md = h.beta1 * md + (1.0 - h.beta1) * gd;
        vd = h.beta2 * vd + (1.0 - h.beta2) * gd * gd;
        const double mhat = bias ? md / (1.0 - std::pow(h.beta1, t)) : md;
        const double vhat_sqrt = bias ? std::sqrt(vd) / std::sqrt(1.0 - std::pow(h.beta2, t))
                                      : std::sqrt(vd);
        pd -= h.lr * mhat / (vhat_sqrt + h.eps);
        EXPECT_NEAR(p, pd, 1e-6 * std::fabs(pd) + 1e-7) << "adamw " << adamw << " bias " << bias
                                                         << " step " << t;
        EXPECT_NEAR(m, md, 1e-6 * std::fabs(md) + 1e-8);
        EXPECT_NEAR(v, vd, 1e-6 * std::fabs(vd) + 1e-9);
      }
    }
  }
}

TEST(GradStats, EveryTargetMatchesReference) {
  TargetGuard guard;
  const std::size_t lengths[] = {1, 3, 7, 15, 16, 17, 63, 64, 1000, (std::size_t{1} << 20) + 3};
  for (DType grad : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (std::size_t n : lengths) {
      SpanData s({grad, DType::kFloat32, std::nullopt}, n, n % 3, static_cast<std::uint32_t>(n));
      s.set_grads(9, 300.0f);
      const GradStats want = reference::grad_stats(grad, s.gp(), n, 1.0 / 256);
      for (const std::string& target : targets_to_test()) {
        set_kernel_target(target);
        const GradSpan span{s.gp(), n};
        const GradStats got = grad_stats(grad, {&span, 1}, 1.0 / 256);
        EXPECT_TRUE(got.finite);
        EXPECT_NEAR(got.sum_squares, want.sum_squares, 2e-5 * want.sum_squares)
            << target << " " << dtype_name(grad) << " n " << n;
      }
    }
  }
}

TEST(GradStats, EveryTargetFindsEveryInfAndNaN) {
  TargetGuard guard;
  const std::size_t n = 3 * kBlockElements + 5;
  const std::size_t positions[] = {0, 1, 17, kBlockElements - 1, kBlockElements, n - 5, n - 1};
  for (DType grad : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    const float big = grad == DType::kFloat16 ? 65504.0f : 3.0e38f;  // largest finite-ish
    SpanData s({grad, DType::kFloat32, std::nullopt}, n, 1, 11);
    for (const std::string& target : targets_to_test()) {
      set_kernel_target(target);
      const GradSpan span{s.gp(), n};
      encode(grad, s.gp(), 5, big);  // huge but finite is not an overflow
      EXPECT_TRUE(grad_stats(grad, {&span, 1}).finite) << target << " " << dtype_name(grad);
      for (std::size_t pos : positions) {
        for (float bad : {std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          std::numeric_limits<float>::quiet_NaN()}) {
          std::vector<std::uint8_t> saved(s.g);
          encode(grad, s.gp(), pos, bad);
          EXPECT_FALSE(grad_stats(grad, {&span, 1}).finite)
              << target << " " << dtype_name(grad) << " " << bad << " at " << pos;
          EXPECT_FALSE(reference::grad_stats(grad, s.gp(), n).finite);
          s.g = saved;
        }
      }
    }
  }
}

TEST(AdamStep, OverflowLeavesEveryBufferUntouchedAndIsReported) {
  TargetGuard guard;
  const std::size_t n = 2 * kBlockElements + 7;
  for (const std::string& target : targets_to_test()) {
    set_kernel_target(target);
    for (DType grad : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
      const AdamDTypes d{grad, DType::kFloat32, DType::kFloat16};
      for (std::size_t pos : {std::size_t{0}, kBlockElements + 3, n - 1}) {
        SpanData a(d, n, 1, 21);
        SpanData b(d, 100, 2, 22);  // a second span without the bad value
        encode(grad, a.gp(), pos, std::numeric_limits<float>::quiet_NaN());
        const SpanData a0 = a, b0 = b;
        const AdamSpan spans[] = {b.span(3), a.span(3)};
        AdamStepOptions opt;
        opt.loss_scale = 65536.0;
        opt.max_grad_norm = 1.0;
        const AdamStepResult r = adam_step(non_default_hyper(true, true), d, spans, opt);
        EXPECT_TRUE(r.overflow) << target << " " << dtype_name(grad) << " at " << pos;
        EXPECT_TRUE(same_bytes(a, a0)) << target << ": a buffer changed despite the overflow";
        EXPECT_TRUE(same_bytes(b, b0)) << target << ": a buffer changed despite the overflow";
      }
    }
  }
}

TEST(AdamStep, ClipsByTheGlobalNormAndMatchesAnExplicitUpdate) {
  const AdamDTypes d{DType::kFloat16, DType::kFloat32, DType::kFloat16};
  const AdamHyperParams h = non_default_hyper(true, true);
  SpanData a(d, 5000, 1, 31), b(d, 70000, 0, 32);
  a.set_grads(1, 512.0f);
  b.set_grads(2, 512.0f);
  SpanData a2 = a, b2 = b;
  const double loss_scale = 512.0;
  const double sum_sq = reference::grad_stats(d.grad, a.gp(), a.count, 1 / loss_scale).sum_squares +
                        reference::grad_stats(d.grad, b.gp(), b.count, 1 / loss_scale).sum_squares;
  const double norm = std::sqrt(sum_sq);  // about sqrt(75000)
  AdamStepOptions opt;
  opt.loss_scale = loss_scale;
  opt.max_grad_norm = 10.0;
  const AdamSpan spans[] = {a.span(2), b.span(2)};
  const AdamStepResult r = adam_step(h, d, spans, opt);
  EXPECT_FALSE(r.overflow);
  EXPECT_NEAR(r.grad_norm, norm, 1e-5 * norm);
  EXPECT_DOUBLE_EQ(r.clip_coef, 10.0 / (r.grad_norm + 1e-6));
  EXPECT_LT(r.clip_coef, 1.0);
  // The same update written as one pass with the combined scale.
  const AdamSpan spans2[] = {a2.span(2), b2.span(2)};
  adam_update(h, d, spans2, r.clip_coef / loss_scale);
  EXPECT_TRUE(same_bytes(a, a2));
  EXPECT_TRUE(same_bytes(b, b2));

  // A norm under the limit is not clipped.
  opt.max_grad_norm = 1e9;
  const AdamStepResult r2 = adam_step(h, d, spans, opt);
  EXPECT_EQ(r2.clip_coef, 1.0);
}

TEST(AdamStep, WithoutChecksTheStatsPassIsSkipped) {
  const AdamDTypes d{DType::kBFloat16, DType::kFloat32, std::nullopt};
  SpanData a(d, 100, 0, 41);
  AdamStepOptions opt;
  opt.check_overflow = false;
  const AdamSpan span = a.span(1);
  const AdamStepResult r = adam_step(non_default_hyper(true, true), d, {&span, 1}, opt);
  EXPECT_FALSE(r.overflow);
  EXPECT_EQ(r.grad_norm, -1.0);
  EXPECT_EQ(r.clip_coef, 1.0);
}

TEST(AdamErrors, BadArgumentsAreValueErrorsNamingTheValue) {
  const AdamDTypes d{DType::kFloat32, DType::kFloat32, std::nullopt};
  SpanData s(d, 10, 0, 1);
  const AdamSpan span = s.span(1);
  auto update_with = [&](AdamHyperParams h) { adam_update(h, d, {&span, 1}); };
  auto message_of = [](auto&& fn) -> std::string {
    try {
      fn();
    } catch (const ValueError& e) {
      return e.message();
    }
    return "(no ValueError)";
  };
  AdamHyperParams h;
  h.lr = -1;
  EXPECT_NE(message_of([&] { update_with(h); }).find("lr must be finite and >= 0, got -1"),
            std::string::npos);
  h = {};
  h.beta1 = 1.0;
  EXPECT_NE(message_of([&] { update_with(h); }).find("beta1 must be in [0, 1), got 1"),
            std::string::npos);
  h = {};
  h.beta2 = -0.5;
  EXPECT_NE(message_of([&] { update_with(h); }).find("beta2"), std::string::npos);
  h = {};
  h.eps = std::numeric_limits<double>::quiet_NaN();
  EXPECT_NE(message_of([&] { update_with(h); }).find("eps"), std::string::npos);
  h = {};
  h.weight_decay = -0.1;
  EXPECT_NE(message_of([&] { update_with(h); }).find("weight_decay"), std::string::npos);

  AdamSpan bad = span;
  bad.step = 0;
  EXPECT_NE(message_of([&] { adam_update({}, d, {&bad, 1}); }).find("step must be >= 1"),
            std::string::npos);
  bad = span;
  bad.grad = nullptr;
  EXPECT_NE(message_of([&] { adam_update({}, d, {&bad, 1}); }).find("non-null"),
            std::string::npos);
  bad = span;
  bad.param_copy = s.copy.data();  // a destination but no copy dtype
  EXPECT_NE(message_of([&] { adam_update({}, d, {&bad, 1}); }).find("param_copy is set"),
            std::string::npos);
  EXPECT_NE(message_of([&] { adam_update({}, d, {&span, 1}, -1.0); }).find("grad_scale"),
            std::string::npos);
  EXPECT_NE(message_of([&] { adam_update({}, d, {&span, 1}, 1.0, ExecOptions{-2}); })
                .find("max_threads"),
            std::string::npos);
  AdamStepOptions opt;
  opt.loss_scale = 0.0;
  EXPECT_NE(message_of([&] { adam_step({}, d, {&span, 1}, opt); }).find("loss_scale"),
            std::string::npos);
  EXPECT_TRUE(same_bytes(s, SpanData(d, 10, 0, 1))) << "a rejected call wrote";

  // Unsupported layouts are NotImplementedError.
  EXPECT_THROW(adam_update({}, {DType::kFloat32, DType::kFloat16, std::nullopt}, {&span, 1}),
               NotImplementedError);
  EXPECT_THROW(adam_update({}, {DType::kFloat32, DType::kFloat32, DType::kFloat32}, {&span, 1}),
               NotImplementedError);
}

TEST(KernelTarget, ListsRunnableTargetsBestFirstAndReferenceLast) {
  const std::vector<std::string> targets = available_kernel_targets();
  ASSERT_GE(targets.size(), 2u);  // at least Highway's baseline and the reference
  EXPECT_EQ(targets.back(), "reference");
  // The best one is what Highway's own dispatch picks on this CPU.
  EXPECT_EQ(targets.front(), chosen_simd_target());
}

TEST(KernelTarget, SelectsByNameCaseInsensitivelyAndRejectsUnknownNames) {
  TargetGuard guard;
  set_kernel_target("REFERENCE");
  EXPECT_EQ(kernel_target(), "reference");
  const std::vector<std::string> targets = available_kernel_targets();
  set_kernel_target("baseline");
  EXPECT_EQ(kernel_target(), targets[targets.size() - 2]);
  set_kernel_target("auto");
  EXPECT_EQ(kernel_target(), available_kernel_targets().front());
  try {
    set_kernel_target("avx9000");
    FAIL() << "no error for an unknown target";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("'avx9000'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("reference"), std::string::npos) << e.message();
  }
  EXPECT_EQ(kernel_target(), available_kernel_targets().front()) << "a failed set changed it";
}

// CI runs the suite once with TIDAL_CPU_ADAM_TARGET=reference; this proves
// the variable took effect (each test runs in its own process under ctest).
TEST(KernelTarget, HonoursTheEnvironmentVariable) {
  const char* env = std::getenv("TIDAL_CPU_ADAM_TARGET");
  const std::vector<std::string> targets = available_kernel_targets();
  std::string want = env != nullptr ? env : "";
  if (want.empty() || want == "auto") want = targets.front();
  if (want == "baseline") want = targets[targets.size() - 2];
  std::string got = kernel_target();
  std::transform(want.begin(), want.end(), want.begin(), ::tolower);
  std::transform(got.begin(), got.end(), got.begin(), ::tolower);
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace tidal::cpu_adam
