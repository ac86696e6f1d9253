// The chunk scheduler's disk tier (Note [Chunks on NVMe: the tier]): chunks
// of the optimizer's lists go to a file when the host is full and come back
// with their bytes; a sweep over states three times the host budget, as CPU
// Adam makes, keeps every value, with reads issued ahead by the trace; the
// lists kept off disk, the NVMe budget and a full host give errors that name
// what they need; the file goes with the scheduler.
#include "runtime/scheduler/chunk_scheduler.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "tests/cpp/runtime/temp_dir.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::kKiB;
using testing::make_device;

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr MemorySpace kDisk = MemorySpace::kDisk;
constexpr std::size_t kChunk = 16 * kKiB;  // 16-bit chunk; fp32 chunks are 32 KiB
constexpr std::size_t kFull = kChunk / 2;  // elements of a tensor that fills a chunk
constexpr std::size_t kFp32Chunk = 2 * kChunk;


bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

ChunkStore full_tensors(std::size_t n) {
  ChunkStore store({.chunk_bytes = kChunk});
  for (std::size_t i = 0; i < n; ++i) store.register_tensor(testing::indexed_name("t", i), kFull);
  return store;
}

ChunkSchedulerOptions disk_options(const testing::TempDir& dir, std::size_t host_budget) {
  ChunkSchedulerOptions o;
  o.device_budget_bytes = kChunk;  // no fp32 chunk fits: nothing spills up
  o.host_budget_bytes = host_budget;
  o.disk_path = dir.path();
  o.disk_threads = 4;
  o.disk_request_bytes = 8 * kKiB;
  return o;
}

constexpr ChunkKind kStates[] = {ChunkKind::kParam32, ChunkKind::kMomentum, ChunkKind::kVariance};

float value(std::size_t tensor, std::size_t kind, std::size_t i, int step) {
  return static_cast<float>(tensor * 100000 + kind * 10000 + i % 5000) + static_cast<float>(step);
}

// One "optimizer step": each tensor's three state slots on the host at once,
// checked against the previous step and advanced by one.
void sweep(ChunkScheduler& s, std::size_t tensors, int step) {
  for (std::size_t t = 0; t < tensors; ++t) {
    std::vector<float*> data;
    for (ChunkKind kind : kStates) {
      data.push_back(static_cast<float*>(s.access({kind, static_cast<TensorId>(t)}, kHost)));
    }
    for (std::size_t k = 0; k < data.size(); ++k) {
      for (std::size_t i = 0; i < kFull; ++i) {
        if (step > 0) {
          ASSERT_EQ(data[k][i], value(t, k, i, step - 1)) << "tensor " << t << " list " << k << " element " << i;
        }
        data[k][i] = value(t, k, i, step);
      }
    }
    for (ChunkKind kind : kStates) s.release({kind, static_cast<TensorId>(t)}, TensorState::kHold);
    const ChunkSchedulerStats st = s.stats();
    ASSERT_LE(st.held_bytes[index_of(kHost)], st.budget_bytes[index_of(kHost)]);
  }
  s.end_step();
}

TEST(DiskTier, StatesThreeTimesTheHostBudgetKeepEveryValue) {
  testing::TempDir dir("tidal_disk_tier_");
  constexpr std::size_t kTensors = 12;  // 12 x 3 x 32 KiB = 1152 KiB of states
  const std::size_t host_budget = 12 * kFp32Chunk;  // 384 KiB: a third
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(full_tensors(kTensors), device, disk_options(dir, host_budget));
  ASSERT_NE(s.disk(), nullptr);
  EXPECT_TRUE(exists(s.disk()->path()));
  for (int step = 0; step < 4; ++step) {
    sweep(s, kTensors, step);
    s.validate();
  }
  const ChunkSchedulerStats st = s.stats();
  EXPECT_GT(st.moves_host_to_disk, 0u);
  EXPECT_GT(st.moves_disk_to_host, 0u);
  EXPECT_EQ(st.bytes_host_to_disk, st.moves_host_to_disk * kFp32Chunk);
  EXPECT_EQ(st.bytes_disk_to_host, st.moves_disk_to_host * kFp32Chunk);
  EXPECT_GE(st.resident_bytes[index_of(kDisk)], kTensors * 3 * kFp32Chunk - host_budget);
  EXPECT_LE(st.held_bytes[index_of(kDisk)], kTensors * 3 * kFp32Chunk);  // one home per chunk
  EXPECT_LE(st.peak_resident_bytes[index_of(kHost)], host_budget);
  // From the second step the trace reads chunks ahead of their use.
  EXPECT_GT(st.prefetch_hits, 0u);
  EXPECT_GT(s.disk()->bytes_written(), 0u);
}

