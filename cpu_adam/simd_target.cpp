#include "cpu_adam/simd_target.h"

// Highway's per-target compilation: this file is re-included once per target.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu_adam/simd_target.cpp"
#include "hwy/foreach_target.h"  // IWYU pragma: keep
#include "hwy/highway.h"

HWY_BEFORE_NAMESPACE();
namespace tidal::cpu_adam {
namespace HWY_NAMESPACE {

// Compiled once per target; the dispatched copy names the target it was built for.
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace HWY_NAMESPACE
}  // namespace tidal::cpu_adam
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace tidal::cpu_adam {

HWY_EXPORT(TargetName);

std::string chosen_simd_target() { return HWY_DYNAMIC_DISPATCH(TargetName)(); }

std::vector<std::string> runnable_simd_targets() {
  std::vector<std::string> out;
  for (std::int64_t targets = hwy::SupportedTargets() & HWY_TARGETS; targets != 0;
       targets &= targets - 1) {
    const std::int64_t lowest = targets & -targets;  // lower bit = better target
    out.emplace_back(hwy::TargetName(lowest));
  }
  return out;
}

}  // namespace tidal::cpu_adam
#endif  // HWY_ONCE
