#include "runtime/device/cuda_device.h"

#include <cuda_runtime_api.h>

#include <atomic>
#include <cstdio>
#include <new>
#include <string>
#include <utility>

#include "runtime/core/error.h"

#define TIDAL_CUDA_CHECK(expr)                                                                \
  do {                                                                                        \
    const cudaError_t tidal_cuda_status = (expr);                                            \
    TIDAL_CHECK_RUNTIME(tidal_cuda_status == cudaSuccess, "CUDA error in `", #expr, "`: ",   \
                        cudaGetErrorName(tidal_cuda_status), ": ",                           \
                        cudaGetErrorString(tidal_cuda_status));                               \
  } while (false)

namespace tidal {
namespace {

// Note [No throwing from CUDA destructors]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After a sticky CUDA error (an illegal address, a launch failure) every runtime call
// returns that error, cudaStreamDestroy and cudaFree included. A destructor that threw
// then would std::terminate the process, taking the Python interpreter with it, before
// any API call could raise a tidal error naming the CUDA error. So destructors (and the
// DeviceGuard they use) report a failed call once on stderr and go on; the next API call
// throws, since the error is sticky. Only the first report is printed: after a sticky
// error every destructor fails the same way.
void report_destructor_error(const char* call, cudaError_t status) {
  if (status == cudaSuccess) return;
  static std::atomic<bool> reported{false};
  if (reported.exchange(true)) return;
  std::fprintf(stderr,
               "tidal: warning: %s failed while releasing a CUDA resource: %s: %s (further "
               "failures while releasing are not reported; the next CUDA call raises it)\n",
               call, cudaGetErrorName(status), cudaGetErrorString(status));
}

// Makes `ordinal` the current device for the calling thread while in scope.
// The std::nothrow_t form is for destructors: it reports failures instead of throwing
// (Note [No throwing from CUDA destructors]).
class DeviceGuard {
 public:
  explicit DeviceGuard(int ordinal) {
    TIDAL_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != ordinal) TIDAL_CUDA_CHECK(cudaSetDevice(ordinal));
    changed_ = previous_ != ordinal;
  }
  DeviceGuard(int ordinal, std::nothrow_t) noexcept {
    const cudaError_t status = cudaGetDevice(&previous_);
    report_destructor_error("cudaGetDevice", status);
    if (status != cudaSuccess || previous_ == ordinal) return;
    const cudaError_t set = cudaSetDevice(ordinal);
    report_destructor_error("cudaSetDevice", set);
    changed_ = set == cudaSuccess;
  }
  ~DeviceGuard() {
    if (changed_) report_destructor_error("cudaSetDevice", cudaSetDevice(previous_));
  }

 private:
  int previous_ = 0;
  bool changed_ = false;
};

class CudaStream final : public Stream {
 public:
  CudaStream(std::shared_ptr<Device> device, std::string name, int ordinal)
      : Stream(std::move(device), std::move(name)), ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    TIDAL_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  // Non-owning: wraps a stream created elsewhere (torch's compute stream).
  CudaStream(std::shared_ptr<Device> device, std::string name, int ordinal, cudaStream_t external)
      : Stream(std::move(device), std::move(name)), ordinal_(ordinal), stream_(external),
        owned_(false) {}
  ~CudaStream() override {
    if (!owned_) return;
    // Unlike cudaStreamDestroy alone, wait for pending work: the contract
    // promises that destroying a stream completes what was queued on it.
    // Never throws (Note [No throwing from CUDA destructors]).
    DeviceGuard guard(ordinal_, std::nothrow);
    report_destructor_error("cudaStreamSynchronize", cudaStreamSynchronize(stream_));
    report_destructor_error("cudaStreamDestroy", cudaStreamDestroy(stream_));
  }

  void do_wait(const Event& event) override;
  void synchronize() override { TIDAL_CUDA_CHECK(cudaStreamSynchronize(stream_)); }
  bool query() override {
    const cudaError_t status = cudaStreamQuery(stream_);
    if (status == cudaErrorNotReady) return false;
    TIDAL_CUDA_CHECK(status);
    return true;
  }

  cudaStream_t handle() const { return stream_; }

 private:
  int ordinal_;
  cudaStream_t stream_ = nullptr;
  bool owned_ = true;
};

class CudaEvent final : public Event {
 public:
  CudaEvent(std::shared_ptr<Device> device, int ordinal, bool timing)
      : Event(std::move(device), timing), ordinal_(ordinal) {
    DeviceGuard guard(ordinal_);
    TIDAL_CUDA_CHECK(cudaEventCreateWithFlags(
        &event_, timing ? cudaEventDefault : cudaEventDisableTiming));
  }
  ~CudaEvent() override { report_destructor_error("cudaEventDestroy", cudaEventDestroy(event_)); }

  void do_record(Stream& stream) override {
    auto* cuda = dynamic_cast<CudaStream*>(&stream);
    TIDAL_INTERNAL_ASSERT(cuda != nullptr, "stream of a CUDA device is not a CudaStream");
    TIDAL_CUDA_CHECK(cudaEventRecord(event_, cuda->handle()));
  }
  bool query() const override {
    const cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    TIDAL_CUDA_CHECK(status);
    return true;
  }
  void synchronize() const override { TIDAL_CUDA_CHECK(cudaEventSynchronize(event_)); }
  double do_elapsed_seconds_since(const Event& start) const override {
    const auto* other = dynamic_cast<const CudaEvent*>(&start);
    TIDAL_INTERNAL_ASSERT(other != nullptr, "event of a CUDA device is not a CudaEvent");
    float ms = 0;
    TIDAL_CUDA_CHECK(cudaEventElapsedTime(&ms, other->event_, event_));
    return ms * 1e-3;
  }

