#include "runtime/memory/host_buffer.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <mutex>
#include <utility>

#include "runtime/core/error.h"
#include "runtime/device/device.h"
#include "runtime/memory/mimalloc_api.h"

namespace tidal {
namespace {

std::mutex g_stats_mutex;
HostMemoryStats g_stats;

void count_allocation(std::size_t bytes, bool huge) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  g_stats.allocated_bytes += bytes;
  g_stats.peak_allocated_bytes = std::max(g_stats.peak_allocated_bytes, g_stats.allocated_bytes);
  if (huge) g_stats.huge_page_bytes += bytes;
  ++g_stats.live_buffers;
}

void count_free(std::size_t bytes, bool huge) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  g_stats.allocated_bytes -= bytes;
  if (huge) g_stats.huge_page_bytes -= bytes;
  --g_stats.live_buffers;
}

void count_pinned(std::size_t bytes, bool add) {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  if (add) {
    g_stats.pinned_bytes += bytes;
  } else {
    g_stats.pinned_bytes -= bytes;
  }
}

}  // namespace

HostMemoryStats host_memory_stats() {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  return g_stats;
}

void reset_host_memory_peak() {
  std::lock_guard<std::mutex> lock(g_stats_mutex);
  g_stats.peak_allocated_bytes = g_stats.allocated_bytes;
}

HostBuffer::HostBuffer(std::size_t bytes, std::size_t alignment) {
  TIDAL_CHECK(bytes > 0, "host buffer: expected a positive byte count, got 0");
  TIDAL_CHECK(alignment >= kDefaultAlignment && (alignment & (alignment - 1)) == 0,
              "host buffer: alignment must be a power of two >= ", kDefaultAlignment, ", got ",
              alignment);
  // NB: every buffer owns whole pages. cudaHostRegister pins pages, and two
  // buffers sharing a page could not both be pinned (the second registration
  // fails with cudaErrorHostMemoryAlreadyRegistered).
  static const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  const bool huge = bytes >= kHugePageBytes;
  alignment = std::max({alignment, page, huge ? kHugePageBytes : std::size_t{0}});
  const std::size_t reserved = (bytes + page - 1) / page * page;
  void* ptr = mimalloc().malloc_aligned(reserved, alignment);
  TIDAL_CHECK_WITH(OutOfMemoryError, ptr != nullptr, "host out of memory: could not allocate ",
                   format_bytes(bytes), " aligned to ", alignment, " bytes (",
                   format_bytes(host_memory_stats().allocated_bytes), " already held by tidal)");
  // Transparent huge pages where the kernel offers them; a refusal is fine.
  huge_pages_ = huge && ::madvise(ptr, reserved / kHugePageBytes * kHugePageBytes, MADV_HUGEPAGE) == 0;
  data_ = ptr;
  bytes_ = bytes;
  reserved_ = reserved;
  alignment_ = alignment;
  count_allocation(bytes_, huge_pages_);
}

HostBuffer::HostBuffer(std::size_t bytes, std::shared_ptr<Device> pin_with, std::size_t alignment)
    : HostBuffer(bytes, alignment) {
  pin(std::move(pin_with));
}

HostBuffer::HostBuffer(HostBuffer&& other) noexcept { swap(other); }

HostBuffer& HostBuffer::operator=(HostBuffer&& other) noexcept {
  HostBuffer(std::move(other)).swap(*this);
  return *this;
}

HostBuffer::~HostBuffer() {
  try {
    reset();
  } catch (const std::exception& e) {
    // A destructor must not throw; unregistering failed, the memory is freed
    // by the OS at exit at the latest.
    std::fprintf(stderr, "tidal: warning: releasing a host buffer failed: %s\n", e.what());
  }
}

void HostBuffer::swap(HostBuffer& other) noexcept {
  std::swap(data_, other.data_);
  std::swap(bytes_, other.bytes_);
  std::swap(reserved_, other.reserved_);
  std::swap(alignment_, other.alignment_);
  std::swap(huge_pages_, other.huge_pages_);
  std::swap(pinned_, other.pinned_);
  std::swap(registered_with_, other.registered_with_);
}

bool HostBuffer::pin(std::shared_ptr<Device> device) {
  TIDAL_CHECK(device != nullptr, "HostBuffer::pin: expected a device, got null");
  TIDAL_CHECK(data_ != nullptr, "HostBuffer::pin: the buffer is empty");
  TIDAL_CHECK(registered_with_ == nullptr, "HostBuffer::pin: the buffer of ", format_bytes(bytes_),
              " is already registered with a device");
  pinned_ = device->register_host(data_, reserved_);
  registered_with_ = std::move(device);
  if (pinned_) count_pinned(bytes_, true);
  return pinned_;
}

void HostBuffer::unpin() {
  if (registered_with_ == nullptr) return;
  registered_with_->unregister_host(data_);
  if (pinned_) count_pinned(bytes_, false);
  pinned_ = false;
  registered_with_.reset();
}

void HostBuffer::reset() {
  if (data_ == nullptr) return;
  unpin();
  // Freeing pinned memory lets the allocator reuse or decommit pages the device may still
  // DMA into: unpin() either unregistered or threw before this line.
  TIDAL_INTERNAL_ASSERT(registered_with_ == nullptr, "HostBuffer::reset: freeing ",
                        format_bytes(bytes_), " at ", data_, " while registered with a device");
  mimalloc().free(data_);
  count_free(bytes_, huge_pages_);
  data_ = nullptr;
  bytes_ = 0;
  reserved_ = 0;
  alignment_ = 0;
  huge_pages_ = false;
}

}  // namespace tidal
