// Device memory providers (Note [Device memory providers] in device.h) on the
// simulated device: allocations go through the provider and back, the Device's
// accounting is the same with and without one, a provider that has no memory
// left becomes OutOfMemoryError, switching providers with memory live returns
// each allocation to where it came from, and the chunk scheduler's device
// blocks all go through the provider and back.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/device/sim_device.h"
#include "runtime/scheduler/chunk_scheduler.h"
#include "tests/cpp/runtime/scheduler/scheduler_test_util.h"

namespace tidal {
namespace {

constexpr std::size_t kKiB = 1024;
constexpr std::size_t kMiB = kKiB * kKiB;

// Hands out aligned host memory (the simulated device's copies are memcpy),
// records every call and what is live, and can be told to run dry.
class RecordingProvider final : public DeviceMemoryProvider {
 public:
  explicit RecordingProvider(std::string name) : name_(std::move(name)) {}
  ~RecordingProvider() override {
    for (auto& [ptr, bytes] : live_) std::free(ptr);
  }

  std::string name() const override { return name_; }
  void* allocate(std::size_t bytes) override {
    ++allocations;
    if (dry) return nullptr;
    void* ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    live_.emplace(ptr, bytes);
    return ptr;
  }
  void free(void* ptr) override {
    ++frees;
    const auto it = live_.find(ptr);
    // Not ASSERT: a foreign pointer must fail the test, not leak into free().
    if (it == live_.end()) {
      ADD_FAILURE() << name_ << ": free of " << ptr << ", which it never handed out";
      return;
    }
    std::free(ptr);
    live_.erase(it);
  }

  bool holds(const void* ptr) const { return live_.count(const_cast<void*>(ptr)) != 0; }
  std::size_t live_bytes() const {
    std::size_t n = 0;
    for (const auto& [ptr, bytes] : live_) n += bytes;
    return n;
  }
  std::size_t live_count() const { return live_.size(); }

  int allocations = 0;
  int frees = 0;
  bool dry = false;

