// Behaviour of the simulated device beyond the shared contract: its arena,
// its copy timing model and its environment options.
#include "runtime/device/sim_device.h"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/memory/host_buffer.h"

namespace tidal {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
using Clock = std::chrono::steady_clock;

TEST(SimDevice, ReportsItsOptions) {
  auto device = make_sim_device(
      {.capacity_bytes = 64 * kMiB, .copy_bandwidth_bytes_per_s = 1e9, .copy_latency_s = 2e-6});
  const DeviceInfo info = device->info();
  EXPECT_EQ(info.backend, DeviceBackend::kSimulated);
  EXPECT_EQ(info.total_memory_bytes, 64 * kMiB);
  EXPECT_EQ(info.capacity_bytes, 64 * kMiB);
  EXPECT_FALSE(info.pinned_host_memory);
  EXPECT_DOUBLE_EQ(info.copy_bandwidth_bytes_per_s, 1e9);
  EXPECT_DOUBLE_EQ(info.copy_latency_s, 2e-6);
}

TEST(SimDevice, AllocationsAreAlignedLikeCudaMalloc) {
  auto device = make_sim_device({.capacity_bytes = 4 * kMiB});
  std::vector<DeviceBuffer> buffers;
  for (std::size_t size : {1, 3, 255, 257, 1000}) {
    buffers.push_back(device->allocate(size));
    EXPECT_EQ(reinterpret_cast<std::uintptr_t>(buffers.back().data()) % 256, 0u) << size;
  }
}

TEST(SimDevice, ArenaFragmentsAndCoalesces) {
  auto device = make_sim_device({.capacity_bytes = 4 * kMiB});
  DeviceBuffer a = device->allocate(kMiB);
  DeviceBuffer b = device->allocate(kMiB);
  DeviceBuffer c = device->allocate(kMiB);
  DeviceBuffer d = device->allocate(kMiB);
  a.reset();
  c.reset();
  // 2 MiB are free, but not in one piece: the error says so.
  try {
    device->allocate(2 * kMiB);
    FAIL() << "allocation across a hole succeeded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(e.message().find("fragmentation"), std::string::npos) << e.message();
  }
  b.reset();  // a, b, c coalesce into 3 MiB
  DeviceBuffer big = device->allocate(3 * kMiB);
  EXPECT_FALSE(big.empty());
  d.reset();
  big.reset();
  DeviceBuffer all = device->allocate(4 * kMiB);  // everything coalesced back
  EXPECT_FALSE(all.empty());
}

// With a finite bandwidth a copy takes bytes/bandwidth before it lands, and
// host-to-device copies on two streams share one engine, as on PCIe.
TEST(SimDevice, CopiesTakeTheirTransferTimeAndShareTheEngine) {
  constexpr double kBandwidth = 200e6;  // 200 MB/s: 4 MiB take ~21 ms
  constexpr std::size_t kSize = 4 * kMiB;
  auto device = make_sim_device({.capacity_bytes = 64 * kMiB, .copy_bandwidth_bytes_per_s = kBandwidth});
  auto s1 = device->create_stream("s1");
  auto s2 = device->create_stream("s2");
  HostBuffer src(kSize);
  DeviceBuffer d1 = device->allocate(kSize);
  DeviceBuffer d2 = device->allocate(kSize);
  auto e1 = device->create_event();
  auto e2 = device->create_event();
  const auto start = Clock::now();
  device->copy_async(d1.data(), src.data(), kSize, CopyKind::kHostToDevice, *s1);
  e1->record(*s1);
  device->copy_async(d2.data(), src.data(), kSize, CopyKind::kHostToDevice, *s2);
  e2->record(*s2);
  EXPECT_FALSE(e1->query());  // asynchronous: the copy is still in flight
  e1->synchronize();
  e2->synchronize();
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  // Two copies on one engine cannot finish faster than their summed time.
  EXPECT_GE(seconds, 2 * kSize / kBandwidth * 0.99);
}

TEST(SimDevice, TimingEventsMeasureTheSimulatedTransfer) {
  constexpr double kBandwidth = 400e6;
  constexpr std::size_t kSize = 8 * kMiB;
  auto device = make_sim_device({.capacity_bytes = 64 * kMiB, .copy_bandwidth_bytes_per_s = kBandwidth});
  auto stream = device->create_stream("timed");
  auto start = device->create_event(true);
  auto end = device->create_event(true);
  HostBuffer src(kSize);
  DeviceBuffer dst = device->allocate(kSize);
  start->record(*stream);
  device->copy_async(dst.data(), src.data(), kSize, CopyKind::kHostToDevice, *stream);
  end->record(*stream);
  end->synchronize();
  EXPECT_GE(end->elapsed_seconds_since(*start), kSize / kBandwidth * 0.99);
}

// Copies of memory the device did not allocate (torch's own "device"
// tensors, here plain host memory) cross the same link as the device's own:
// they land whole, take their transfer time and queue behind a chunk copy on
// the same engine.
TEST(SimDevice, ExternalCopiesCrossTheSameLink) {
  constexpr double kBandwidth = 200e6;  // 4 MiB take ~21 ms
  constexpr std::size_t kSize = 4 * kMiB;
  auto device = make_sim_device({.capacity_bytes = 64 * kMiB, .copy_bandwidth_bytes_per_s = kBandwidth});
  auto chunks = device->create_stream("chunks");
  auto offload = device->create_stream("offload");
  std::vector<std::uint8_t> torch_side(kSize);
  for (std::size_t i = 0; i < kSize; ++i) torch_side[i] = static_cast<std::uint8_t>(i * 7 + 3);
  HostBuffer host(kSize);
  HostBuffer chunk_src(kSize);
  DeviceBuffer chunk = device->allocate(kSize);
  auto done = device->create_event();
  const auto start = Clock::now();
  device->copy_async(chunk_src.data(), chunk.data(), kSize, CopyKind::kDeviceToHost, *chunks);
  device->copy_async_external(host.data(), torch_side.data(), kSize, CopyKind::kDeviceToHost, *offload);
  done->record(*offload);
  done->synchronize();
  chunks->synchronize();
  // One engine carried both (in either order): they took their summed time.
  EXPECT_GE(std::chrono::duration<double>(Clock::now() - start).count(), 2 * kSize / kBandwidth * 0.99);
  EXPECT_EQ(std::memcmp(host.data(), torch_side.data(), kSize), 0);
  // And back, into the torch side.
  std::vector<std::uint8_t> back(kSize);
  device->copy_async_external(back.data(), host.data(), kSize, CopyKind::kHostToDevice, *offload);
  offload->synchronize();
  EXPECT_EQ(back, torch_side);
}

TEST(SimDevice, ExternalCopiesCheckWhatTheyCan) {
  auto device = make_sim_device({.capacity_bytes = 4 * kMiB});
  auto stream = device->create_stream("s");
  HostBuffer host(kMiB);
  DeviceBuffer buf = device->allocate(kMiB);
  std::vector<std::uint8_t> torch_side(kMiB);
  // Device-to-device has no host side to check: not an external copy.
  EXPECT_THROW(device->copy_async_external(torch_side.data(), host.data(), 16, CopyKind::kDeviceToDevice,
                                           *stream),
               ValueError);
  // The host side may not be this device's memory.
  EXPECT_THROW(device->copy_async_external(buf.data(), torch_side.data(), 16, CopyKind::kDeviceToHost,
                                           *stream),
               ValueError);
  // Overlapping ranges.
  EXPECT_THROW(device->copy_async_external(host.data(), static_cast<char*>(host.data()) + 8, 16,
                                           CopyKind::kHostToDevice, *stream),
               ValueError);
  // Another device's stream.
  auto other = make_sim_device({.capacity_bytes = kMiB});
  auto other_stream = other->create_stream("other");
  EXPECT_THROW(device->copy_async_external(host.data(), torch_side.data(), 16, CopyKind::kDeviceToHost,
                                           *other_stream),
               ValueError);
  stream->synchronize();
}

TEST(SimDevice, RejectsNegativeOptions) {
  EXPECT_THROW(make_sim_device({.capacity_bytes = kMiB, .copy_bandwidth_bytes_per_s = -1}), ValueError);
  EXPECT_THROW(make_sim_device({.capacity_bytes = kMiB, .copy_latency_s = -1}), ValueError);
  EXPECT_THROW(make_sim_device({.capacity_bytes = 0}), ValueError);
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    ::setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_) {
      ::setenv(name_, old_.c_str(), 1);
    } else {
      ::unsetenv(name_);
    }
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
};

