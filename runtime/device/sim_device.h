// The simulated device: a capacity-limited host arena standing in for device
// memory, with streams whose work runs asynchronously on worker threads and
// copies that take the time a configured link bandwidth says they take. It
// lets every scheduling path run, and be tested, on a machine without a GPU.
// See Note [Simulated copies land late].
//
// Note [Simulated copies land late]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A copy on a simulated stream takes its transfer time (latency + bytes /
// bandwidth, with host-to-device and device-to-host each one shared "copy
// engine", as on a PCIe GPU), and moves the bytes in the last part of it:
// the memcpy starts its estimated duration before the transfer's deadline.
// So code that reads a destination before waiting on an event sees stale
// data, and ThreadSanitizer reports the race: a missing wait cannot pass
// unnoticed. With bandwidth 0 (unlimited) copies run at memcpy speed, still
// on the worker thread.
#pragma once

#include <cstddef>
#include <memory>

#include "runtime/device/device.h"

namespace tidal {

struct SimDeviceOptions {
  // Size of the arena: the simulated device's memory.
  std::size_t capacity_bytes = std::size_t{8} << 30;
  // Link bandwidth each way in bytes/s; 0 = unlimited.
  double copy_bandwidth_bytes_per_s = 0;
  // Fixed cost per copy in seconds (PCIe is a few microseconds).
  double copy_latency_s = 0;
  // What pinning host memory costs, in bytes/s (register_host sleeps
  // bytes / rate, as cudaHostRegister takes time in proportion to the pages:
  // about 6 GB/s measured on an H100's host); 0 = free.
  double pin_bandwidth_bytes_per_s = 0;
};

// Reads TIDAL_SIM_CAPACITY ("8GiB"), TIDAL_SIM_BANDWIDTH ("12GB/s"),
// TIDAL_SIM_LATENCY_US and TIDAL_SIM_PIN_BANDWIDTH ("6GB/s") from the
// environment over the defaults.
SimDeviceOptions sim_device_options_from_env();

std::shared_ptr<Device> make_sim_device(const SimDeviceOptions& options = {});

}  // namespace tidal
