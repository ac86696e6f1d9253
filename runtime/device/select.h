// The one place a backend is chosen. See Note [Device selection].
//
// Note [Device selection]
// ~~~~~~~~~~~~~~~~~~~~~~~
// "auto" takes CUDA device 0 when the CUDA backend is compiled in and the
// driver reports a GPU, and the simulated device otherwise. "cuda" insists
// on a GPU and says why there is none; "sim" always takes the simulated
// device. The process-wide default device is created on first use from
// TIDAL_DEVICE (auto|cuda|sim, default auto); the simulated device reads its
// options from TIDAL_SIM_* (sim_device.h).
#pragma once

#include <memory>
#include <ostream>
#include <string>
#include <string_view>

#include "runtime/device/device.h"
#include "runtime/device/sim_device.h"

namespace tidal {

enum class DeviceKind { kAuto, kCuda, kSim };

// "auto", "cuda" or "sim"; anything else is a ValueError naming the value.
DeviceKind parse_device_kind(std::string_view text);
const char* to_string(DeviceKind kind);
// For GoogleTest and logs: prints "sim", not the enum's bytes.
inline void PrintTo(DeviceKind kind, std::ostream* os) { *os << to_string(kind); }

bool cuda_backend_compiled();
// GPUs the CUDA driver reports; 0 when none or when built without CUDA, with
// the reason in `why_none` when given.
int cuda_device_count(std::string* why_none = nullptr);

std::shared_ptr<Device> create_device(DeviceKind kind,
                                      const SimDeviceOptions& sim_options = sim_device_options_from_env());

// The process-wide device: created on first use from TIDAL_DEVICE.
std::shared_ptr<Device> default_device();
// Replaces the process-wide device (e.g. tidal.set_device("sim", ...)).
void set_default_device(std::shared_ptr<Device> device);

}  // namespace tidal
