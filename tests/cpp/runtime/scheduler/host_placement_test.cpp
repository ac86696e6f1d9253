// Note [One place per chunk] on the simulated device: a chunk moved to the
// device gives its host memory back (beyond a small cache), a full host
// budget spills host chunks into free device room so that a model larger
// than the host budget alone fits host + device, and making host room for a
// device eviction never spills back.
#include <gtest/gtest.h>

#include <string>

#include "runtime/core/error.h"
#include "runtime/memory/host_buffer.h"
#include "runtime/scheduler/chunk_scheduler.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::has_pattern;
using testing::kKiB;
using testing::make_device;
using testing::make_store;
using testing::write_pattern;

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr std::size_t kChunk = 4 * kKiB;  // 2048 fp16 elements
constexpr std::size_t kFull = 2048;       // a tensor that fills a chunk
constexpr std::size_t kBytes = kFull * 2;

TensorRef p16(TensorId t) { return {ChunkKind::kParam16, t}; }

ChunkSchedulerOptions options(std::size_t device_chunks, std::size_t host_chunks,
                              std::size_t host_cache_blocks) {
  ChunkSchedulerOptions o;
  o.device_budget_bytes = device_chunks * kChunk;
  if (host_chunks > 0) o.host_budget_bytes = host_chunks * kChunk;
  o.prefetch = false;
  o.host_cache_blocks = host_cache_blocks;
  return o;
}

std::vector<std::size_t> full_tensors(std::size_t n) { return std::vector<std::size_t>(n, kFull); }

// Writes tensor i's pattern on the host (materializing its chunk there).
void fill_on_host(ChunkScheduler& s, std::size_t n) {
  for (TensorId t = 0; t < n; ++t) {
    write_pattern(s.access(p16(t), kHost), kBytes, 100 + t);
    s.release(p16(t), TensorState::kHold);
  }
}

std::size_t resident(const ChunkScheduler& s, MemorySpace space) {
  return s.stats().resident_bytes[index_of(space)];
}

TEST(HostPlacement, ChunksOnTheDeviceGiveTheirHostMemoryBack) {
  auto device = make_device(kKiB * kKiB);
  const std::size_t baseline = host_memory_stats().allocated_bytes;
  {
    ChunkScheduler s(make_store(full_tensors(8), kChunk), device,
                     options(/*device_chunks=*/16, /*host_chunks=*/0, /*host_cache_blocks=*/1));
    fill_on_host(s, 8);
    EXPECT_EQ(resident(s, kHost), 8 * kChunk);
    for (TensorId t = 0; t < 8; ++t) {
      EXPECT_TRUE(has_pattern(s.access(p16(t), kDev), kBytes, 100 + t));
      s.release(p16(t), TensorState::kHold);
    }
    // Note [Host blocks for a steady step]: the first step keeps every free
    // block (the next may take them back); from the second, the cache keeps
    // what each of the last two steps took, and this one took none.
    s.end_step();
    EXPECT_EQ(s.stats().held_bytes[index_of(kHost)], 8 * kChunk);
    s.end_step();  // frees the host blocks whose copies finished since
    const ChunkSchedulerStats st = s.stats();
    EXPECT_EQ(st.resident_bytes[index_of(kHost)], 0u);
    EXPECT_EQ(st.resident_bytes[index_of(kDev)], 8 * kChunk);
    // One block stays cached for the next eviction; the other seven are gone,
    // from the pool and from the process.
    EXPECT_EQ(st.held_bytes[index_of(kHost)], kChunk);
    EXPECT_LE(host_memory_stats().allocated_bytes - baseline, 2 * kChunk)
        << "host memory still held for chunks that live on the device";
    // Back down: each eviction-free move to the host takes new host blocks.
    for (TensorId t = 0; t < 8; ++t) {
      EXPECT_TRUE(has_pattern(s.access(p16(t), kHost), kBytes, 100 + t));
      s.release(p16(t), TensorState::kHold);
    }
    EXPECT_EQ(resident(s, kHost), 8 * kChunk);
    s.validate();
  }
  EXPECT_EQ(host_memory_stats().allocated_bytes, baseline);
}

