// Runs only under the fake CUDA runtime (tests/fake_cuda, ctest -L fake_cuda): a sticky
// CUDA error is injected with the fake's fake_cuda_set_sticky_error hook, as a real GPU
// would raise one after an illegal address. Checks Note [No throwing from CUDA
// destructors] (runtime/device/cuda_device.cpp): releasing streams, events, device and
// pinned host buffers afterwards must not terminate the process, and the next API call
// must throw a tidal::Error naming the CUDA error.
#include <dlfcn.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "runtime/core/error.h"
#include "runtime/device/select.h"
#include "runtime/memory/host_buffer.h"

namespace tidal {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr int kCudaErrorIllegalAddress = 700;

using SetStickyError = void (*)(int);

SetStickyError fake_sticky_hook() {
  return reinterpret_cast<SetStickyError>(dlsym(RTLD_DEFAULT, "fake_cuda_set_sticky_error"));
}

TEST(FakeCudaStickyError, ReleasingAfterAStickyErrorDoesNotTerminateAndTheNextCallNamesIt) {
  const SetStickyError set_sticky = fake_sticky_hook();
  ASSERT_NE(set_sticky, nullptr) << "run under LD_PRELOAD=libfakecudart.so (ctest -L fake_cuda)";
  std::shared_ptr<Device> device = create_device(DeviceKind::kCuda);
  ASSERT_EQ(device->info().backend, DeviceBackend::kCuda);
  {
    std::unique_ptr<Stream> stream = device->create_stream("copy");
    std::unique_ptr<Event> event = device->create_event(true);
    DeviceBuffer on_device = device->allocate(kMiB);
    HostBuffer pinned(kMiB, device);
    ASSERT_TRUE(pinned.pinned());
    std::memset(pinned.data(), 7, kMiB);
    device->copy_async(on_device.data(), pinned.data(), kMiB, CopyKind::kHostToDevice, *stream);
    event->record(*stream);
    set_sticky(kCudaErrorIllegalAddress);
    // Destructors run here, in reverse order: HostBuffer (unregister fails), DeviceBuffer
    // (cudaFree fails), Event, Stream (synchronize, destroy fail). Before the fix the
    // DeviceBuffer's destructor threw and the process terminated.
  }
  try {
    DeviceBuffer more = device->allocate(kMiB);
    FAIL() << "allocate after a sticky CUDA error returned normally";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaErrorIllegalAddress"), std::string::npos) << e.what();
  }
  try {
    std::unique_ptr<Stream> stream = device->create_stream("after");
    FAIL() << "create_stream after a sticky CUDA error returned normally";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cudaErrorIllegalAddress"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tidal
