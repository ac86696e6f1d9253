#include "hooks/host_allocation_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>

#include <atomic>
#include <cstring>
#include <mutex>

namespace tidal::hooks {
namespace {

class CountingAllocator final : public c10::Allocator {
 public:
  explicit CountingAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(std::size_t bytes) override {
    c10::DataPtr inner = base_->allocate(bytes);
    if (!enabled_.load(std::memory_order_relaxed)) return inner;
    void* data = inner.get();
    const c10::Device device = inner.device();
    auto* context = new Context{std::move(inner), static_cast<std::int64_t>(bytes), this};
    const std::int64_t live = live_.fetch_add(context->bytes, std::memory_order_relaxed) + context->bytes;
    allocations_.fetch_add(1, std::memory_order_relaxed);
    std::int64_t peak = peak_.load(std::memory_order_relaxed);
    while (live > peak && !peak_.compare_exchange_weak(peak, live, std::memory_order_relaxed)) {
    }
    return c10::DataPtr(data, context, &CountingAllocator::release, device);
  }

  c10::DeleterFnPtr raw_deleter() const override { return nullptr; }

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
  struct Context {
    c10::DataPtr inner;  // frees the memory through the base allocator's deleter
    std::int64_t bytes;
    CountingAllocator* owner;
  };
  static void release(void* raw) {
    auto* context = static_cast<Context*>(raw);
    context->owner->live_.fetch_sub(context->bytes, std::memory_order_relaxed);
    delete context;
  }

  c10::Allocator* base_;
  std::atomic<bool> enabled_{false};
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocations_{0};
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

}  // namespace

void set_host_allocation_counting(bool enabled) { counter().set_enabled(enabled); }
bool host_allocation_counting() { return counter().enabled(); }
HostAllocationCounts host_allocation_counts() { return counter().counts(); }
void reset_host_allocation_peak() { counter().reset_peak(); }

}  // namespace tidal::hooks
