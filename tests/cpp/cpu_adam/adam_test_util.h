// Helpers shared by the CPU Adam test executables: buffers with misaligned
// starts in every dtype, elementwise comparison with tolerances, and the
// hyperparameters the tests use.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/float16.h"
#include "cpu_adam/reference.h"

namespace tidal::cpu_adam::test_util {

// Restores the process-wide kernel target when a test that switches it ends.
class TargetGuard {
 public:
  TargetGuard() : saved_(kernel_target()) {}
  ~TargetGuard() { set_kernel_target(saved_); }

 private:
  std::string saved_;
};

inline float decode(DType t, const std::uint8_t* base, std::size_t i) {
  switch (t) {
    case DType::kFloat32: {
      float x;
      std::memcpy(&x, base + 4 * i, 4);
      return x;
    }
    case DType::kFloat16: {
      std::uint16_t h;
      std::memcpy(&h, base + 2 * i, 2);
      return f16_to_f32(h);
    }
    case DType::kBFloat16: {
      std::uint16_t h;
      std::memcpy(&h, base + 2 * i, 2);
      return bf16_to_f32(h);
    }
  }
  return 0.0f;
}

inline void encode(DType t, std::uint8_t* base, std::size_t i, float x) {
  if (t == DType::kFloat32) {
    std::memcpy(base + 4 * i, &x, 4);
  } else {
    const std::uint16_t h = t == DType::kFloat16 ? f32_to_f16_rne(x) : f32_to_bf16_rne(x);
    std::memcpy(base + 2 * i, &h, 2);
  }
}

// Every buffer of one span, each starting `offset` elements into its own
// allocation so that starts are misaligned for any vector width.
struct SpanData {
  AdamDTypes dtypes;
  std::size_t count = 0;
  std::size_t offset = 0;
  std::vector<float> param;
  std::vector<std::uint8_t> m, v, g, copy;

  SpanData(const AdamDTypes& d, std::size_t n, std::size_t off, std::uint32_t seed)
      : dtypes(d), count(n), offset(off) {
    param.assign(n + off, 0.0f);
    m.assign((n + off) * dtype_size(d.state), 0);
    v.assign((n + off) * dtype_size(d.state), 0);
    g.assign((n + off) * dtype_size(d.grad), 0);
    copy.assign((n + off) * 2, 0xAB);  // a sentinel pattern the kernel must overwrite
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < n; ++i) {
      p()[i] = normal(rng);
      encode(d.state, mp(), i, 0.1f * normal(rng));
      encode(d.state, vp(), i, 0.01f * std::fabs(normal(rng)));
    }
    set_grads(seed + 1, 1.0f);
  }

  // Fresh gradients ~ N(0, 1) * scale, stored in the grad dtype.
  void set_grads(std::uint32_t seed, float scale) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> normal;
    for (std::size_t i = 0; i < count; ++i) encode(dtypes.grad, gp(), i, scale * normal(rng));
  }

  float* p() { return param.data() + offset; }
  std::uint8_t* mp() { return m.data() + offset * dtype_size(dtypes.state); }
  std::uint8_t* vp() { return v.data() + offset * dtype_size(dtypes.state); }
  std::uint8_t* gp() { return g.data() + offset * dtype_size(dtypes.grad); }
  std::uint8_t* cp() { return dtypes.param_copy ? copy.data() + offset * 2 : nullptr; }

  AdamSpan span(std::int64_t step) {
    return AdamSpan{p(), mp(), vp(), gp(), cp(), count, step};
  }
};

inline bool same_bytes(const SpanData& a, const SpanData& b) {
  return a.param == b.param && a.m == b.m && a.v == b.v && a.g == b.g && a.copy == b.copy;
}

