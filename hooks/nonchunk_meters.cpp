#include "hooks/nonchunk_meters.h"

#include <algorithm>
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
  HostCounterMeter() : baseline_(host_allocation_counts().live_bytes) {
    reset_host_allocation_device_peak();
  }
  ~HostCounterMeter() override { clear_limit(); }
  void set_limit(std::size_t bytes, std::size_t budget, std::size_t chunk_bytes) override {
    set_host_allocation_limit({baseline_ + static_cast<std::int64_t>(bytes), baseline_,
                               static_cast<std::int64_t>(budget), static_cast<std::int64_t>(chunk_bytes)});
  }
  void clear_limit() override { set_host_allocation_limit({}); }
  std::size_t device_peak() override {
    return static_cast<std::size_t>(std::max<std::int64_t>(0, host_allocation_counts().device_peak_bytes));
  }
  std::pair<std::size_t, std::size_t> read() override {
    const HostAllocationCounts c = host_allocation_counts();
    return {above(c.live_bytes, baseline_), above(c.peak_bytes, baseline_)};
  }
  void restart_peak() override { reset_host_allocation_peak(); }

 private:
  std::int64_t baseline_;
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

std::unique_ptr<NonChunkMeter> make_host_counter_meter() {
  return std::make_unique<HostCounterMeter>();
}

std::unique_ptr<NonChunkMeter> make_provider_meter(std::shared_ptr<TorchMemoryProvider> provider,
                                                   bool subtract_baseline) {
  TIDAL_CHECK(provider != nullptr, "provider meter: expected a TorchMemoryProvider, got None");
  return std::make_unique<ProviderMeter>(std::move(provider), subtract_baseline);
}

}  // namespace tidal::hooks
