// Note [Device layer contract] checked once, run against every backend: the
// simulated device always, CUDA where this build has it and a GPU is present.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/device/select.h"
#include "runtime/memory/host_buffer.h"

namespace tidal {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

std::vector<unsigned char> random_bytes(std::size_t n, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> out(n);
  for (auto& b : out) b = static_cast<unsigned char>(rng());
  return out;
}

class DeviceContract : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda) {
      std::string why;
      if (cuda_device_count(&why) == 0) {
        GTEST_SKIP() << "CUDA backend not runnable here (" << why
                     << "); the same contract runs on the GPU machine via scripts/gpu_run.sh";
      }
    }
    SimDeviceOptions sim;
    sim.capacity_bytes = 512 * kMiB;
    device_ = create_device(GetParam(), sim);
  }

  std::shared_ptr<Device> device_;
};

TEST_P(DeviceContract, CapacityAccountingAddsUp) {
  const DeviceMemoryStats before = device_->memory_stats();
  {
    DeviceBuffer a = device_->allocate(3 * kMiB);
    DeviceBuffer b = device_->allocate(5 * kMiB + 1);
    const DeviceMemoryStats during = device_->memory_stats();
    EXPECT_EQ(during.in_use_bytes, before.in_use_bytes + 8 * kMiB + 1);
    EXPECT_EQ(during.live_allocations, before.live_allocations + 2);
    EXPECT_GE(during.peak_in_use_bytes, during.in_use_bytes);
    EXPECT_EQ(during.allocations, before.allocations + 2);
    a.reset();
    EXPECT_EQ(device_->memory_stats().in_use_bytes, before.in_use_bytes + 5 * kMiB + 1);
  }
  const DeviceMemoryStats after = device_->memory_stats();
  EXPECT_EQ(after.in_use_bytes, before.in_use_bytes);
  EXPECT_EQ(after.live_allocations, before.live_allocations);
  EXPECT_EQ(after.frees, before.frees + 2);
}

TEST_P(DeviceContract, OutOfMemoryStatesRequestedInUseAndCapacity) {
  device_->set_capacity(16 * kMiB);
  DeviceBuffer held = device_->allocate(10 * kMiB);
  try {
    device_->allocate(8 * kMiB);
    FAIL() << "allocation past capacity succeeded";
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.message();
    EXPECT_NE(message.find("tried to allocate 8.00 MiB"), std::string::npos) << message;
    EXPECT_NE(message.find("10.00 MiB (10485760 bytes) in use"), std::string::npos) << message;
    EXPECT_NE(message.find("capacity 16.00 MiB"), std::string::npos) << message;
  }
  const DeviceMemoryStats stats = device_->memory_stats();
  EXPECT_EQ(stats.in_use_bytes, 10 * kMiB);  // the failure lost nothing
  EXPECT_EQ(stats.failed_allocations, 1u);
  DeviceBuffer fits = device_->allocate(6 * kMiB);  // exactly the rest
  EXPECT_FALSE(fits.empty());
}

TEST_P(DeviceContract, CapacityCannotDropBelowWhatIsInUse) {
  DeviceBuffer held = device_->allocate(4 * kMiB);
  EXPECT_THROW(device_->set_capacity(2 * kMiB), ValueError);
  EXPECT_THROW(device_->set_capacity(device_->info().total_memory_bytes + 1), ValueError);
  EXPECT_THROW(device_->allocate(0), ValueError);
}

TEST_P(DeviceContract, FreeOfAForeignPointerIsAnError) {
  int on_the_stack = 0;
  EXPECT_THROW(device_->free_raw(&on_the_stack), ValueError);
}

TEST_P(DeviceContract, RoundTripIsByteExactAcrossSizesAndOffsets) {
  auto stream = device_->create_stream("copy");
  for (std::size_t size : {std::size_t{1}, std::size_t{3}, std::size_t{255}, std::size_t{256},
                           std::size_t{4097}, kMiB + 7, 9 * kMiB}) {
    for (std::size_t offset : {std::size_t{0}, std::size_t{1}, std::size_t{200}}) {
      SCOPED_TRACE("size " + std::to_string(size) + " offset " + std::to_string(offset));
      const auto pattern = random_bytes(size, static_cast<unsigned>(size + offset));
      HostBuffer src(size + offset, device_);
      HostBuffer dst(size + offset, device_);
      std::memcpy(static_cast<char*>(src.data()) + offset, pattern.data(), size);
      std::memset(dst.data(), 0, dst.size());
      DeviceBuffer a = device_->allocate(size + offset);
      DeviceBuffer b = device_->allocate(size);
      char* a_at = static_cast<char*>(a.data()) + offset;
      device_->copy_async(a_at, static_cast<char*>(src.data()) + offset, size,
                          CopyKind::kHostToDevice, *stream);
      device_->copy_async(b.data(), a_at, size, CopyKind::kDeviceToDevice, *stream);
      device_->copy_async(static_cast<char*>(dst.data()) + offset, b.data(), size,
                          CopyKind::kDeviceToHost, *stream);
      auto done = device_->create_event();
      done->record(*stream);
      done->synchronize();
      EXPECT_TRUE(done->query());
      EXPECT_EQ(std::memcmp(static_cast<char*>(dst.data()) + offset, pattern.data(), size), 0);
    }
  }
}

