#include "runtime/device/select.h"

#include <cstdlib>
#include <mutex>

#include "runtime/core/error.h"

#if defined(TIDAL_WITH_CUDA)
#include "runtime/device/cuda_device.h"
#endif

namespace tidal {
namespace {

std::mutex g_default_mutex;
std::shared_ptr<Device> g_default_device;

}  // namespace

DeviceKind parse_device_kind(std::string_view text) {
  if (text == "auto") return DeviceKind::kAuto;
  if (text == "cuda") return DeviceKind::kCuda;
  if (text == "sim") return DeviceKind::kSim;
  TIDAL_THROW(ValueError, "unknown device \"", text, "\": expected \"auto\", \"cuda\" or \"sim\"");
}

const char* to_string(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kAuto:
      return "auto";
    case DeviceKind::kCuda:
      return "cuda";
    case DeviceKind::kSim:
      return "sim";
  }
  return "unknown";
}

bool cuda_backend_compiled() {
#if defined(TIDAL_WITH_CUDA)
  return true;
#else
  return false;
#endif
}

int cuda_device_count(std::string* why_none) {
#if defined(TIDAL_WITH_CUDA)
  return count_cuda_devices(why_none);
#else
  if (why_none != nullptr) *why_none = "tidal was built without the CUDA backend (TIDAL_WITH_CUDA=OFF)";
  return 0;
#endif
}

std::shared_ptr<Device> create_device(DeviceKind kind, const SimDeviceOptions& sim_options) {
  std::string why;
  const int gpus = kind == DeviceKind::kSim ? 0 : cuda_device_count(&why);
  if (kind == DeviceKind::kCuda) {
    TIDAL_CHECK(gpus > 0, "device \"cuda\" requested but no GPU is usable: ", why,
                ". Use device \"sim\" (TIDAL_DEVICE=sim) to run on the simulated device.");
  }
#if defined(TIDAL_WITH_CUDA)
  if (gpus > 0) return make_cuda_device(0);
#endif
  return make_sim_device(sim_options);
}

std::shared_ptr<Device> default_device() {
  std::lock_guard<std::mutex> lock(g_default_mutex);
  if (!g_default_device) {
    const char* env = std::getenv("TIDAL_DEVICE");
    const DeviceKind kind = env == nullptr || *env == '\0' ? DeviceKind::kAuto : parse_device_kind(env);
    g_default_device = create_device(kind);
  }
  return g_default_device;
}

void set_default_device(std::shared_ptr<Device> device) {
  TIDAL_CHECK(device != nullptr, "set_default_device: expected a device, got null");
  std::lock_guard<std::mutex> lock(g_default_mutex);
  g_default_device = std::move(device);
}

}  // namespace tidal
