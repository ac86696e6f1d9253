#include "hooks/grad_norms.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <cmath>
#include <span>
#include <utility>

namespace tidal::hooks {

std::optional<cpu_adam::DType> cpu_adam_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return cpu_adam::DType::kFloat32;
    case at::kHalf:
      return cpu_adam::DType::kFloat16;
    case at::kBFloat16:
      return cpu_adam::DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

void GradNorms::measure(std::size_t param, const at::Tensor& grad) {
  const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(grad.scalar_type());
  if (grad.is_cpu() && grad.is_contiguous() && dtype) {
    const cpu_adam::GradSpan span{grad.const_data_ptr(), static_cast<std::size_t>(grad.numel())};
    record(param, cpu_adam::grad_stats(*dtype, std::span(&span, 1)));
    return;
  }
  at::Tensor norm = at::linalg_vector_norm(grad, 2, c10::nullopt, false, at::kFloat);
  Measure& m = measures_.at(param);
  if (!m.measured) {
    m.measured = true;
    measured_.push_back(param);
  }
  m.norm = std::move(norm);
  m.sum_squares = 0.0;
  m.finite = true;
}

void GradNorms::record(std::size_t param, const cpu_adam::GradStats& stats) {
  Measure& m = measures_.at(param);
  if (!m.measured) {
    m.measured = true;
    measured_.push_back(param);
  }
  m.norm = at::Tensor();
  m.sum_squares = stats.sum_squares;
  m.finite = stats.finite;
}

GradNorm GradNorms::take() {
  GradNorm out;
  std::vector<at::Tensor> device;
  std::sort(measured_.begin(), measured_.end());  // (parameter order: the header)
  for (std::size_t i : measured_) {
    const Measure& m = measures_[i];
    if (m.norm.defined()) {
      device.push_back(m.norm);
    } else {
      out.sum_squares += m.sum_squares;
      out.finite = out.finite && m.finite;
    }
  }
  if (!device.empty()) {
    c10::NoGradGuard no_grad;
    // Squares in double: an fp16 run's scaled norms may square past fp32.
    const double squares = at::stack(device).to(at::kDouble).square().sum().item<double>();
    out.sum_squares += squares;
    out.finite = out.finite && std::isfinite(squares);
  }
  clear();
  return out;
}

void GradNorms::clear() {
  for (std::size_t i : measured_) {
    Measure& m = measures_[i];
    m.measured = false;
    m.norm = at::Tensor();
  }
  measured_.clear();
}

}  // namespace tidal::hooks
