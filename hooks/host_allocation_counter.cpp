#include "hooks/host_allocation_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

namespace tidal::hooks {
namespace {

// torch requires CPU data pointers to be "simple" (context == data: copy on
// write and other paths assert it), so the size of a counted allocation is
// kept in a side table keyed by its address rather than in a context object,
// and our deleter frees through the base allocator's raw deleter.
class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base), base_free_(base->raw_deleter()) {}

  c10::DataPtr allocate(std::size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    if (!enabled_.load(std::memory_order_relaxed) || base_free_ == nullptr || inner.get() == nullptr ||
        inner.get() != inner.get_context()) {
      return inner;
    }
    void* data = inner.release_context();
    const c10::Device device = inner.device();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = static_cast<std::int64_t>(bytes);
    }
    const auto n = static_cast<std::int64_t>(bytes);
    const std::int64_t live = live_.fetch_add(n, std::memory_order_relaxed) + n;
    allocations_.fetch_add(1, std::memory_order_relaxed);
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (live > peak && !peak_.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
    }
    return c10::DataPtr(data, data, &CountingAllocator::release, device);
  }

  // Allocator::raw_allocate() (oneDNN's scratch and packed weights, e.g. for
  // bf16 matmuls on CPUs with AVX512-BF16) takes allocate()'s context and
  // frees it later through raw_deleter(): that must be release(), or counted
  // bytes never leave the count. release() sends what it did not count
  // straight to the base.
  c10::DeleterFnPtr raw_deleter() const override { return &CountingAllocator::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }

  void set_enabled(bool on) { enabled_.store(on, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  HostAllocationCounts counts() const {
    return {live_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocations_.load(std::memory_order_relaxed)};
  }
  void reset_peak() {
    peak_.store(live_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    allocations_.store(0, std::memory_order_relaxed);
  }

 private:
  static void release(void* data);

  c10::Allocator* base_;
  c10::DeleterFnPtr base_free_;
  std::atomic<bool> enabled_{false};
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocations_{0};
  std::mutex mutex_;
  std::unordered_map<void*, std::int64_t> sizes_;
};

CountingAllocator& counter() {
  // Leaked on purpose: tensors freed during interpreter shutdown still call
  // its deleter.
  static CountingAllocator* instance = [] {
    auto* a = new CountingAllocator(c10::GetCPUAllocator());
    c10::SetCPUAllocator(a, /*priority=*/1);
    return a;
  }();
  return *instance;
}

void CountingAllocator::release(void* data) {
  CountingAllocator& self = counter();
  std::int64_t bytes = 0;
  {
    std::lock_guard<std::mutex> lock(self.mutex_);
    auto it = self.sizes_.find(data);
    if (it != self.sizes_.end()) {
      bytes = it->second;
      self.sizes_.erase(it);
    }
  }
  self.live_.fetch_sub(bytes, std::memory_order_relaxed);
  self.base_free_(data);
}

}  // namespace

void set_host_allocation_counting(bool enabled) { counter().set_enabled(enabled); }
bool host_allocation_counting() { return counter().enabled(); }
HostAllocationCounts host_allocation_counts() { return counter().counts(); }
void reset_host_allocation_peak() { counter().reset_peak(); }

}  // namespace tidal::hooks