TEST(SimDevice, OptionsFromTheEnvironment) {
  ScopedEnv capacity("TIDAL_SIM_CAPACITY", "256MiB");
  ScopedEnv bandwidth("TIDAL_SIM_BANDWIDTH", "12GB/s");
  ScopedEnv latency("TIDAL_SIM_LATENCY_US", "5");
  const SimDeviceOptions options = sim_device_options_from_env();
  EXPECT_EQ(options.capacity_bytes, 256 * kMiB);
  EXPECT_DOUBLE_EQ(options.copy_bandwidth_bytes_per_s, 12e9);
  EXPECT_DOUBLE_EQ(options.copy_latency_s, 5e-6);
}

TEST(SimDevice, BadEnvironmentValuesNameTheVariable) {
  ScopedEnv bandwidth("TIDAL_SIM_BANDWIDTH", "fast");
  try {
    sim_device_options_from_env();
    FAIL() << "accepted TIDAL_SIM_BANDWIDTH=fast";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("\"fast\""), std::string::npos) << e.message();
  }
}

// Note [Simulated pinning follows cudaHostRegister] (sim_device.cpp). The expected
// failures are those of cudaHostRegister/cudaHostUnregister on a GPU.
std::string register_error(Device& device, void* ptr, std::size_t bytes) {
  try {
    device.register_host(ptr, bytes);
  } catch (const ValueError& e) {
    return e.what();
  }
  return "";
}