  cudaEvent_t handle() const { return event_; }

 private:
  int ordinal_;
  cudaEvent_t event_ = nullptr;
};

void CudaStream::do_wait(const Event& event) {
  const auto* cuda = dynamic_cast<const CudaEvent*>(&event);
  TIDAL_INTERNAL_ASSERT(cuda != nullptr, "event of a CUDA device is not a CudaEvent");
  TIDAL_CUDA_CHECK(cudaStreamWaitEvent(stream_, cuda->handle(), 0));
}

// {free, total} bytes of device `ordinal` now.
std::pair<std::size_t, std::size_t> memory_info(int ordinal) {
  DeviceGuard guard(ordinal);
  std::size_t free_bytes = 0;
  std::size_t total_bytes = 0;
  TIDAL_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
  return {free_bytes, total_bytes};
}

class CudaDevice final : public Device {
 public:
  CudaDevice(int ordinal, std::size_t total, std::size_t capacity)
      : Device(DeviceBackend::kCuda, total, capacity), ordinal_(ordinal) {
    TIDAL_CUDA_CHECK(cudaGetDeviceProperties(&props_, ordinal_));
  }

  DeviceInfo info() const override {
    DeviceInfo out;
    out.backend = DeviceBackend::kCuda;
    out.name = props_.name;
    out.ordinal = ordinal_;
    out.total_memory_bytes = physical_bytes();
    out.capacity_bytes = capacity();
    out.free_memory_bytes = memory_info(ordinal_).first;
    out.pinned_host_memory = true;
    out.copy_bandwidth_bytes_per_s = 0;
    return out;
  }

  void synchronize() override {
    DeviceGuard guard(ordinal_);
    TIDAL_CUDA_CHECK(cudaDeviceSynchronize());
  }

  bool register_host(void* ptr, std::size_t bytes) override {
    TIDAL_CUDA_CHECK(cudaHostRegister(ptr, bytes, cudaHostRegisterDefault));
    return true;
  }
  void unregister_host(void* ptr) override { TIDAL_CUDA_CHECK(cudaHostUnregister(ptr)); }

 protected:
  void* do_allocate(std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    void* ptr = nullptr;
    const cudaError_t status = cudaMalloc(&ptr, bytes);
    if (status == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the sticky-free error state
      return nullptr;
    }
    TIDAL_CUDA_CHECK(status);
    return ptr;
  }
  void do_free(void* ptr) override {
    DeviceGuard guard(ordinal_);
    TIDAL_CUDA_CHECK(cudaFree(ptr));
  }
  // Note [Device memory providers]: a provider allocates on the current
  // device (torch's caching allocator does), so this device is made current.
  void* do_allocate_from(DeviceMemoryProvider& provider, std::size_t bytes) override {
    DeviceGuard guard(ordinal_);
    return provider.allocate(bytes);
  }
  void do_free_to(DeviceMemoryProvider& provider, void* ptr) override {
    DeviceGuard guard(ordinal_);
    provider.free(ptr);
  }
  std::unique_ptr<Stream> do_create_stream(std::string name) override {
    return std::make_unique<CudaStream>(shared_from_this(), std::move(name), ordinal_);
  }
  std::unique_ptr<Stream> do_wrap_external_stream(std::uintptr_t handle, std::string name) override {
    // 0 is CUDA's legacy default stream, a valid stream to order against.
    return std::make_unique<CudaStream>(shared_from_this(), std::move(name), ordinal_,
                                        reinterpret_cast<cudaStream_t>(handle));
  }
  std::unique_ptr<Event> do_create_event(bool enable_timing) override {
    return std::make_unique<CudaEvent>(shared_from_this(), ordinal_, enable_timing);
  }
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                     Stream& stream) override {
    auto* cuda = dynamic_cast<CudaStream*>(&stream);
    TIDAL_INTERNAL_ASSERT(cuda != nullptr, "stream of a CUDA device is not a CudaStream");
    const cudaMemcpyKind cuda_kind = kind == CopyKind::kHostToDevice   ? cudaMemcpyHostToDevice
                                     : kind == CopyKind::kDeviceToHost ? cudaMemcpyDeviceToHost
                                                                       : cudaMemcpyDeviceToDevice;
    DeviceGuard guard(ordinal_);
    TIDAL_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cuda_kind, cuda->handle()));
  }

 private:
  int ordinal_;
  cudaDeviceProp props_{};
};

}  // namespace

int count_cuda_devices(std::string* why_none) {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    if (why_none != nullptr) {
      *why_none = std::string("cudaGetDeviceCount failed: ") + cudaGetErrorName(status) + ": " +
                  cudaGetErrorString(status);
    }
    cudaGetLastError();
    return 0;
  }
  if (count == 0 && why_none != nullptr) *why_none = "the CUDA driver reports no GPU";
  return count;
}

std::shared_ptr<Device> make_cuda_device(int ordinal, std::size_t capacity_bytes) {
  std::string why;
  const int count = count_cuda_devices(&why);
  TIDAL_CHECK(ordinal >= 0 && ordinal < count, "CUDA device ", ordinal, " does not exist: ",
              count == 0 ? why : std::to_string(count) + " device(s) present");
  const std::size_t total = memory_info(ordinal).second;
  return std::make_shared<CudaDevice>(ordinal, total, capacity_bytes == 0 ? total : capacity_bytes);
}

}  // namespace tidal
