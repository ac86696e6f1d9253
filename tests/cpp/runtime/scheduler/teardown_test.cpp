// Teardown after a device error: the scheduler's and the block pool's
// destructors must not throw (std::terminate) when the device's
// synchronize/query throws (Note [Destructors after a device error]).
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>

#include "runtime/scheduler/chunk_scheduler.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::kKiB;
using testing::make_store;

// Set to make every stream/event/device synchronization and event query throw.
std::atomic<bool> g_broken{false};
std::atomic<int> g_throws{0};

void maybe_throw() {
  if (g_broken) {
    ++g_throws;
    throw std::runtime_error("injected device fault");
  }
}

// A synchronous device on host memory: copies run at once, so only the
// injected faults make synchronization fail.
class FaultyDevice final : public Device {
 public:
  explicit FaultyDevice(std::size_t bytes) : Device(DeviceBackend::kSimulated, bytes, bytes) {}
  DeviceInfo info() const override { return {}; }
  void synchronize() override { maybe_throw(); }
  bool register_host(void*, std::size_t) override { return false; }
  void unregister_host(void*) override {}

 private:
  class FStream final : public Stream {
   public:
    FStream(std::shared_ptr<Device> d, std::string n) : Stream(std::move(d), std::move(n)) {}
    void synchronize() override { maybe_throw(); }
    bool query() override {
      maybe_throw();
      return true;
    }

   private:
    void do_wait(const Event&) override {}
  };
  class FEvent final : public Event {
   public:
    FEvent(std::shared_ptr<Device> d, bool t) : Event(std::move(d), t) {}
    bool query() const override {
      maybe_throw();
      return true;
    }
    void synchronize() const override { maybe_throw(); }

   private:
    void do_record(Stream&) override {}
    double do_elapsed_seconds_since(const Event&) const override { return 0; }
  };

  void* do_allocate(std::size_t bytes) override { return std::malloc(bytes); }
  void do_free(void* ptr) override { std::free(ptr); }
  std::unique_ptr<Stream> do_create_stream(std::string name) override {
    return std::make_unique<FStream>(shared_from_this(), std::move(name));
  }
  std::unique_ptr<Stream> do_wrap_external_stream(std::uintptr_t, std::string) override {
    throw std::runtime_error("no external streams");
  }
  std::unique_ptr<Event> do_create_event(bool timing) override {
    return std::make_unique<FEvent>(shared_from_this(), timing);
  }
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind, Stream&) override {
    std::memcpy(dst, src, bytes);
  }
};

TEST(SchedulerTeardown, DestructorsSurviveDeviceErrors) {
  constexpr std::size_t kChunk = 4 * kKiB;
  g_broken = false;
  g_throws = 0;
  auto device = std::make_shared<FaultyDevice>(64 * kChunk);
  {
    ChunkSchedulerOptions options;
    options.device_budget_bytes = 2 * kChunk;
    options.prefetch = false;
    ChunkScheduler s(make_store({2048, 2048, 2048}, kChunk), device, options);
    // Move chunks down and back so blocks carry recorded fences and the
    // pools cache blocks in both spaces.
    for (TensorId t = 0; t < 3; ++t) {
      s.access({ChunkKind::kParam16, t}, MemorySpace::kDevice);
      s.release({ChunkKind::kParam16, t}, TensorState::kHoldAfterFwd);
    }
    for (TensorId t = 0; t < 3; ++t) {
      s.access({ChunkKind::kParam16, t}, MemorySpace::kHost);
      s.release({ChunkKind::kParam16, t}, TensorState::kHoldAfterFwd);
    }
    s.access({ChunkKind::kParam16, 0}, MemorySpace::kDevice);
    s.release({ChunkKind::kParam16, 0}, TensorState::kHoldAfterFwd);
    g_broken = true;
    // Leaving the scope runs ~ChunkScheduler and ~BlockPool; a throw out of
    // either would call std::terminate and end this test binary.
  }
  EXPECT_GT(g_throws.load(), 0) << "the injected fault never fired; the test checks nothing";
  g_broken = false;
}

}  // namespace
}  // namespace tidal
