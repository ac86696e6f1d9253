#include "runtime/memory/host_buffer.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <unistd.h>
#include <utility>

#include "runtime/core/error.h"
#include "runtime/device/sim_device.h"

namespace tidal {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;

bool aligned(const void* p, std::size_t alignment) {
  return reinterpret_cast<std::uintptr_t>(p) % alignment == 0;
}

TEST(HostBuffer, SmallBuffersAreCacheLineAligned) {
  for (std::size_t size : {1, 63, 64, 65, 4096, 100000}) {
    HostBuffer buf(size);
    EXPECT_TRUE(aligned(buf.data(), 64)) << size;
    EXPECT_EQ(buf.size(), size);
    std::memset(buf.data(), 0xab, size);  // writable end to end (ASan checks)
  }
  HostBuffer page(100, 4096);
  EXPECT_TRUE(aligned(page.data(), 4096));
}

// cudaHostRegister pins whole pages: two buffers sharing one could not both
// be pinned, so each buffer starts on its own page.
TEST(HostBuffer, SmallBuffersOwnTheirPages) {
  const auto page = static_cast<std::uintptr_t>(::sysconf(_SC_PAGESIZE));
  HostBuffer a(10);
  HostBuffer b(10);
  const auto pa = reinterpret_cast<std::uintptr_t>(a.data());
  const auto pb = reinterpret_cast<std::uintptr_t>(b.data());
  EXPECT_EQ(pa % page, 0u);
  EXPECT_EQ(pb % page, 0u);
  EXPECT_GE(pa > pb ? pa - pb : pb - pa, page);
}

TEST(HostBuffer, LargeBuffersAreHugePageAligned) {
  HostBuffer buf(5 * kMiB);
  EXPECT_TRUE(aligned(buf.data(), HostBuffer::kHugePageBytes));
  EXPECT_EQ(buf.alignment(), HostBuffer::kHugePageBytes);
}

TEST(HostBuffer, CountersReturnToBaseline) {
  const HostMemoryStats before = host_memory_stats();
  {
    HostBuffer a(3 * kMiB);
    HostBuffer b(1000);
    const HostMemoryStats during = host_memory_stats();
    EXPECT_EQ(during.allocated_bytes, before.allocated_bytes + 3 * kMiB + 1000);
    EXPECT_EQ(during.live_buffers, before.live_buffers + 2);
    EXPECT_GE(during.peak_allocated_bytes, during.allocated_bytes);
    EXPECT_EQ(during.huge_page_bytes - before.huge_page_bytes, a.huge_pages() ? 3 * kMiB : 0);
    HostBuffer moved = std::move(a);  // a move transfers, never double-counts
    EXPECT_TRUE(a.empty());
    EXPECT_EQ(host_memory_stats().allocated_bytes, during.allocated_bytes);
  }
  const HostMemoryStats after = host_memory_stats();
  EXPECT_EQ(after.allocated_bytes, before.allocated_bytes);
  EXPECT_EQ(after.live_buffers, before.live_buffers);
  EXPECT_EQ(after.huge_page_bytes, before.huge_page_bytes);
}

TEST(HostBuffer, BadArgumentsAreNamed) {
  EXPECT_THROW(HostBuffer(0), ValueError);
  try {
    HostBuffer(100, 96);
    FAIL() << "accepted alignment 96";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("got 96"), std::string::npos) << e.message();
  }
  EXPECT_THROW(HostBuffer(100, 32), ValueError);
}

TEST(HostBuffer, SimulatedDeviceDoesNotPinAndDoublePinIsAnError) {
  auto device = make_sim_device({.capacity_bytes = kMiB});
  const HostMemoryStats before = host_memory_stats();
  HostBuffer buf(4096, device);
  EXPECT_FALSE(buf.pinned());
  EXPECT_EQ(host_memory_stats().pinned_bytes, before.pinned_bytes);
  EXPECT_THROW(buf.pin(device), ValueError);
  buf.unpin();
  EXPECT_FALSE(buf.pin(device));
}

}  // namespace
}  // namespace tidal