TEST(HostPlacement, AModelLargerThanTheHostBudgetFitsHostPlusDevice) {
  auto device = make_device(kKiB * kKiB);
  // 8 chunks of state; the host budget takes 4 and the device 5.
  ChunkScheduler s(make_store(full_tensors(8), kChunk), device,
                   options(/*device_chunks=*/5, /*host_chunks=*/4, /*host_cache_blocks=*/2));
  fill_on_host(s, 8);
  ChunkSchedulerStats st = s.stats();
  EXPECT_LE(st.held_bytes[index_of(kHost)], 4 * kChunk);
  EXPECT_EQ(st.resident_bytes[index_of(kHost)] + st.resident_bytes[index_of(kDev)], 8 * kChunk);
  EXPECT_EQ(st.spills, 4u);
  EXPECT_EQ(st.evictions, 0u);
  s.validate();

  // Every tensor is used where it is wanted, twice round, host and device in
  // turn: spills and evictions swap chunks through the one free chunk of room
  // and no byte is lost.
  for (int round = 0; round < 2; ++round) {
    for (TensorId t = 0; t < 8; ++t) {
      const MemorySpace space = (t + round) % 2 == 0 ? kHost : kDev;
      EXPECT_TRUE(has_pattern(s.access(p16(t), space), kBytes, 100 + t))
          << "tensor " << t << " on " << to_string(space) << " in round " << round;
      s.release(p16(t), TensorState::kHold);
      st = s.stats();
      EXPECT_LE(st.held_bytes[index_of(kHost)], 4 * kChunk);
      EXPECT_LE(st.held_bytes[index_of(kDev)], 5 * kChunk);
    }
    s.end_step();
  }
  EXPECT_GT(s.stats().spills, 4u);
  s.validate();
}

TEST(HostPlacement, HostRoomForADeviceEvictionNeverSpillsBack) {
  auto device = make_device(kKiB * kKiB);
  // 8 chunks fill host (4) and device (4) exactly; a ninth has no room.
  ChunkScheduler s(make_store(full_tensors(9), kChunk), device,
                   options(/*device_chunks=*/4, /*host_chunks=*/4, /*host_cache_blocks=*/0));
  fill_on_host(s, 8);
  EXPECT_EQ(resident(s, kHost), 4 * kChunk);
  EXPECT_EQ(resident(s, kDev), 4 * kChunk);
  const ChunkSchedulerStats before = s.stats();
  try {
    s.access(p16(8), kDev);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("no room on host"), std::string::npos) << message;
    EXPECT_NE(message.find("being evicted from the device"), std::string::npos) << message;
  }
  const ChunkSchedulerStats after = s.stats();
  EXPECT_EQ(after.spills, before.spills);
  EXPECT_EQ(after.moves_host_to_device, before.moves_host_to_device);
  EXPECT_EQ(after.moves_device_to_host, before.moves_device_to_host);
  EXPECT_EQ(s.store().state(p16(8)), TensorState::kFree);
  for (TensorId t = 0; t < 8; ++t) {
    const MemorySpace space = s.store().chunk(s.store().chunk_of(p16(t))).space();
    EXPECT_TRUE(has_pattern(s.access(p16(t), space), kBytes, 100 + t));
    s.release(p16(t), TensorState::kHold);
  }
  s.validate();
}

TEST(HostPlacement, ASpillNeverEvictsADeviceChunk) {
  auto device = make_device(kKiB * kKiB);
  // The device is full of chunks in use elsewhere: the host budget is the limit.
  ChunkScheduler s(make_store(full_tensors(6), kChunk), device,
                   options(/*device_chunks=*/2, /*host_chunks=*/3, /*host_cache_blocks=*/0));
  for (TensorId t = 0; t < 2; ++t) {
    write_pattern(s.access(p16(t), kDev), kBytes, 100 + t);
    s.release(p16(t), TensorState::kHold);
  }
  for (TensorId t = 2; t < 5; ++t) {
    write_pattern(s.access(p16(t), kHost), kBytes, 100 + t);
    s.release(p16(t), TensorState::kHold);
  }
  EXPECT_THROW(s.access(p16(5), kHost), OutOfMemoryError);
  const ChunkSchedulerStats st = s.stats();
  EXPECT_EQ(st.spills, 0u);
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_EQ(st.resident_bytes[index_of(kDev)], 2 * kChunk);
  s.validate();
}

}  // namespace
}  // namespace tidal