 private:
  std::string name_;
  std::map<void*, std::size_t> live_;
};

TEST(MemoryProvider, AllocationsGoThroughTheProviderAndBack) {
  auto device = make_sim_device({.capacity_bytes = 8 * kMiB});
  auto provider = std::make_shared<RecordingProvider>("recording");
  EXPECT_EQ(device->memory_provider(), nullptr);
  device->set_memory_provider(provider);
  EXPECT_EQ(device->memory_provider(), provider);
  {
    DeviceBuffer a = device->allocate(kMiB);
    DeviceBuffer b = device->allocate(3 * kMiB + 5);
    EXPECT_TRUE(provider->holds(a.data()));
    EXPECT_TRUE(provider->holds(b.data()));
    EXPECT_EQ(provider->allocations, 2);
    EXPECT_EQ(provider->live_bytes(), 4 * kMiB + 5);
    // The Device's accounting is the provider's live bytes.
    const DeviceMemoryStats s = device->memory_stats();
    EXPECT_EQ(s.in_use_bytes, 4 * kMiB + 5);
    EXPECT_EQ(s.provided_bytes, 4 * kMiB + 5);
    EXPECT_EQ(s.live_allocations, 2u);
    EXPECT_TRUE(device->owns(b.data(), 3 * kMiB + 5));
    EXPECT_FALSE(device->owns(b.data(), 3 * kMiB + 6));
    a.reset();
    EXPECT_EQ(provider->frees, 1);
    EXPECT_EQ(device->memory_stats().provided_bytes, 3 * kMiB + 5);
  }
  EXPECT_EQ(provider->frees, 2);
  EXPECT_EQ(provider->live_count(), 0u);
  const DeviceMemoryStats s = device->memory_stats();
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.provided_bytes, 0u);
  EXPECT_EQ(s.peak_in_use_bytes, 4 * kMiB + 5);
}

TEST(MemoryProvider, CopiesReachProvidedMemory) {
  auto device = make_sim_device({.capacity_bytes = 4 * kMiB});
  auto provider = std::make_shared<RecordingProvider>("recording");
  device->set_memory_provider(provider);
  DeviceBuffer d = device->allocate(64 * kKiB);
  std::vector<unsigned char> in(64 * kKiB), out(64 * kKiB, 0);
  for (std::size_t i = 0; i < in.size(); ++i) in[i] = static_cast<unsigned char>(i * 7 + 3);
  auto stream = device->create_stream("copies");
  device->copy_async(d.data(), in.data(), in.size(), CopyKind::kHostToDevice, *stream);
  device->copy_async(out.data(), d.data(), out.size(), CopyKind::kDeviceToHost, *stream);
  stream->synchronize();
  EXPECT_EQ(in, out);
  // A copy past the provided block is caught as for the backend's memory.
  EXPECT_THROW(device->copy_async(out.data(), d.data(), 64 * kKiB + 1, CopyKind::kDeviceToHost,
                                  *stream),
               ValueError);
}

TEST(MemoryProvider, CapacityIsCheckedBeforeTheProviderIsAsked) {
  auto device = make_sim_device({.capacity_bytes = 4 * kMiB});
  auto provider = std::make_shared<RecordingProvider>("recording");
  device->set_memory_provider(provider);
  DeviceBuffer a = device->allocate(3 * kMiB);
  EXPECT_THROW(device->allocate(2 * kMiB), OutOfMemoryError);
  EXPECT_EQ(provider->allocations, 1);  // the budget said no; the provider was not asked
  EXPECT_EQ(device->memory_stats().failed_allocations, 1u);
}

TEST(MemoryProvider, AProviderWithoutMemoryIsOutOfMemory) {
  auto device = make_sim_device({.capacity_bytes = 4 * kMiB});
  auto provider = std::make_shared<RecordingProvider>("dry provider");
  provider->dry = true;
  device->set_memory_provider(provider);
  try {
    device->allocate(kMiB);
    FAIL() << "allocate succeeded with a provider that has no memory";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(e.message().find("memory provider has no block"), std::string::npos) << e.message();
  }
  const DeviceMemoryStats s = device->memory_stats();
  EXPECT_EQ(s.failed_allocations, 1u);
  EXPECT_EQ(s.in_use_bytes, 0u);
  EXPECT_EQ(s.live_allocations, 0u);
}

TEST(MemoryProvider, EachAllocationGoesBackToWhereItCameFrom) {
  auto device = make_sim_device({.capacity_bytes = 8 * kMiB});
  auto first = std::make_shared<RecordingProvider>("first");
  auto second = std::make_shared<RecordingProvider>("second");
  DeviceBuffer from_backend = device->allocate(kMiB);
  device->set_memory_provider(first);
  DeviceBuffer from_first = device->allocate(kMiB);
  device->set_memory_provider(second);
  DeviceBuffer from_second = device->allocate(kMiB);
  device->set_memory_provider(nullptr);
  DeviceBuffer backend_again = device->allocate(kMiB);
  EXPECT_FALSE(first->holds(from_backend.data()) || second->holds(from_backend.data()));
  EXPECT_FALSE(first->holds(backend_again.data()) || second->holds(backend_again.data()));
  EXPECT_TRUE(first->holds(from_first.data()));
  EXPECT_TRUE(second->holds(from_second.data()));
  EXPECT_EQ(device->memory_stats().provided_bytes, 2 * kMiB);
  // Frees happen while `second` is the provider: only its own block reaches it.
  device->set_memory_provider(second);

  // The device keeps a provider alive while memory it gave is live.
  std::weak_ptr<RecordingProvider> first_alive = first;
  first.reset();
  ASSERT_FALSE(first_alive.expired());
  from_first.reset();
  EXPECT_TRUE(first_alive.expired());  // freed through it, then released

  from_second.reset();
  EXPECT_EQ(second->frees, 1);
  EXPECT_EQ(second->live_count(), 0u);
  from_backend.reset();
  backend_again.reset();
  EXPECT_EQ(second->frees, 1);  // backend memory never reached a provider
  EXPECT_EQ(device->memory_stats().in_use_bytes, 0u);
  EXPECT_EQ(device->memory_stats().provided_bytes, 0u);
}

TEST(MemoryProvider, EveryChunkBlockGoesThroughTheProviderAndBack) {
  using testing::has_pattern;
  using testing::make_store;
  using testing::write_pattern;
  constexpr std::size_t kChunk = 4 * kKiB;  // 2048 fp16 elements per chunk
  auto device = make_sim_device({.capacity_bytes = kMiB});
  auto provider = std::make_shared<RecordingProvider>("recording");
  device->set_memory_provider(provider);
  {
    ChunkSchedulerOptions options;
    options.device_budget_bytes = 2 * kChunk;  // three chunks, room for two: evictions
    options.prefetch = false;
    ChunkScheduler s(make_store({2048, 2048, 2048}, kChunk), device, options);
    for (int round = 0; round < 3; ++round) {
      for (TensorId t = 0; t < 3; ++t) {
        void* p = s.access({ChunkKind::kParam16, t}, MemorySpace::kDevice);
        EXPECT_TRUE(provider->holds(p)) << "chunk block not from the provider";
        if (round == 0) {
          write_pattern(p, 4096, 10 + t);
        } else {
          EXPECT_TRUE(has_pattern(p, 4096, 10 + t)) << "tensor " << t << " round " << round;
        }
        s.release({ChunkKind::kParam16, t}, TensorState::kHold);
      }
    }
    // Blocks are cached and reused: the provider saw only what the budget holds.
    EXPECT_EQ(provider->live_bytes(), device->memory_stats().in_use_bytes);
    EXPECT_EQ(provider->live_bytes(), 2 * kChunk);
    EXPECT_EQ(provider->allocations, 2);
    // Lowering the budget frees blocks: back to the provider.
    s.set_budget(MemorySpace::kDevice, kChunk);
    EXPECT_EQ(provider->live_bytes(), kChunk);
    EXPECT_EQ(provider->frees, 1);
    s.validate();
  }
  EXPECT_EQ(provider->live_count(), 0u);
  EXPECT_EQ(provider->frees, provider->allocations);
  EXPECT_EQ(device->memory_stats().provided_bytes, 0u);
}

}  // namespace
}  // namespace tidal