TEST(DiskTier, SteadyStepsMoveEachChunkOnceEachWay) {
  // OPT over a cyclic sweep larger than the host keeps the same chunks on
  // the host each step; what goes to disk comes back once per step.
  testing::TempDir dir("tidal_disk_tier_");
  constexpr std::size_t kTensors = 8;
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(full_tensors(kTensors), device, disk_options(dir, 12 * kFp32Chunk));
  for (int step = 0; step < 2; ++step) sweep(s, kTensors, step);
  s.reset_stats();
  sweep(s, kTensors, 2);
  const ChunkSchedulerStats st = s.stats();
  const std::size_t on_disk_chunks = kTensors * 3 - 12;
  EXPECT_LE(st.moves_disk_to_host, on_disk_chunks + 3) << "reads per step against the chunks that do not fit";
  EXPECT_GE(st.moves_disk_to_host, on_disk_chunks - 3);
  EXPECT_EQ(st.moves_disk_to_host, st.moves_host_to_disk);
}

TEST(DiskTier, AChunkOnDiskGoesToTheDeviceThroughTheHost) {
  testing::TempDir dir("tidal_disk_tier_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = disk_options(dir, 2 * kFp32Chunk);
  o.device_budget_bytes = 4 * kFp32Chunk;
  o.prefetch = false;
  ChunkScheduler s(full_tensors(4), device, o);
  for (std::size_t t = 0; t < 4; ++t) {
    auto* p = static_cast<float*>(s.access({ChunkKind::kParam32, static_cast<TensorId>(t)}, kHost));
    for (std::size_t i = 0; i < kFull; ++i) p[i] = value(t, 0, i, 0);
    s.release({ChunkKind::kParam32, static_cast<TensorId>(t)}, TensorState::kHold);
  }
  // The host holds two; the other two went to disk, not into the device's
  // free room (Note [One place per chunk]: with a disk tier only lists kept
  // off disk spill).
  std::size_t on_disk = 0;
  for (std::size_t t = 0; t < 4; ++t) {
    on_disk += s.store().chunk(s.store().chunk_of({ChunkKind::kParam32, static_cast<TensorId>(t)})).space() == kDisk;
  }
  EXPECT_EQ(on_disk, 2u);
  EXPECT_EQ(s.stats().spills, 0u);
  s.validate();
  for (std::size_t t = 0; t < 4; ++t) {
    const TensorRef ref{ChunkKind::kParam32, static_cast<TensorId>(t)};
    auto* p = static_cast<float*>(s.access(ref, kDev));
    EXPECT_TRUE(device->owns(p, kFull * sizeof(float)));
    std::vector<float> back(kFull);
    auto stream = device->create_stream("test.d2h");
    device->copy_async(back.data(), p, kFull * sizeof(float), CopyKind::kDeviceToHost, *stream);
    stream->synchronize();
    for (std::size_t i = 0; i < kFull; ++i) ASSERT_EQ(back[i], value(t, 0, i, 0)) << "tensor " << t;
    s.release(ref, TensorState::kHold);
  }
  s.validate();
  // All four are on the device now: every chunk written to disk (the two at
  // the start, and those the host gave up to read them) was read back.
  EXPECT_EQ(s.store().chunks_in(kDisk), 0u);
  EXPECT_GE(s.stats().moves_disk_to_host, on_disk);
  EXPECT_EQ(s.stats().moves_disk_to_host, s.stats().moves_host_to_disk);
}

TEST(DiskTier, SixteenBitChunksStayOffDiskByDefault) {
  testing::TempDir dir("tidal_disk_tier_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = disk_options(dir, 2 * kChunk);
  o.device_budget_bytes = kChunk / 2;  // nothing fits on the device
  ChunkScheduler s(full_tensors(3), device, o);
  for (TensorId t = 0; t < 2; ++t) {
    s.access({ChunkKind::kParam16, t}, kHost);
    s.release({ChunkKind::kParam16, t}, TensorState::kHold);
  }
  try {
    s.access({ChunkKind::kParam16, 2}, kHost);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("no host chunk can go to disk"), std::string::npos) << m;
    EXPECT_NE(m.find(dir.path()), std::string::npos) << m;
  }
  s.validate();
  // With the 16-bit list allowed (offload_param), the same access succeeds.
  testing::TempDir dir2("tidal_disk_tier_");
  o = disk_options(dir2, 2 * kChunk);
  o.device_budget_bytes = kChunk / 2;
  o.disk_kinds = ChunkSchedulerOptions::disk_kind_bits({ChunkKind::kParam16, ChunkKind::kParam32});
  ChunkScheduler s2(full_tensors(3), device, o);
  for (TensorId t = 0; t < 3; ++t) {
    s2.access({ChunkKind::kParam16, t}, kHost);
    s2.release({ChunkKind::kParam16, t}, TensorState::kHold);
  }
  EXPECT_EQ(s2.stats().moves_host_to_disk, 1u);
  s2.validate();
}

TEST(DiskTier, TheNvmeBudgetIsAClearErrorAndMovesNothing) {
  testing::TempDir dir("tidal_disk_tier_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = disk_options(dir, 2 * kFp32Chunk);
  o.disk_budget_bytes = kFp32Chunk;  // one chunk's home
  o.prefetch = false;
  ChunkScheduler s(full_tensors(4), device, o);
  for (TensorId t = 0; t < 3; ++t) {
    auto* p = static_cast<float*>(s.access({ChunkKind::kParam32, t}, kHost));
    for (std::size_t i = 0; i < kFull; ++i) p[i] = value(t, 0, i, 0);
    s.release({ChunkKind::kParam32, t}, TensorState::kHold);
  }
  EXPECT_EQ(s.stats().moves_host_to_disk, 1u);
  try {
    s.access({ChunkKind::kParam32, 3}, kHost);
    FAIL() << "expected OutOfMemoryError";
  } catch (const OutOfMemoryError& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("NVMe budget is 32.00 KiB"), std::string::npos) << m;
    EXPECT_NE(m.find(dir.path()), std::string::npos) << m;
    EXPECT_NE(m.find("free on its file system"), std::string::npos) << m;
  }
  s.validate();
  // Nothing moved: the chunk asked for has no payload, the two on the host
  // are there with their values (the one on disk needs another home to come
  // back while the host is full, so it stays there).
  EXPECT_FALSE(s.store().chunk(s.store().chunk_of({ChunkKind::kParam32, 3})).has_payload());
  EXPECT_EQ(s.store().chunk(s.store().chunk_of({ChunkKind::kParam32, 0})).space(), kDisk);
  for (TensorId t = 1; t < 3; ++t) {
    auto* p = static_cast<float*>(s.access({ChunkKind::kParam32, t}, kHost));
    for (std::size_t i = 0; i < kFull; ++i) ASSERT_EQ(p[i], value(t, 0, i, 0)) << "tensor " << t;
    s.release({ChunkKind::kParam32, t}, TensorState::kHold);
  }
}

TEST(DiskTier, TheFileGoesWithTheScheduler) {
  testing::TempDir dir("tidal_disk_tier_");
  std::string path;
  {
    auto device = make_device(kKiB * kKiB);
    ChunkScheduler s(full_tensors(6), device, disk_options(dir, 6 * kFp32Chunk));
    sweep(s, 6, 0);
    path = s.disk()->path();
    EXPECT_TRUE(exists(path));
  }
  EXPECT_FALSE(exists(path));
}

TEST(DiskTier, AFolderThatIsNotThereIsRefused) {
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o;
  o.disk_path = "/nonexistent/tidal-nvme";
  try {
    ChunkScheduler s(full_tensors(1), device, o);
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/tidal-nvme"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace tidal
