// Internal: the per-target kernel entry points behind adam.h. Not installed.
//
// A KernelTable holds one function pointer per element-type combination for
// one target. Highway fills one table per compiled SIMD target
// (adam_kernels.cpp); reference.cpp fills the "reference" one. adam.cpp picks a
// table and runs its kernels over blocks (Note [Deterministic blocks]).
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "cpu_adam/adam.h"

namespace tidal::cpu_adam::detail {

// Per-span scalars of one update, all in fp32 as the kernels use them, each
// derived once in double the way torch.optim.Adam derives it (Python floats
// are doubles) and then rounded to fp32 (ATen's scalar argument handling).
struct UpdateConstants {
  float grad_scale;        // g = grad * grad_scale
  float weight_decay;      // L2 kernels: g += weight_decay * p
  float decay_factor;      // p *= decay_factor (1 - lr * wd in AdamW mode, else 1)
  float one_minus_beta1;   // m += (1 - beta1) * (g - m)      (torch: lerp_)
  float beta2;             // v = v * beta2 + (1 - beta2) * g * g   (mul_, addcmul_)
  float one_minus_beta2;
  float bias_correction2_sqrt;  // sqrt(1 - beta2^t), or 1
  float eps;
  float neg_step_size;     // -lr / (1 - beta1^t), or -lr
  // Non-temporal stores for a param_copy that is not the grad buffer, on
  // targets that have them (Note [Streaming the param copy] in adam.h).
  bool stream_copy = false;
};

UpdateConstants make_update_constants(const AdamHyperParams& hyper, std::int64_t step,
                                      double grad_scale);

// The per-element operation, in the exact order every kernel uses. With
// fp-contract off (cpu_adam/CMakeLists.txt) each SIMD lane computes the same
// IEEE operations, so every target matches this bit for bit on fp32 data.
//   g  = grad * grad_scale;            [L2]  g = g + weight_decay * p
//   p  = p * decay_factor
//   m  = m + one_minus_beta1 * (g - m)
//   v  = v * beta2 + (one_minus_beta2 * g) * g
//   p  = p + (neg_step_size * m) / (sqrt(v) / bias_correction2_sqrt + eps)

// Base pointers of one span; kernels index them with [begin, begin + count).
struct SpanPointers {
  float* param;
  void* exp_avg;
  void* exp_avg_sq;
  const void* grad;
  void* param_copy;
};

using UpdateFn = void (*)(const UpdateConstants& c, const SpanPointers& s, std::size_t begin,
                          std::size_t count);

struct BlockStats {
  double sum_squares;  // of the raw (unscaled) gradients
  bool finite;
};

using StatsFn = BlockStats (*)(const void* grad, std::size_t begin, std::size_t count);

// fold_gradients() over elements [begin, begin + count) of one span.
using FoldFn = void (*)(const FoldSpan& s, std::size_t begin, std::size_t count);

// Indices of KernelTable::update.
inline constexpr int kNumGradTypes = 3;   // DType order
inline constexpr int kNumStateTypes = 2;  // 0: fp32, 1: bf16
inline constexpr int kNumCopyTypes = 3;   // 0: none, 1: fp16, 2: bf16

struct KernelTable {
  const char* name;
  // [grad dtype][state: fp32, bf16][copy: none, fp16, bf16][L2 weight decay]
  UpdateFn update[kNumGradTypes][kNumStateTypes][kNumCopyTypes][2];
  StatsFn stats[kNumGradTypes];
  // [16-bit buffer dtype][first][master rounded back into the 16-bit buffer]
  FoldFn fold[kNumGradTypes][2][2];
};

// The "reference" table (reference.cpp).
const KernelTable& reference_kernel_table();

// One table per Highway target compiled into this build that this CPU runs,
// best first (adam_kernels.cpp).
std::vector<const KernelTable*> highway_kernel_tables();

}  // namespace tidal::cpu_adam::detail
