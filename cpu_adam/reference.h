// The scalar reference: plain C++ loops, one element at a time, in the
// operation order of kernel_table.h. It is always built, it is the "scalar"
// kernel target (TIDAL_CPU_ADAM_TARGET=reference), and tests hold every SIMD
// target to it. tests/python/test_cpu_adam.py in turn holds it to
// torch.optim.Adam/AdamW.
#pragma once

#include <cstddef>

#include "cpu_adam/adam.h"

namespace tidal::cpu_adam::reference {

// adam_update() on one span, serially, on the calling thread.
void adam_update(const AdamHyperParams& hyper, const AdamDTypes& dtypes, const AdamSpan& span,
                 double grad_scale = 1.0);

// grad_stats() on one span, serially, summing in double in element order
// (more accurate than the SIMD kernels' per-block fp32 lanes).
GradStats grad_stats(DType grad_dtype, const void* grad, std::size_t count,
                     double grad_scale = 1.0);

}  // namespace tidal::cpu_adam::reference
