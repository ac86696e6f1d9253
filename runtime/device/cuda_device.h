// The CUDA backend: cudart streams and events, cudaMalloc'd device memory and
// cudaHostRegister'd host memory. Only declared when TIDAL_WITH_CUDA is set.
#pragma once

#include <memory>
#include <string>

#include "runtime/device/device.h"

namespace tidal {

// Number of CUDA devices the driver reports; 0 when no driver is loaded or
// there is no GPU. `why_none`, when given, receives the reason for a 0.
int count_cuda_devices(std::string* why_none);

// Opens CUDA device `ordinal`. capacity_bytes == 0 means the device's total
// memory. Throws ValueError if the device does not exist.
std::shared_ptr<Device> make_cuda_device(int ordinal = 0, std::size_t capacity_bytes = 0);

}  // namespace tidal