TEST_P(DeviceContract, EventOrdersACopyOnAnotherStream) {
  auto upload = device_->create_stream("upload");
  auto download = device_->create_stream("download");
  constexpr std::size_t kSize = 8 * kMiB;
  const auto pattern = random_bytes(kSize, 7);
  HostBuffer src(kSize, device_);
  HostBuffer dst(kSize, device_);
  std::memcpy(src.data(), pattern.data(), kSize);
  DeviceBuffer buf = device_->allocate(kSize);
  for (int round = 0; round < 4; ++round) {
    std::memset(dst.data(), 0, kSize);
    device_->copy_async(buf.data(), src.data(), kSize, CopyKind::kHostToDevice, *upload);
    auto uploaded = device_->create_event();
    uploaded->record(*upload);
    download->wait(*uploaded);  // without this the download may read stale data
    device_->copy_async(dst.data(), buf.data(), kSize, CopyKind::kDeviceToHost, *download);
    download->synchronize();
    EXPECT_TRUE(uploaded->query());  // the download could only run after it
    ASSERT_EQ(std::memcmp(dst.data(), pattern.data(), kSize), 0) << "round " << round;
  }
}

TEST_P(DeviceContract, ConcurrentCopiesOnTwoStreamsFromTwoThreads) {
  constexpr std::size_t kSize = 2 * kMiB + 64;
  constexpr int kRounds = 8;
  auto worker = [&](unsigned seed, std::string name, std::vector<int>* ok) {
    auto stream = device_->create_stream(std::move(name));
    HostBuffer src(kSize, device_);
    HostBuffer dst(kSize, device_);
    DeviceBuffer buf = device_->allocate(kSize);
    for (int round = 0; round < kRounds; ++round) {
      const auto pattern = random_bytes(kSize, seed + static_cast<unsigned>(round));
      std::memcpy(src.data(), pattern.data(), kSize);
      device_->copy_async(buf.data(), src.data(), kSize, CopyKind::kHostToDevice, *stream);
      device_->copy_async(dst.data(), buf.data(), kSize, CopyKind::kDeviceToHost, *stream);
      stream->synchronize();
      ok->push_back(std::memcmp(dst.data(), pattern.data(), kSize) == 0);
    }
  };
  std::vector<int> ok_a;
  std::vector<int> ok_b;
  std::thread a(worker, 100u, "a", &ok_a);
  std::thread b(worker, 200u, "b", &ok_b);
  a.join();
  b.join();
  EXPECT_EQ(ok_a, std::vector<int>(kRounds, 1));
  EXPECT_EQ(ok_b, std::vector<int>(kRounds, 1));
}

TEST_P(DeviceContract, DestroyingAStreamCompletesItsPendingWork) {
  constexpr std::size_t kSize = 4 * kMiB;
  const auto pattern = random_bytes(kSize, 11);
  HostBuffer src(kSize, device_);
  HostBuffer dst(kSize, device_);
  std::memcpy(src.data(), pattern.data(), kSize);
  std::memset(dst.data(), 0, kSize);
  DeviceBuffer buf = device_->allocate(kSize);
  auto done = device_->create_event();
  {
    auto stream = device_->create_stream("short-lived");
    for (int i = 0; i < 4; ++i) {
      device_->copy_async(buf.data(), src.data(), kSize, CopyKind::kHostToDevice, *stream);
    }
    device_->copy_async(dst.data(), buf.data(), kSize, CopyKind::kDeviceToHost, *stream);
    done->record(*stream);
  }  // destroyed with work queued
  done->synchronize();  // the event outlives its stream
  EXPECT_EQ(std::memcmp(dst.data(), pattern.data(), kSize), 0);
}

