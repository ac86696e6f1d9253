#include "hooks/nonchunk_meters.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <utility>

#include "hooks/host_allocation_counter.h"
#include "runtime/core/error.h"

namespace tidal::hooks {
namespace {

std::size_t above(std::int64_t bytes, std::int64_t baseline) {
  return static_cast<std::size_t>(std::max<std::int64_t>(0, bytes - baseline));
}

class HostCounterMeter final : public NonChunkMeter {
 public:
  HostCounterMeter(std::size_t device_budget, bool torch_caching)
      : baseline_id_(open_host_allocation_baseline()),
        baseline_at_open_(host_allocation_counts().live_bytes),
        device_budget_(static_cast<std::int64_t>(device_budget)),
        caching_(torch_caching) {
    reset_host_allocation_device_peak();
    // (Turning the model on gives its cache back; what stays is the live
    // blocks of earlier windows, the baseline's.)
    if (caching_) set_host_allocation_model(true);
  }
  ~HostCounterMeter() override {
    clear_limit();
    if (caching_) set_host_allocation_model(false);
    close_host_allocation_baseline(baseline_id_);
  }
  void set_limit(std::size_t bytes, std::size_t budget, std::size_t chunk_bytes) override {
    const HostAllocationBaseline b = host_allocation_baseline(baseline_id_);
    const std::int64_t base = baseline(b);
    HostAllocationLimit limit{base + static_cast<std::int64_t>(bytes), base,
                              static_cast<std::int64_t>(budget), static_cast<std::int64_t>(chunk_bytes)};
    limit.baseline_id = baseline_id_;
    limit.owner = id_;
    if (caching_) {
      // Note [Who owns a device byte]: the whole budget, in reserved bytes, as
      // torch's cap on a GPU; the margin stays the allocator's room.
      limit.reserved_baseline = b.reserved;
      limit.reserved_cap =
          std::max<std::int64_t>(0, device_budget_ - static_cast<std::int64_t>(chunk_bytes) + limit.reserved_baseline);
    }
    set_host_allocation_limit(limit);
  }
  // Only this meter's own limit (Note [One engine's window is its own]).
  void clear_limit() override { clear_host_allocation_limit(id_); }
  std::size_t device_peak() override {
    return static_cast<std::size_t>(std::max<std::int64_t>(0, host_allocation_counts().device_peak_bytes));
  }
  std::size_t device_reserved_peak() override {
    if (!caching_) return 0;
    return above(host_allocation_model_use().device_reserved_peak, host_allocation_baseline(baseline_id_).reserved);
  }
  std::pair<std::size_t, std::size_t> read() override {
    const HostAllocationBaseline b = host_allocation_baseline(baseline_id_);  // (once per read)
    std::size_t now = above(host_allocation_counts().live_bytes, baseline(b));
    if (caching_) {
      // What the model cannot give back is not room for chunks; what it keeps
      // reserved for the baseline's tensors still alive is not the engine's.
      now = std::max(now, above(host_allocation_model_use().stuck, b.reserved));
    }
    // (The baseline's own peak: see Note [A meter's baseline].)
    return {now, above(b.peak_own, baseline_at_open_)};
  }
  void restart_peak() override {
    reset_host_allocation_peak();
    if (caching_) reset_host_allocation_reserved_peak();
  }

 private:
  // Note [A meter's baseline]: what was live at opening, less what of it died.
  std::int64_t baseline(const HostAllocationBaseline& b) const {
    return std::max<std::int64_t>(0, baseline_at_open_ - b.freed);
  }

  static std::uint64_t next_id() {
    static std::atomic<std::uint64_t> last{0};
    return ++last;
  }

  std::uint64_t id_ = next_id();
  std::uint64_t baseline_id_;
  std::int64_t baseline_at_open_;
  std::int64_t device_budget_;
  bool caching_;
};

class ProviderMeter final : public NonChunkMeter {
 public:
  ProviderMeter(std::shared_ptr<TorchMemoryProvider> provider, bool subtract_baseline)
      : provider_(std::move(provider)),
        baseline_(subtract_baseline ? provider_->other_bytes() : 0) {}
  std::pair<std::size_t, std::size_t> read() override {
    return {above(provider_->other_bytes(), baseline_), above(provider_->other_peak_bytes(), baseline_)};
  }
  void restart_peak() override { provider_->reset_window(); }
  std::size_t device_reserved_peak() override {
    return static_cast<std::size_t>(std::max<std::int64_t>(0, provider_->reserved_peak_bytes()));
  }

 private:
  std::shared_ptr<TorchMemoryProvider> provider_;
  std::int64_t baseline_;
};

}  // namespace

std::unique_ptr<NonChunkMeter> make_host_counter_meter(std::size_t device_budget, bool torch_caching) {
  return std::make_unique<HostCounterMeter>(device_budget, torch_caching);
}

std::unique_ptr<NonChunkMeter> make_provider_meter(std::shared_ptr<TorchMemoryProvider> provider,
                                                   bool subtract_baseline) {
  TIDAL_CHECK(provider != nullptr, "provider meter: expected a TorchMemoryProvider, got None");
  return std::make_unique<ProviderMeter>(std::move(provider), subtract_baseline);
}

}  // namespace tidal::hooks