TEST(SimDevicePinning, RegistrationsMayNotSharePagesAndUnregisterNeedsAStart) {
  auto device = make_sim_device({.capacity_bytes = kMiB});
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  void* map = ::mmap(nullptr, 4 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  char* base = static_cast<char*>(map);
  EXPECT_FALSE(device->register_host(base, 100));  // the simulated device pins nothing
  // Disjoint bytes but the same page: CUDA answers cudaErrorHostMemoryAlreadyRegistered.
  EXPECT_NE(register_error(*device, base + 200, 10).find("shares a page"), std::string::npos);
  // A range reaching back into the registered page from the next one.
  EXPECT_NE(register_error(*device, base + page - 1, 2).find("shares a page"), std::string::npos);
  // A range starting on a free page and ending in a registered one.
  EXPECT_FALSE(device->register_host(base + 2 * page + 8, 8));
  EXPECT_NE(register_error(*device, base + page, page + 16).find("shares a page"), std::string::npos);
  EXPECT_FALSE(device->register_host(base + page, page));  // the page between is free
  // Unregister needs a registration's start.
  EXPECT_THROW(device->unregister_host(base + 1), ValueError);
  device->unregister_host(base);
  EXPECT_THROW(device->unregister_host(base), ValueError);  // already unregistered
  EXPECT_FALSE(device->register_host(base + 200, 10));      // the page is free again
  device->unregister_host(base + 200);
  device->unregister_host(base + page);
  device->unregister_host(base + 2 * page + 8);
  // A registration starting on an earlier page and ending in this range's first page.
  EXPECT_FALSE(device->register_host(base + page - 8, 16));
  EXPECT_NE(register_error(*device, base + page + 100, 8).find("shares a page"), std::string::npos);
  device->unregister_host(base + page - 8);
  ::munmap(map, 4 * page);
}

TEST(SimDevicePinning, RangesMustBeMappedReadWriteHostMemory) {
  auto device = make_sim_device({.capacity_bytes = kMiB});
  const std::size_t page = static_cast<std::size_t>(::sysconf(_SC_PAGESIZE));
  void* map = ::mmap(nullptr, 3 * page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  ASSERT_NE(map, MAP_FAILED);
  char* base = static_cast<char*>(map);
  ASSERT_EQ(::mprotect(base + page, page, PROT_READ), 0);
  // A PROT_NONE page stands for an unmapped one: unmapping it would let another thread
  // (or ASan) map something there before the check.
  ASSERT_EQ(::mprotect(base + 2 * page, page, PROT_NONE), 0);
  EXPECT_NE(register_error(*device, base, 2 * page).find("not entirely mapped read-write"),
            std::string::npos);  // the read-only middle page
  EXPECT_NE(register_error(*device, base + 2 * page, page).find("not entirely mapped read-write"),
            std::string::npos);  // no access
  EXPECT_FALSE(device->register_host(base, page));  // the read-write page alone is fine
  device->unregister_host(base);
  DeviceBuffer on_device = device->allocate(4096);
  EXPECT_NE(register_error(*device, on_device.data(), 4096).find("is device memory"), std::string::npos);
  ::munmap(base, 3 * page);
}

TEST(SimDevicePinning, WherePinningIsChargedAPageableCopyMakesTheHostWait) {
  // Note [Simulated pageable copies wait]: 4 MiB at 200 MB/s take ~21 ms; a
  // call that returns with its stream idle waited for the copy. (Reading the
  // destination to tell would race with a copy in flight, which
  // ThreadSanitizer reports, as Note [Simulated copies land late] intends.)
  constexpr std::size_t kSize = 4 * kMiB;
  for (const bool charged : {false, true}) {
    auto device = make_sim_device({.capacity_bytes = 64 * kMiB,
                                   .copy_bandwidth_bytes_per_s = 200e6,
                                   .pin_bandwidth_bytes_per_s = charged ? 1e12 : 0.0});
    auto stream = device->create_stream("copies");
    HostBuffer pageable(kSize);
    HostBuffer pinned(kSize);
    pinned.pin(device);
    DeviceBuffer on_device = device->allocate(kSize);
    unsigned char fill = 1;
    const auto copy = [&](void* dst, const void* src, CopyKind kind) {
      std::memset(const_cast<void*>(src), fill, kSize);
      const auto start = Clock::now();
      device->copy_async(dst, src, kSize, kind, *stream);
      const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
      const bool landed = stream->query();
      stream->synchronize();
      EXPECT_EQ(static_cast<const unsigned char*>(dst)[kSize - 1], fill);
      ++fill;
      return std::make_pair(landed, seconds);
    };
    // A registered host side: asynchronous either way.
    EXPECT_FALSE(copy(on_device.data(), pinned.data(), CopyKind::kHostToDevice).first) << charged;
    // A pageable one, each way: the call returns with the copy done only
    // where pinning is charged.
    const auto up = copy(on_device.data(), pageable.data(), CopyKind::kHostToDevice);
    const auto down = copy(pageable.data(), on_device.data(), CopyKind::kDeviceToHost);
    EXPECT_EQ(up.first, charged);
    EXPECT_EQ(down.first, charged);
    if (charged) {
      EXPECT_GE(up.second, kSize / 200e6 * 0.99);
      EXPECT_GE(down.second, kSize / 200e6 * 0.99);
    }
    pinned.unpin();
  }
}

}  // namespace
}  // namespace tidal