TEST_P(DeviceContract, DeviceSynchronizeWaitsForEveryStream) {
  constexpr std::size_t kSize = 4 * kMiB;
  const auto pattern = random_bytes(kSize, 13);
  HostBuffer src(kSize, device_);
  HostBuffer dst(kSize, device_);
  std::memcpy(src.data(), pattern.data(), kSize);
  DeviceBuffer buf = device_->allocate(kSize);
  auto s1 = device_->create_stream("s1");
  device_->copy_async(buf.data(), src.data(), kSize, CopyKind::kHostToDevice, *s1);
  device_->synchronize();
  auto s2 = device_->create_stream("s2");
  device_->copy_async(dst.data(), buf.data(), kSize, CopyKind::kDeviceToHost, *s2);
  device_->synchronize();
  EXPECT_TRUE(s1->query());
  EXPECT_TRUE(s2->query());
  EXPECT_EQ(std::memcmp(dst.data(), pattern.data(), kSize), 0);
}

TEST_P(DeviceContract, UnrecordedEventIsCompleteAndWaitingOnItIsFree) {
  auto event = device_->create_event();
  EXPECT_TRUE(event->query());
  event->synchronize();
  auto stream = device_->create_stream("s");
  stream->wait(*event);
  stream->synchronize();
  EXPECT_TRUE(stream->query());
}

TEST_P(DeviceContract, ElapsedTimeNeedsTimingEvents) {
  auto stream = device_->create_stream("timed");
  auto start = device_->create_event(/*enable_timing=*/true);
  auto end = device_->create_event(/*enable_timing=*/true);
  HostBuffer src(kMiB, device_);
  DeviceBuffer buf = device_->allocate(kMiB);
  start->record(*stream);
  device_->copy_async(buf.data(), src.data(), kMiB, CopyKind::kHostToDevice, *stream);
  end->record(*stream);
  end->synchronize();
  EXPECT_GE(end->elapsed_seconds_since(*start), 0.0);
  auto untimed = device_->create_event();
  untimed->record(*stream);
  untimed->synchronize();
  EXPECT_THROW(untimed->elapsed_seconds_since(*start), ValueError);
}

TEST_P(DeviceContract, CopiesOutsideDeviceAllocationsAreRejected) {
  auto stream = device_->create_stream("s");
  HostBuffer host(2 * kMiB, device_);
  DeviceBuffer buf = device_->allocate(kMiB);
  // Host memory passed as the device side.
  try {
    device_->copy_async(host.data(), static_cast<char*>(host.data()) + kMiB, 16,
                        CopyKind::kHostToDevice, *stream);
    FAIL() << "host pointer accepted as a device destination";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("not inside a live allocation"), std::string::npos) << e.message();
  }
  // Running past the end of the allocation.
  EXPECT_THROW(device_->copy_async(buf.data(), host.data(), kMiB + 1, CopyKind::kHostToDevice,
                                   *stream),
               ValueError);
  // Device memory passed as the host side.
  DeviceBuffer other = device_->allocate(kMiB);
  EXPECT_THROW(device_->copy_async(buf.data(), other.data(), 16, CopyKind::kHostToDevice, *stream),
               ValueError);
  // A stream of another device.
  auto foreign = make_sim_device({.capacity_bytes = 4 * kMiB});
  auto foreign_stream = foreign->create_stream("foreign");
  EXPECT_THROW(device_->copy_async(buf.data(), host.data(), 16, CopyKind::kHostToDevice,
                                   *foreign_stream),
               ValueError);
  // Events and streams of different devices do not mix either.
  auto foreign_event = foreign->create_event();
  EXPECT_THROW(foreign_event->record(*stream), ValueError);
  EXPECT_THROW(stream->wait(*foreign_event), ValueError);
  auto timed = device_->create_event(true);
  auto foreign_timed = foreign->create_event(true);
  EXPECT_THROW(timed->elapsed_seconds_since(*foreign_timed), ValueError);
  stream->synchronize();
}

TEST_P(DeviceContract, PinningFollowsTheBackend) {
  const HostMemoryStats before = host_memory_stats();
  {
    HostBuffer buf(3 * kMiB, device_);
    EXPECT_EQ(buf.pinned(), device_->info().pinned_host_memory);
    EXPECT_EQ(host_memory_stats().pinned_bytes,
              before.pinned_bytes + (buf.pinned() ? 3 * kMiB : 0));
  }
  EXPECT_EQ(host_memory_stats().pinned_bytes, before.pinned_bytes);
}

INSTANTIATE_TEST_SUITE_P(Backends, DeviceContract,
                         ::testing::Values(DeviceKind::kSim, DeviceKind::kCuda),
                         [](const ::testing::TestParamInfo<DeviceKind>& info) {
                           return std::string(to_string(info.param));
                         });

}  // namespace
}  // namespace tidal
