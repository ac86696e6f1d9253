#include "runtime/device/device.h"

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "runtime/core/error.h"

namespace tidal {

const char* to_string(DeviceBackend backend) {
  switch (backend) {
    case DeviceBackend::kCuda:
      return "cuda";
    case DeviceBackend::kSimulated:
      return "sim";
  }
  return "unknown";
}

const char* to_string(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice:
      return "host-to-device";
    case CopyKind::kDeviceToHost:
      return "device-to-host";
    case CopyKind::kDeviceToDevice:
      return "device-to-device";
  }
  return "unknown";
}

void Stream::wait(const Event& event) {
  TIDAL_CHECK(&event.device() == &device(), "Stream::wait: stream '", name(),
              "' cannot wait on an event of another device");
  do_wait(event);
}

void Event::record(Stream& stream) {
  TIDAL_CHECK(&stream.device() == &device(), "Event::record: stream '", stream.name(),
              "' belongs to another device");
  do_record(stream);
}

double Event::elapsed_seconds_since(const Event& start) const {
  TIDAL_CHECK(&start.device() == &device(),
              "elapsed_seconds_since: the start event belongs to another device");
  TIDAL_CHECK(timing_ && start.timing_,
              "elapsed_seconds_since: both events must be created with enable_timing=true");
  return do_elapsed_seconds_since(start);
}

DeviceBuffer::~DeviceBuffer() {
  // A destructor must not throw: after a sticky CUDA error the free fails, and throwing
  // here would terminate the process (Note [No throwing from CUDA destructors] in
  // cuda_device.cpp). Report once and drop the pointer; the device's accounting keeps it
  // live, which is true of a device that can no longer free anything.
  try {
    reset();
  } catch (const std::exception& e) {
    static std::atomic<bool> reported{false};
    if (!reported.exchange(true)) {
      std::fprintf(stderr,
                   "tidal: warning: freeing a device buffer failed: %s (further failures "
                   "while freeing device buffers are not reported)\n",
                   e.what());
    }
    data_ = nullptr;
    bytes_ = 0;
    device_.reset();
  }
}

void DeviceBuffer::reset() {
  if (data_ != nullptr) {
    device_->free_raw(data_);
    data_ = nullptr;
    bytes_ = 0;
  }
  device_.reset();
}

Device::Device(DeviceBackend backend, std::size_t physical_bytes, std::size_t capacity_bytes)
    : backend_(backend), physical_bytes_(physical_bytes), capacity_(capacity_bytes) {
  TIDAL_CHECK(capacity_bytes <= physical_bytes, "device capacity ", format_bytes(capacity_bytes),
              " exceeds the device's memory ", format_bytes(physical_bytes));
  stats_.capacity_bytes = capacity_bytes;
}

void Device::throw_out_of_memory(std::size_t requested, const char* reason) {
  ++stats_.failed_allocations;
  TIDAL_THROW(OutOfMemoryError, to_string(backend_), " device out of memory: tried to allocate ",
              format_bytes(requested), "; ", format_bytes(stats_.in_use_bytes), " in use in ",
              stats_.live_allocations, " allocations, capacity ", format_bytes(capacity_), " (",
              format_bytes(capacity_ - stats_.in_use_bytes), " free); ", reason);
}

void* Device::allocate_raw(std::size_t bytes) {
  TIDAL_CHECK(bytes > 0, "device allocate: expected a positive byte count, got 0");
  std::lock_guard<std::mutex> lock(mutex_);
  if (bytes > capacity_ - stats_.in_use_bytes) {
    throw_out_of_memory(bytes, "the request exceeds the free capacity");
  }
  // Note [Device memory providers]: the provider, when one is set, replaces
  // the backend; the accounting below is the same for both.
  std::shared_ptr<DeviceMemoryProvider> provider = provider_;
  void* ptr = provider ? do_allocate_from(*provider, bytes) : do_allocate(bytes);
  if (ptr == nullptr) {
    throw_out_of_memory(bytes, provider
                                   ? "the memory provider has no block of that size"
                                   : "the backend could not find a free block of that size "
                                     "(memory outside tidal's accounting or fragmentation)");
  }
  const bool provided = provider != nullptr;
  const auto [it, inserted] =
      live_.emplace(reinterpret_cast<std::uintptr_t>(ptr), Allocation{bytes, std::move(provider)});
  TIDAL_INTERNAL_ASSERT(inserted, "backend or provider returned live pointer ", ptr, " twice");
  (void)it;
  stats_.in_use_bytes += bytes;
  if (provided) stats_.provided_bytes += bytes;
  stats_.peak_in_use_bytes = std::max(stats_.peak_in_use_bytes, stats_.in_use_bytes);
  stats_.live_allocations = live_.size();
  ++stats_.allocations;
  return ptr;
}

DeviceBuffer Device::allocate(std::size_t bytes) {
  void* ptr = allocate_raw(bytes);
  return DeviceBuffer(shared_from_this(), ptr, bytes);
}