// Elementwise |got - want| <= atol + rtol * |want| over `n` values; reports
// the first violation and the count of inexact (bitwise different) values.
inline ::testing::AssertionResult all_close(const char* what, DType t, const std::uint8_t* got,
                                     const std::uint8_t* want, std::size_t n) {
  // fp32 values: a few ulps; 16-bit values: one unit of their last place.
  const double rtol = t == DType::kFloat32 ? 1e-6 : (t == DType::kFloat16 ? 1.0 / 1024 : 1.0 / 128);
  const double atol = t == DType::kFloat32 ? 1e-7 : 6e-8;
  for (std::size_t i = 0; i < n; ++i) {
    const double a = decode(t, got, i);
    const double b = decode(t, want, i);
    if (std::isnan(a) && std::isnan(b)) continue;
    if (!(std::fabs(a - b) <= atol + rtol * std::fabs(b))) {
      return ::testing::AssertionFailure()
             << what << "[" << i << "] = " << a << ", reference " << b << " (" << dtype_name(t)
             << ", rtol " << rtol << ", atol " << atol << ")";
    }
  }
  return ::testing::AssertionSuccess();
}

inline ::testing::AssertionResult span_close(SpanData& got, SpanData& want) {
  auto r = all_close("param", DType::kFloat32, reinterpret_cast<const std::uint8_t*>(got.p()),
                     reinterpret_cast<const std::uint8_t*>(want.p()), got.count);
  if (!r) return r;
  if (!(r = all_close("exp_avg", got.dtypes.state, got.mp(), want.mp(), got.count))) return r;
  if (!(r = all_close("exp_avg_sq", got.dtypes.state, got.vp(), want.vp(), got.count))) return r;
  if (got.dtypes.param_copy) {
    if (!(r = all_close("param_copy", *got.dtypes.param_copy, got.cp(), want.cp(), got.count))) {
      return r;
    }
  }
  // Nothing outside [offset, offset + count) may change.
  for (std::size_t i = 0; i < got.offset; ++i) {
    if (got.param[i] != 0.0f) return ::testing::AssertionFailure() << "wrote before the span";
  }
  return ::testing::AssertionSuccess();
}

inline std::vector<AdamDTypes> all_dtype_combos() {
  std::vector<AdamDTypes> out;
  for (DType grad : {DType::kFloat32, DType::kFloat16, DType::kBFloat16}) {
    for (DType state : {DType::kFloat32, DType::kBFloat16}) {
      for (std::optional<DType> copy :
           {std::optional<DType>{}, std::optional<DType>{DType::kFloat16},
            std::optional<DType>{DType::kBFloat16}}) {
        out.push_back(AdamDTypes{grad, state, copy});
      }
    }
  }
  return out;
}

inline AdamHyperParams non_default_hyper(bool adamw, bool bias_correction) {
  AdamHyperParams h;
  h.lr = 1e-2;
  h.beta1 = 0.8;
  h.beta2 = 0.95;
  h.eps = 1e-6;
  h.weight_decay = 0.1;
  h.adamw_mode = adamw;
  h.bias_correction = bias_correction;
  return h;
}

inline std::string describe(const AdamDTypes& d) {
  std::ostringstream out;
  out << "grad " << dtype_name(d.grad) << ", state " << dtype_name(d.state) << ", copy "
      << (d.param_copy ? dtype_name(*d.param_copy) : "none");
  return out.str();
}

// Three steps with fresh (loss-scaled) gradients, through the public threaded
// entry point with the active target, or through the reference.
inline constexpr double kLossScale = 1024.0;
inline constexpr double kGradScale = 0.5 / kLossScale;  // unscale and clip by 0.5

inline void steps_public(const AdamHyperParams& h, SpanData& s) {
  for (std::int64_t step = 1; step <= 3; ++step) {
    s.set_grads(static_cast<std::uint32_t>(100 + step), static_cast<float>(kLossScale));
    const AdamSpan span = s.span(step);
    adam_update(h, s.dtypes, {&span, 1}, kGradScale);
  }
}

inline void steps_reference(const AdamHyperParams& h, SpanData& s) {
  for (std::int64_t step = 1; step <= 3; ++step) {
    s.set_grads(static_cast<std::uint32_t>(100 + step), static_cast<float>(kLossScale));
    reference::adam_update(h, s.dtypes, s.span(step), kGradScale);
  }
}

inline std::vector<std::string> targets_to_test() { return available_kernel_targets(); }

}  // namespace tidal::cpu_adam::test_util
