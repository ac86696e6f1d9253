#include "hooks/host_allocation_counter.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <memory>
#include <mutex>
#include <unordered_map>

#include "runtime/core/uncounted.h"
#include "runtime/memory/caching_allocator_model.h"

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
    CachingAllocatorModel::Handle handle = 0;
    std::uint64_t sequence = 0;
    if (counting) {
      // The exact limit, where an engine set one; then the model, while one
      // is on (it enforces only under a reserved cap).
      check_limit(bytes);
      {
        std::lock_guard<std::mutex> lock(mutex_);
        sequence = ++sequence_;
      }
      if (model_users_.load(std::memory_order_relaxed) > 0) handle = place_in_model(bytes, sequence);
    }
    c10::DataPtr inner;
    try {
      inner = base_->allocate(bytes);
    } catch (...) {
      if (handle != 0) free_in_model(handle);
      throw;
    }
    if (!counting || base_free_ == nullptr || inner.get() == nullptr ||
        inner.get() != inner.get_context()) {
      if (handle != 0) free_in_model(handle);
      return inner;
    }
    void* data = inner.release_context();
    const c10::Device device = inner.device();
    const auto n = static_cast<std::int64_t>(bytes);
    std::int64_t live = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sizes_[data] = Counted{n, handle, sequence};
      live = live_.fetch_add(n, std::memory_order_relaxed) + n;
      // Note [A meter's baseline]: each baseline's own peak.
      for (auto& [opened, baseline] : baselines_) {
        baseline.peak_own = std::max(baseline.peak_own, live + baseline.freed);
      }
    }
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
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);  // (before mutex_, always)
    {
      std::lock_guard<std::mutex> lock(mutex_);
      limit_info_ = limit;
      const bool limited = limit.limit >= 0 || limit.reserved_cap >= 0;
      limit_.store(limit.reserved_cap >= 0 ? -1 : limit.limit, std::memory_order_relaxed);
      offset_.store(limited ? limit.chunk_bytes - limit.baseline : kNoOffset, std::memory_order_relaxed);
    }
    if (model_ != nullptr && limit.reserved_cap >= 0) {
      // Chunk blocks that came to the device take the place of cached segments:
      // on a GPU their allocation makes torch give back whole free segments.
      if (static_cast<std::int64_t>(model_->use().reserved) > limit.reserved_cap) model_->release_cached();
      note_reserved();
    }
    note_device_use(live_.load(std::memory_order_relaxed));
  }

  void clear_limit(std::uint64_t owner) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (limit_info_.owner != owner) return;  // another meter's (Note [One engine's window is its own])
    }
    set_limit({});
  }

  void set_model(bool on) {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);
    if (on) {
      if (model_ == nullptr) model_ = std::make_unique<CachingAllocatorModel>();
      model_->release_cached();
      if (model_users_.fetch_add(1, std::memory_order_relaxed) == 0) {
        largest_request_ = 0;
        model_misses_ = model_made_room_ = model_failures_ = 0;
      }
      reserved_peak_ = 0;
    } else if (model_users_.load(std::memory_order_relaxed) > 0) {
      model_users_.fetch_sub(1, std::memory_order_relaxed);
    }
  }

  // Note [A meter's baseline]: a block of a baseline left the model; what
  // the baseline keeps reserved is walked again when next asked, and a
  // reserved cap counting it falls with it.
  void forget_baseline_block(std::uint64_t sequence) {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);  // (before mutex_, always)
    std::int64_t cap = -1;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (auto& [opened, baseline] : baselines_) {
        if (sequence <= opened) baseline.reserved = -1;
      }
      if (model_ == nullptr || limit_info_.reserved_cap < 0 || sequence > limit_info_.baseline_id) return;
      const auto held = static_cast<std::int64_t>(model_->reserved_holding_tags_up_to(limit_info_.baseline_id));
      limit_info_.reserved_cap =
          std::max<std::int64_t>(0, limit_info_.reserved_cap - limit_info_.reserved_baseline + held);
      limit_info_.reserved_baseline = held;
      cap = limit_info_.reserved_cap;
    }
    if (static_cast<std::int64_t>(model_->use().reserved) > cap) model_->release_cached();
  }

  // Note [A meter's baseline]: an allocation of the limit's baseline died;
  // the limit's baseline falls with it, so the engine's bytes keep their room
  // and no more.
  void leave_limit_baseline(std::uint64_t sequence, std::int64_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool limited = limit_info_.limit >= 0 || limit_info_.reserved_cap >= 0;
    if (!limited || sequence == 0 || sequence > limit_info_.baseline_id) return;
    limit_info_.baseline -= bytes;
    if (limit_info_.limit >= 0) {
      limit_info_.limit -= bytes;
      if (limit_info_.reserved_cap < 0) limit_.store(limit_info_.limit, std::memory_order_relaxed);
    }
    offset_.store(limit_info_.chunk_bytes - limit_info_.baseline, std::memory_order_relaxed);
  }

  HostAllocationModelUse model_use() {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);
    HostAllocationModelUse u;
    u.on = model_users_.load(std::memory_order_relaxed) > 0;
    if (model_ != nullptr) {
      const AllocatorUse a = model_->use();
      u.reserved = static_cast<std::int64_t>(a.reserved);
      u.allocated = static_cast<std::int64_t>(a.allocated);
      u.stuck = static_cast<std::int64_t>(a.active + a.inactive_split);
    }
    u.largest_request = static_cast<std::int64_t>(largest_request_);
    u.device_reserved_peak = reserved_peak_;
    u.misses = model_misses_;
    u.made_room = model_made_room_;
    u.failures = model_failures_;
    return u;
  }

  void reset_reserved_peak() {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);
    reserved_peak_ = 0;
    note_reserved();
  }
  void reset_device_peak() { device_peak_.store(0, std::memory_order_relaxed); }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  HostAllocationCounts counts() const {
    return {live_.load(std::memory_order_relaxed), peak_.load(std::memory_order_relaxed),
            allocations_.load(std::memory_order_relaxed), device_peak_.load(std::memory_order_relaxed)};
  }
  void reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::int64_t live = live_.load(std::memory_order_relaxed);
    peak_.store(live, std::memory_order_relaxed);
    allocations_.store(0, std::memory_order_relaxed);
    for (auto& [opened, baseline] : baselines_) baseline.peak_own = live + baseline.freed;
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

  // Note [Who owns a device byte]: the allocation placed as torch would place
  // it, under the reserved cap, room made on a miss; else OutOfMemoryError.
  CachingAllocatorModel::Handle place_in_model(std::size_t bytes, std::uint64_t sequence) {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);
    if (model_ == nullptr) model_ = std::make_unique<CachingAllocatorModel>();
    auto cap = [this]() -> std::size_t {
      std::lock_guard<std::mutex> lock(mutex_);
      return limit_info_.reserved_cap < 0 ? ~std::size_t{0}
                                           : static_cast<std::size_t>(limit_info_.reserved_cap);
    };
    // A miss asks as torch asks its free-memory callbacks (Note [Room on a
    // cache miss]): for what a segment for the largest request seen needs.
    auto on_miss = [&]() -> bool {
      RoomMaker maker;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        if (limit_info_.reserved_cap < 0 || std::this_thread::get_id() != maker_thread_) return false;
        maker = maker_;
      }
      if (!maker || making_room_) return false;
      bool any = false;
      making_room_ = true;
      try {
        for (int round = 0; round < 64; ++round) {
          const std::size_t need = room_to_make(model_->use(), cap(), largest_request_);
          if (need == 0) break;
          if (round == 0) ++model_misses_;
          if (!maker(need)) break;
          if (!any) ++model_made_room_;
          any = true;
        }
      } catch (...) {
        making_room_ = false;
        throw;
      }
      making_room_ = false;
      return any;
    };
    const CachingAllocatorModel::Handle handle = model_->allocate(bytes, cap, on_miss, sequence);
    if (handle == 0) {
      ++model_failures_;
      HostAllocationLimit info;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        info = limit_info_;
      }
      TORCH_CHECK_WITH(OutOfMemoryError, false, "tidal (simulated device, torch's CUDA caching allocator "
                       "rules): ", model_->last_failure(), "; the cap is the device budget (",
                       info.budget, " bytes less the margin) less the chunk bytes on the device (",
                       info.chunk_bytes, "). The model reserves as torch would on a GPU: whole segments, "
                       "freed blocks kept cached in them (tidal.simulated_allocator)");
    }
    largest_request_ = std::max(largest_request_, bytes);
    note_reserved();
    return handle;
  }

  void free_in_model(CachingAllocatorModel::Handle handle) {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);
    if (model_ != nullptr) model_->free(handle);
  }

  // The model's reserved bytes + the chunk bytes of the limit, into the peak;
  // caller holds model_mutex_.
  void note_reserved() {
    if (model_ == nullptr) return;
    std::int64_t chunk = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (limit_info_.reserved_cap < 0) return;
      chunk = limit_info_.chunk_bytes;
    }
    reserved_peak_ = std::max(reserved_peak_, static_cast<std::int64_t>(model_->use().reserved) + chunk);
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
  struct Counted {
    std::int64_t bytes = 0;
    CachingAllocatorModel::Handle handle = 0;  // in the model, or 0
    std::uint64_t sequence = 0;                // the order of counted allocations
  };
  std::unordered_map<void*, Counted> sizes_;
  // Note [A meter's baseline]: per open baseline (by the sequence number it
  // opened at), the bytes freed since of allocations counted before it.
  std::uint64_t sequence_ = 0;
  struct Baseline {
    std::int64_t freed = 0;
    // The max of live bytes + freed since the last peak reset: the peak of
    // what is not the baseline's, plus the baseline at opening.
    std::int64_t peak_own = 0;
    // What the model keeps reserved for the baseline's live blocks; < 0:
    // to be walked again (one of them was freed).
    std::int64_t reserved = -1;
    int meters = 0;  // (meters opened at the same sequence share one)
  };
  std::unordered_map<std::uint64_t, Baseline> baselines_;

 public:
  std::uint64_t open_baseline() {
    std::lock_guard<std::mutex> lock(mutex_);
    Baseline& b = baselines_[sequence_];
    if (b.meters++ == 0) b.peak_own = live_.load(std::memory_order_relaxed);
    return sequence_;
  }
  HostAllocationBaseline baseline(std::uint64_t id) {
    std::lock_guard<std::recursive_mutex> model_lock(model_mutex_);  // (before mutex_, always)
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = baselines_.find(id);
    if (it == baselines_.end()) return {};
    Baseline& b = it->second;
    if (b.reserved < 0) {
      b.reserved = model_ == nullptr ? 0 : static_cast<std::int64_t>(model_->reserved_holding_tags_up_to(id));
    }
    return {b.freed, b.peak_own, b.reserved};
  }
  void close_baseline(std::uint64_t id) {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = baselines_.find(id);
    if (it != baselines_.end() && --it->second.meters == 0) baselines_.erase(it);
  }

 private:
  // Note [Who owns a device byte]: the model and what goes with it, under
  // model_mutex_ (taken before mutex_ wherever both are held; recursive: a
  // room maker frees counted tensors, DTR's activations, inside a placement).
  std::recursive_mutex model_mutex_;
  std::unique_ptr<CachingAllocatorModel> model_;
  std::atomic<int> model_users_{0};
  std::size_t largest_request_ = 0;
  std::int64_t reserved_peak_ = 0;
  std::uint64_t model_misses_ = 0, model_made_room_ = 0, model_failures_ = 0;
  bool making_room_ = false;
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
  Counted counted;
  {
    std::lock_guard<std::mutex> lock(self.mutex_);
    auto it = self.sizes_.find(data);
    if (it != self.sizes_.end()) {
      counted = it->second;
      self.sizes_.erase(it);
      for (auto& [opened, baseline] : self.baselines_) {
        if (counted.sequence <= opened) baseline.freed += counted.bytes;
      }
      self.live_.fetch_sub(counted.bytes, std::memory_order_relaxed);
    }
  }
  if (counted.handle != 0) {
    self.free_in_model(counted.handle);
    self.forget_baseline_block(counted.sequence);
  }
  if (counted.bytes != 0) self.leave_limit_baseline(counted.sequence, counted.bytes);
  self.base_free_(data);
}

}  // namespace

void set_host_allocation_counting(bool enabled) { counter().set_enabled(enabled); }
bool host_allocation_counting() { return counter().enabled(); }
HostAllocationCounts host_allocation_counts() { return counter().counts(); }
void reset_host_allocation_peak() { counter().reset_peak(); }
void set_host_allocation_limit(const HostAllocationLimit& limit) { counter().set_limit(limit); }
void clear_host_allocation_limit(std::uint64_t owner) { counter().clear_limit(owner); }
void reset_host_allocation_device_peak() { counter().reset_device_peak(); }
void set_host_allocation_room_maker(RoomMaker maker, std::thread::id thread) {
  counter().set_room_maker(std::move(maker), thread);
}
void set_host_allocation_model(bool on) { counter().set_model(on); }
std::uint64_t open_host_allocation_baseline() { return counter().open_baseline(); }
HostAllocationBaseline host_allocation_baseline(std::uint64_t id) { return counter().baseline(id); }
void close_host_allocation_baseline(std::uint64_t id) { counter().close_baseline(id); }
HostAllocationModelUse host_allocation_model_use() { return counter().model_use(); }
void reset_host_allocation_reserved_peak() { counter().reset_reserved_peak(); }

}  // namespace tidal::hooks
