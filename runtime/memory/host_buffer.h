// Host memory for model states: aligned buffers from mimalloc, large ones on
// transparent huge pages where the OS gives them, optionally pinned through a
// Device so asynchronous copies run at full link speed. Every byte is counted
// (host_memory_stats), so tests can assert that counters return to baseline.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

namespace tidal {

class Device;

struct HostMemoryStats {
  std::size_t allocated_bytes = 0;       // live HostBuffer bytes
  std::size_t peak_allocated_bytes = 0;
  std::size_t pinned_bytes = 0;          // live bytes registered with a device
  std::size_t huge_page_bytes = 0;       // live bytes advised onto huge pages
  std::size_t live_buffers = 0;
};

HostMemoryStats host_memory_stats();
// Resets the peak to what is allocated now.
void reset_host_memory_peak();

class HostBuffer {
 public:
  static constexpr std::size_t kDefaultAlignment = 64;
  // Buffers at least this large are aligned to it and advised onto
  // transparent huge pages (fewer TLB misses for the CPU Adam sweep, on every
  // step). The price is paid once, at a page's first touch (building the
  // model into chunks): on some virtual machines a huge page's first touch
  // costs several times that of small pages (benchmarks/initialize_largest.py).
  static constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

  HostBuffer() = default;
  // Allocates `bytes` (> 0) aligned to `alignment` (a power of two, >= 64;
  // raised to the page size: a buffer owns whole pages so it can be pinned).
  // Throws OutOfMemoryError if the host cannot provide them.
  explicit HostBuffer(std::size_t bytes, std::size_t alignment = kDefaultAlignment);
  // Allocates and pins through `device` (a no-op pin on the simulated device).
  HostBuffer(std::size_t bytes, std::shared_ptr<Device> pin_with,
             std::size_t alignment = kDefaultAlignment);
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;
  ~HostBuffer();

  void* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  std::size_t alignment() const { return alignment_; }
  bool empty() const { return data_ == nullptr; }
  // True when the pages are page-locked (CUDA backend).
  bool pinned() const { return pinned_; }
  // True once pin() registered the buffer with a device (whether or not
  // that backend locks pages: the simulated device records it only).
  bool registered() const { return registered_with_ != nullptr; }
  bool huge_pages() const { return huge_pages_; }

  // Registers the buffer with `device`; returns whether it is now pinned.
  // Calling it twice is an error.
  bool pin(std::shared_ptr<Device> device);
  void unpin();
  // Frees the memory now.
  void reset();

 private:
  void swap(HostBuffer& other) noexcept;

  void* data_ = nullptr;
  std::size_t bytes_ = 0;
  std::size_t reserved_ = 0;  // bytes_ rounded up to whole pages: what is allocated and pinned
  std::size_t alignment_ = 0;
  bool huge_pages_ = false;
  bool pinned_ = false;
  std::shared_ptr<Device> registered_with_;  // set while registered
};

}  // namespace tidal