void Device::free_raw(void* ptr) {
  if (ptr == nullptr) return;
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = live_.find(reinterpret_cast<std::uintptr_t>(ptr));
  TIDAL_CHECK(it != live_.end(), "device free: ", ptr, " is not a live allocation of this ",
              to_string(backend_), " device (double free or foreign pointer)");
  // Back to where it came from, whatever the provider is now.
  if (it->second.provider) {
    do_free_to(*it->second.provider, ptr);
    stats_.provided_bytes -= it->second.bytes;
  } else {
    do_free(ptr);
  }
  stats_.in_use_bytes -= it->second.bytes;
  live_.erase(it);
  stats_.live_allocations = live_.size();
  ++stats_.frees;
}

void Device::set_memory_provider(std::shared_ptr<DeviceMemoryProvider> provider) {
  std::lock_guard<std::mutex> lock(mutex_);
  provider_ = std::move(provider);
}

std::shared_ptr<DeviceMemoryProvider> Device::memory_provider() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return provider_;
}

std::size_t Device::capacity() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return capacity_;
}

void Device::set_capacity(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  TIDAL_CHECK(bytes <= physical_bytes_, "device capacity ", format_bytes(bytes),
              " exceeds the device's memory ", format_bytes(physical_bytes_));
  TIDAL_CHECK(bytes >= stats_.in_use_bytes, "device capacity ", format_bytes(bytes),
              " is below the ", format_bytes(stats_.in_use_bytes),
              " already in use; free memory first");
  capacity_ = bytes;
  stats_.capacity_bytes = bytes;
}

DeviceMemoryStats Device::memory_stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return stats_;
}

void Device::reset_peak_memory() {
  std::lock_guard<std::mutex> lock(mutex_);
  stats_.peak_in_use_bytes = stats_.in_use_bytes;
}

bool Device::owns(const void* ptr, std::size_t bytes) const {
  const auto p = reinterpret_cast<std::uintptr_t>(ptr);
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = live_.upper_bound(p);
  if (it == live_.begin()) return false;
  --it;
  const std::size_t size = it->second.bytes;
  return p >= it->first && bytes <= size && p - it->first <= size - bytes;
}

void Device::check_device_range(const void* ptr, std::size_t bytes, const char* role,
                                CopyKind kind) const {
  TIDAL_CHECK(owns(ptr, bytes), to_string(kind), " copy of ", format_bytes(bytes), ": the ", role,
              " ", ptr, " .. +", bytes, " is not inside a live allocation of this ",
              to_string(backend_), " device");
}

std::unique_ptr<Stream> Device::create_stream(std::string name) {
  TIDAL_CHECK(!name.empty(), "create_stream: expected a non-empty stream name");
  return do_create_stream(std::move(name));
}

std::unique_ptr<Stream> Device::wrap_external_stream(std::uintptr_t handle, std::string name) {
  TIDAL_CHECK(!name.empty(), "wrap_external_stream: expected a non-empty stream name");
  return do_wrap_external_stream(handle, std::move(name));
}

std::unique_ptr<Event> Device::create_event(bool enable_timing) {
  return do_create_event(enable_timing);
}

bool Device::check_copy(const char* who, const void* dst, const void* src, std::size_t bytes,
                        const Stream& stream) const {
  TIDAL_CHECK(&stream.device() == this, who, ": stream '", stream.name(), "' belongs to another device");
  if (bytes == 0) return false;
  TIDAL_CHECK(dst != nullptr && src != nullptr, who, ": null pointer (dst=", dst, ", src=", src, ")");
  const auto d = reinterpret_cast<std::uintptr_t>(dst);
  const auto s = reinterpret_cast<std::uintptr_t>(src);
  TIDAL_CHECK(d + bytes <= s || s + bytes <= d, who, ": source and destination overlap (dst=", dst,
              ", src=", src, ", bytes=", bytes, ")");
  return true;
}

void Device::copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                        Stream& stream) {
  if (!check_copy("copy_async", dst, src, bytes, stream)) return;
  if (kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToDevice) {
    check_device_range(dst, bytes, "destination", kind);
  }
  // A device pointer on the host side means the caller mixed up the kind.
  if (kind == CopyKind::kHostToDevice) {
    TIDAL_CHECK(!owns(src, 1), "host-to-device copy: the source ", src,
                " is device memory; expected host memory (use CopyKind::kDeviceToDevice)");
  }
  if (kind == CopyKind::kDeviceToHost) {
    TIDAL_CHECK(!owns(dst, 1), "device-to-host copy: the destination ", dst,
                " is device memory; expected host memory (use CopyKind::kDeviceToDevice)");
  }
  if (kind == CopyKind::kDeviceToHost || kind == CopyKind::kDeviceToDevice) {
    check_device_range(src, bytes, "source", kind);
  }
  do_copy_async(dst, src, bytes, kind, stream);
}

void Device::copy_async_external(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                                 Stream& stream) {
  TIDAL_CHECK(kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToHost,
              "copy_async_external: expected a host-to-device or device-to-host copy, got ",
              to_string(kind));
  if (!check_copy("copy_async_external", dst, src, bytes, stream)) return;
  const void* host = kind == CopyKind::kHostToDevice ? src : dst;
  TIDAL_CHECK(!owns(host, 1), to_string(kind), " copy: the host side ", host,
              " is memory of this device; expected host memory");
  do_copy_async(dst, src, bytes, kind, stream);
}

}  // namespace tidal
