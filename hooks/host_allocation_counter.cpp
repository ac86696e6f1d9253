#include "hooks/host_allocation_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include "runtime/core/uncounted.h"

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
    // Note [tidal's own host allocations]: not the device's.
    const bool counting = enabled_.load(std::memory_order_relaxed) && !uncounted_now();
    if (counting) check_limit(bytes);
    c10::DataPtr inner = base_->allocate(bytes);
    if (!counting || base_free_ == nullptr || inner.get() == nullptr ||
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
    note_device_use(live);
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
  void set_room_maker(RoomMaker maker, std::thread::id thread) {
    std::lock_guard<std::mutex> lock(mutex_);
    maker_ = std::move(maker);
    maker_thread_ = thread;
  }
  void set_limit(const HostAllocationLimit& limit) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_info_ = limit;
      limit_.store(limit.limit, std::memory_order_relaxed);
      offset_.store(limit.limit < 0 ? kNoOffset : limit.chunk_bytes - limit.baseline,
                    std::memory_order_relaxed);
    }
    note_device_use(live_.load(std::memory_order_relaxed));
  }
  void reset_device_peak() { device_peak_.store(0, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  HostAllocationCounts counts() const {
    return {live_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocations_.load(std::memory_order_relaxed), device_peak_.load(std::memory_order_relaxed)};
  }
  void reset_peak() {
    peak_.store(live_.load(std::memory_order_relaxed), std::memory_order_relaxed);
    allocations_.store(0, std::memory_order_relaxed);
  }

 private:
  static void release(void* data);

  // Chunks plus the engine's live bytes now, into the device peak.
  void note_device_use(std::int64_t live) {
    const std::int64_t offset = offset_.load(std::memory_order_relaxed);
    if (offset == kNoOffset) return;
    const std::int64_t use = live + offset;
    std::int64_t peak = device_peak_.load(std::memory_order_relaxed);
    while (use > peak && !device_peak_.compare_exchange_weak(peak, use, std::memory_order_relaxed)) {
    }
  }

  // Note [The simulated device's budget is a hard limit].
  void check_limit(std::size_t bytes) {
    std::int64_t limit = limit_.load(std::memory_order_relaxed);
    if (limit < 0) return;
    const auto n = static_cast<std::int64_t>(bytes);
    std::int64_t live = live_.load(std::memory_order_relaxed);
    if (live + n <= limit) return;
    // First, room from chunks not in use (on the thread that drives them).
    RoomMaker maker;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (std::this_thread::get_id() == maker_thread_) maker = maker_;
    }
    thread_local bool making_room = false;
    if (maker && !making_room) {
      making_room = true;
      bool freed = false;
      try {
        freed = maker(static_cast<std::size_t>(live + n - limit));
      } catch (...) {
        making_room = false;
        throw;
      }
      making_room = false;
      limit = limit_.load(std::memory_order_relaxed);
      live = live_.load(std::memory_order_relaxed);
      if (freed && (limit < 0 || live + n <= limit)) return;
    }
    HostAllocationLimit info;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      info = limit_info_;
    }
    TORCH_CHECK_WITH(OutOfMemoryError, false, "tidal (simulated device): allocating ", bytes,
                     " bytes would hold ", live - info.baseline + n,
                     " bytes of non-chunk device memory, past the ", limit - info.baseline,
                     " bytes the device budget leaves beside the chunks (device budget less margin ",
                     info.budget, " bytes, chunk bytes on the device ", info.chunk_bytes, ")");
  }

  c10::Allocator* base_;
  c10::DeleterFnPtr base_free_;
  std::atomic<bool> enabled_{false};
  std::atomic<std::int64_t> live_{0};
  std::atomic<std::int64_t> peak_{0};
  std::atomic<std::int64_t> allocations_{0};
  std::atomic<std::int64_t> limit_{-1};
  static constexpr std::int64_t kNoOffset = INT64_MIN;
  std::atomic<std::int64_t> offset_{kNoOffset};  // chunk bytes - baseline, while limited
  std::atomic<std::int64_t> device_peak_{0};
  HostAllocationLimit limit_info_;
  RoomMaker maker_;
  std::thread::id maker_thread_;
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
void set_host_allocation_limit(const HostAllocationLimit& limit) { counter().set_limit(limit); }
void reset_host_allocation_device_peak() { counter().reset_device_peak(); }
void set_host_allocation_room_maker(RoomMaker maker, std::thread::id thread) {
  counter().set_room_maker(std::move(maker), thread);
}

}  // namespace tidal::hooks
