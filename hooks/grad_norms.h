// What the step needs of the gradients as they land: the sum of their squares
// (clipping) and whether every element was finite (fp16 overflow). ModuleHooks
// measures each landed gradient here; with gradient accumulation the sums
// are measured instead (GradientSums::measure), by the step or at their fold
// in the window's last backward (Note [Measured where folded] in
// tidal/engine/overlap.py).
//
// Note [Gradient norms as they land]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The step needs the global L2 norm of the gradients (clipping) and whether
// all are finite (fp16 overflow). Each gradient is measured as it lands, while
// it is in cache: a CPU gradient (the simulated device, CPU training) by
// cpu_adam's grad_stats on its memory (squares in fp32, summed in double; no
// torch op, which would cost a dispatch per landing), a device gradient by an
// fp32 torch norm that stays on the device until take() reduces them all with
// one read. Both measures agree to the fp32 rounding of the squares' sums
// (about 1e-6 relative). A parameter whose gradient lands twice before the
// step (Note [Weights while gradients wait] in hooks/module_hooks.h) is
// measured again over the sum, replacing its first measure. With gradient
// accumulation a parameter's fp32 sum is measured the same way, once its
// window is complete: by the step, or during the window's last backward where
// the sum is final early (Note [Measured where folded] in
// tidal/engine/overlap.py).
//
// take() adds the measures in parameter order, not in the order they were
// made: which parameters were measured during backward and which by the step
// may change from step to step, and the clip factor of a step must be the same
// bits whichever it was (the overlapped step is the step without overlap, bit
// for bit).
//
// Thread safety: none; ModuleHooks' thread rules.
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <optional>
#include <vector>

#include "cpu_adam/adam.h"

namespace tidal::hooks {

// cpu_adam's name for a dtype its kernels take, or none.
std::optional<cpu_adam::DType> cpu_adam_dtype(at::ScalarType type);

struct GradNorm {
  double sum_squares = 0.0;
  bool finite = true;
};

class GradNorms {
 public:
  // One more parameter: the next index.
  void add_param() { measures_.emplace_back(); }
  // Parameter `param`'s landed gradient (or the sum of its two landings), or
  // with accumulation its gradient sum; replaces an earlier measure of it.
  void measure(std::size_t param, const at::Tensor& grad);
  // Parameter `param`'s measure made elsewhere: what measure() finds for a
  // CPU gradient (cpu_adam::grad_stats), here already taken (Note [Measured
  // in the fold] in tidal/engine/overlap.py).
  void record(std::size_t param, const cpu_adam::GradStats& stats);
  // The gradients measured since the last take or clear, added in parameter
  // order. Reads the device once when device gradients were measured.
  GradNorm take();
  void clear();

 private:
  // One parameter's measure: the sum of squares of a CPU gradient, or a
  // device norm (defined).
  struct Measure {
    bool measured = false;
    bool finite = true;
    double sum_squares = 0.0;
    at::Tensor norm;
  };
  std::vector<Measure> measures_;      // per parameter index
  std::vector<std::size_t> measured_;  // the parameters measured since the last take
};

}  // namespace tidal::hooks
