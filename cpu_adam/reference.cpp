// Scalar reference kernels. Compiled with -ffp-contract=off (CMakeLists.txt):
// a fused multiply-add would round differently from the SIMD targets that
// have none, and this file defines what every target must compute.
#include "cpu_adam/reference.h"

#include <cmath>
#include <cstdint>

#include "cpu_adam/float16.h"
#include "cpu_adam/kernel_table.h"
#include "runtime/core/error.h"

namespace tidal::cpu_adam {
namespace {

using detail::BlockStats;
using detail::SpanPointers;
using detail::UpdateConstants;

struct F32 {
  static float load(const void* base, std::size_t i) { return static_cast<const float*>(base)[i]; }
  static void store(void* base, std::size_t i, float x) { static_cast<float*>(base)[i] = x; }
};
struct F16 {
  static float load(const void* base, std::size_t i) {
    return f16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
  }
  static void store(void* base, std::size_t i, float x) {
    static_cast<std::uint16_t*>(base)[i] = f32_to_f16_rne(x);
  }
};
struct BF16 {
  static float load(const void* base, std::size_t i) {
    return bf16_to_f32(static_cast<const std::uint16_t*>(base)[i]);
  }
  static void store(void* base, std::size_t i, float x) {
    static_cast<std::uint16_t*>(base)[i] = f32_to_bf16_rne(x);
  }
};
struct NoCopy {
  static void store(void*, std::size_t, float) {}
};

template <class G, class S, class C, bool kL2>
void update_block(const UpdateConstants& c, const SpanPointers& s, std::size_t begin,
                  std::size_t count) {
  for (std::size_t i = begin; i < begin + count; ++i) {
    float g = G::load(s.grad, i) * c.grad_scale;
    float p = s.param[i];
    if constexpr (kL2) g = g + c.weight_decay * p;
    p = p * c.decay_factor;
    float m = S::load(s.exp_avg, i);
    float v = S::load(s.exp_avg_sq, i);
    m = m + c.one_minus_beta1 * (g - m);
    v = v * c.beta2 + (c.one_minus_beta2 * g) * g;
    const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
    p = p + (c.neg_step_size * m) / denom;
    s.param[i] = p;
    S::store(s.exp_avg, i, m);
    S::store(s.exp_avg_sq, i, v);
    C::store(s.param_copy, i, p);
  }
}

template <class G>
BlockStats stats_block(const void* grad, std::size_t begin, std::size_t count) {
  BlockStats out{0.0, true};
  for (std::size_t i = begin; i < begin + count; ++i) {
    const float g = G::load(grad, i);
    if (!std::isfinite(g)) out.finite = false;
    out.sum_squares += static_cast<double>(g) * static_cast<double>(g);
  }
  return out;
}

template <class H, bool kFirst, bool kRestore>
void fold_block(const FoldSpan& s, std::size_t begin, std::size_t count) {
  for (std::size_t i = begin; i < begin + count; ++i) {
    const float g = H::load(s.half, i);
    s.sum[i] = kFirst ? g : s.sum[i] + g;
    if constexpr (kRestore) H::store(s.half, i, s.master[i]);
  }
}

template <class G, class S, class C>
void fill_l2(detail::KernelTable& t, int gi, int si, int ci) {
  t.update[gi][si][ci][0] = &update_block<G, S, C, false>;
  t.update[gi][si][ci][1] = &update_block<G, S, C, true>;
}

template <class G, class S>
void fill_copy(detail::KernelTable& t, int gi, int si) {
  fill_l2<G, S, NoCopy>(t, gi, si, 0);
  fill_l2<G, S, F16>(t, gi, si, 1);
  fill_l2<G, S, BF16>(t, gi, si, 2);
}

template <class G>
void fill_state(detail::KernelTable& t, int gi) {
  fill_copy<G, F32>(t, gi, 0);
  fill_copy<G, BF16>(t, gi, 1);
  t.stats[gi] = &stats_block<G>;
  t.fold[gi][0][0] = &fold_block<G, false, false>;
  t.fold[gi][0][1] = &fold_block<G, false, true>;
  t.fold[gi][1][0] = &fold_block<G, true, false>;
  t.fold[gi][1][1] = &fold_block<G, true, true>;
}

detail::KernelTable make_reference_table() {
  detail::KernelTable t{};
  t.name = "reference";
  fill_state<F32>(t, static_cast<int>(DType::kFloat32));
  fill_state<F16>(t, static_cast<int>(DType::kFloat16));
  fill_state<BF16>(t, static_cast<int>(DType::kBFloat16));
  return t;
}

int copy_index(const std::optional<DType>& copy) {
  if (!copy) return 0;
  return *copy == DType::kFloat16 ? 1 : 2;
}

}  // namespace

namespace detail {

const KernelTable& reference_kernel_table() {
  static const KernelTable table = make_reference_table();
  return table;
}

}  // namespace detail

namespace reference {

void adam_update(const AdamHyperParams& hyper, const AdamDTypes& dtypes, const AdamSpan& span,
                 double grad_scale) {
  TIDAL_CHECK(dtypes.state != DType::kFloat16, "exp_avg/exp_avg_sq dtype float16 is not supported");
  TIDAL_CHECK(!dtypes.param_copy || *dtypes.param_copy != DType::kFloat32,
              "param_copy dtype must be float16 or bfloat16");
  const detail::UpdateConstants c = detail::make_update_constants(hyper, span.step, grad_scale);
  const bool l2 = !hyper.adamw_mode && hyper.weight_decay != 0.0;
  const detail::UpdateFn fn =
      detail::reference_kernel_table()
          .update[static_cast<int>(dtypes.grad)][dtypes.state == DType::kBFloat16 ? 1 : 0]
                 [copy_index(dtypes.param_copy)][l2 ? 1 : 0];
  fn(c, {span.param, span.exp_avg, span.exp_avg_sq, span.grad, span.param_copy}, 0, span.count);
}

GradStats grad_stats(DType grad_dtype, const void* grad, std::size_t count, double grad_scale) {
  const BlockStats s =
      detail::reference_kernel_table().stats[static_cast<int>(grad_dtype)](grad, 0, count);
  return GradStats{s.finite, s.sum_squares * grad_scale * grad_scale};
}

}  // namespace reference
}  // namespace tidal::cpu_adam
