#include "cpu_adam/simd_target.h"

#include <gtest/gtest.h>

#include <algorithm>

namespace tidal::cpu_adam {
namespace {

TEST(SimdTarget, ChosenTargetIsTheBestRunnableOne) {
  const std::vector<std::string> runnable = runnable_simd_targets();
  ASSERT_FALSE(runnable.empty());
  // Dispatch must pick the first (best) runnable target, never a scalar
  // fallback when a vector target is available.
  EXPECT_EQ(chosen_simd_target(), runnable.front());
}

}  // namespace
}  // namespace tidal::cpu_adam
