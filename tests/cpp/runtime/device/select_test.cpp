#include "runtime/device/select.h"

#include <gtest/gtest.h>

#include <string>

#include "runtime/core/error.h"

namespace tidal {
namespace {

TEST(DeviceSelection, ParsesTheThreeKinds) {
  EXPECT_EQ(parse_device_kind("auto"), DeviceKind::kAuto);
  EXPECT_EQ(parse_device_kind("cuda"), DeviceKind::kCuda);
  EXPECT_EQ(parse_device_kind("sim"), DeviceKind::kSim);
  try {
    parse_device_kind("gpu");
    FAIL() << "accepted \"gpu\"";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("\"gpu\""), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("\"sim\""), std::string::npos) << e.message();
  }
}

TEST(DeviceSelection, SimIsAlwaysTheSimulatedDevice) {
  EXPECT_EQ(create_device(DeviceKind::kSim, {.capacity_bytes = 1 << 20})->backend(),
            DeviceBackend::kSimulated);
}

TEST(DeviceSelection, AutoTakesTheGpuWhenThereIsOne) {
  const auto device = create_device(DeviceKind::kAuto, {.capacity_bytes = 1 << 20});
  EXPECT_EQ(device->backend(),
            cuda_device_count() > 0 ? DeviceBackend::kCuda : DeviceBackend::kSimulated);
}

TEST(DeviceSelection, CudaWithoutAGpuSaysWhyAndWhatToDo) {
  std::string why;
  if (cuda_device_count(&why) > 0) {
    EXPECT_EQ(create_device(DeviceKind::kCuda)->backend(), DeviceBackend::kCuda);
    return;
  }
  EXPECT_FALSE(why.empty());
  try {
    create_device(DeviceKind::kCuda);
    FAIL() << "device \"cuda\" created without a GPU";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find(why), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("TIDAL_DEVICE=sim"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace tidal
