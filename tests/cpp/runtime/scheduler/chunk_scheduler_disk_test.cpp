// The disk tier's clean chunks (Note [Chunks on NVMe: clean chunks] in
// runtime/scheduler/disk_tier.h, chunk_scheduler_disk.cpp): a chunk read from
// disk and only read since goes back to disk without a write, and its bytes
// are what comes back; any write (a write access, mark_written, an access of
// a FREE slot) makes it go back with a write; a training-like step with
// offload_param moves the same chunks with the skip as without it, only
// writing fewer of them, and every value survives.
#include "runtime/scheduler/chunk_scheduler.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "tests/cpp/runtime/temp_dir.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::kKiB;
using testing::make_device;

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr MemorySpace kDisk = MemorySpace::kDisk;
constexpr std::size_t kChunk = 16 * kKiB;  // a 16-bit chunk
constexpr std::size_t kFull = kChunk / 2;  // elements of a tensor that fills one
constexpr ChunkKind k16 = ChunkKind::kParam16;

ChunkStore full_tensors(std::size_t n) {
  ChunkStore store({.chunk_bytes = kChunk});
  for (std::size_t i = 0; i < n; ++i) store.register_tensor(testing::indexed_name("t", i), kFull);
  return store;
}

// The 16-bit list on disk (offload_param), a host of `host_chunks` 16-bit
// chunks and a device of `device_chunks`.
ChunkSchedulerOptions options(const testing::TempDir& dir, std::size_t host_chunks, std::size_t device_chunks,
                              bool skip = true) {
  ChunkSchedulerOptions o;
  o.host_budget_bytes = host_chunks * kChunk;
  o.device_budget_bytes = device_chunks == 0 ? kChunk / 2 : device_chunks * kChunk;
  o.disk_path = dir.path();
  o.disk_threads = 2;
  o.disk_request_bytes = 8 * kKiB;
  o.disk_kinds = ChunkSchedulerOptions::disk_kind_bits({k16});
  o.disk_skip_clean_writes = skip;
  return o;
}

std::uint16_t value(std::size_t tensor, std::size_t i, int version) {
  return static_cast<std::uint16_t>(tensor * 7919 + i * 3 + static_cast<std::size_t>(version) * 131);
}

TensorRef ref(std::size_t t) { return {k16, static_cast<TensorId>(t)}; }

void write_host(ChunkScheduler& s, std::size_t t, int version) {
  auto* p = static_cast<std::uint16_t*>(s.access(ref(t), kHost, AccessMode::kWrite));
  for (std::size_t i = 0; i < kFull; ++i) p[i] = value(t, i, version);
  s.release(ref(t), TensorState::kHold);
}

// Reads tensor `t` on the host (a read access) and checks it holds `version`.
void read_host(ChunkScheduler& s, std::size_t t, int version) {
  const auto* p = static_cast<const std::uint16_t*>(s.access(ref(t), kHost, AccessMode::kRead));
  for (std::size_t i = 0; i < kFull; ++i) {
    ASSERT_EQ(p[i], value(t, i, version)) << "tensor " << t << " element " << i;
  }
  s.release(ref(t), TensorState::kHold);
}

ChunkId chunk_of(const ChunkScheduler& s, std::size_t t) { return s.store().chunk_of(ref(t)); }

TEST(ChunkSchedulerDisk, AChunkOnlyReadGoesBackToDiskWithoutAWrite) {
  testing::TempDir dir("tidal_disk_clean_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = options(dir, 2, 0);
  o.prefetch = false;
  ChunkScheduler s(full_tensors(6), device, o);
  for (std::size_t t = 0; t < 6; ++t) write_host(s, t, 0);
  EXPECT_EQ(s.stats().moves_host_to_disk, 4u);  // the host holds two
  // A first sweep writes the two written on the host, as they leave it.
  for (std::size_t t = 0; t < 6; ++t) read_host(s, t, 0);
  EXPECT_EQ(s.stats().moves_host_to_disk, 6u);
  const std::uint64_t written = s.disk()->bytes_written();
  s.reset_stats();
  for (int sweep = 0; sweep < 2; ++sweep) {
    for (std::size_t t = 0; t < 6; ++t) read_host(s, t, 0);
    s.validate();
  }
  const ChunkSchedulerStats st = s.stats();
  EXPECT_GE(st.moves_disk_to_host, 8u);  // each sweep reads at least the four on disk
  EXPECT_EQ(st.moves_host_to_disk, 0u);
  EXPECT_EQ(st.bytes_host_to_disk, 0u);
  EXPECT_EQ(st.disk_writes_skipped, st.moves_disk_to_host);  // every chunk read went back unwritten
  EXPECT_EQ(st.bytes_disk_writes_skipped, st.disk_writes_skipped * kChunk);
  EXPECT_EQ(s.disk()->bytes_written(), written);  // the file saw no write
  for (std::size_t t = 0; t < 6; ++t) {
    if (s.store().chunk(chunk_of(s, t)).space() == kDisk) {
      EXPECT_TRUE(s.disk_copy_current(chunk_of(s, t)));
    }
  }
}

TEST(ChunkSchedulerDisk, AChunkWrittenAfterAReadIsWrittenBack) {
  testing::TempDir dir("tidal_disk_clean_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = options(dir, 2, 0);
  o.prefetch = false;
  ChunkScheduler s(full_tensors(6), device, o);
  for (std::size_t t = 0; t < 6; ++t) write_host(s, t, 0);
  for (std::size_t t = 0; t < 6; ++t) read_host(s, t, 0);
  s.reset_stats();
  // Tensor 1 is read (its chunk now matches its home), then written.
  read_host(s, 1, 0);
  EXPECT_TRUE(s.disk_copy_current(chunk_of(s, 1)));
  write_host(s, 1, 1);
  EXPECT_FALSE(s.disk_copy_current(chunk_of(s, 1)));
  for (std::size_t t = 2; t < 6; ++t) read_host(s, t, 0);  // 1 goes to disk
  EXPECT_EQ(s.store().chunk(chunk_of(s, 1)).space(), kDisk);
  EXPECT_EQ(s.stats().moves_host_to_disk, 1u) << "only the chunk written was written";
  EXPECT_EQ(s.stats().bytes_host_to_disk, kChunk);
  for (std::size_t t = 0; t < 6; ++t) read_host(s, t, t == 1 ? 1 : 0);
  s.validate();
}

TEST(ChunkSchedulerDisk, AWriteAfterAReadAccessCountsOnceMarked) {
  testing::TempDir dir("tidal_disk_clean_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = options(dir, 2, 0);
  o.prefetch = false;
  ChunkScheduler s(full_tensors(6), device, o);
  for (std::size_t t = 0; t < 6; ++t) write_host(s, t, 0);
  for (std::size_t t = 0; t < 6; ++t) read_host(s, t, 0);
  // Two read accesses whose holders write after all: tensor 0 says so
  // (mark_written, as the hooks do for a parameter written in a forward),
  // tensor 1 breaks its promise. 0 keeps its write; 1 gets back its home's
  // bytes, which shows that a chunk read and not marked is not written.
  for (std::size_t t : {0u, 1u}) {
    auto* p = static_cast<std::uint16_t*>(s.access(ref(t), kHost, AccessMode::kRead));
    for (std::size_t i = 0; i < kFull; ++i) p[i] = value(t, i, 2);
    if (t == 0) s.mark_written(ref(t));
    s.release(ref(t), TensorState::kHold);
  }
  s.reset_stats();
  for (std::size_t t = 2; t < 6; ++t) read_host(s, t, 0);
  EXPECT_EQ(s.stats().moves_host_to_disk, 1u);
  read_host(s, 0, 2);
  read_host(s, 1, 0);
  s.validate();
}

TEST(ChunkSchedulerDisk, AFreeSlotIsWrittenWhateverTheModeSays) {
  testing::TempDir dir("tidal_disk_clean_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = options(dir, 2, 0);
  o.prefetch = false;
  ChunkScheduler s(full_tensors(3), device, o);
  for (std::size_t t = 0; t < 3; ++t) write_host(s, t, 0);
  for (std::size_t t = 0; t < 3; ++t) read_host(s, t, 0);
  const ChunkId c0 = chunk_of(s, 0);
  ASSERT_EQ(s.store().chunk(c0).space(), kDisk);
  // All of its slots FREE: the payload goes (on disk, the home is kept but
  // holds nothing anyone needs), and a read access of the FREE slot gets a
  // fresh block its user fills.
  s.set_state(ref(0), TensorState::kFree);
  EXPECT_FALSE(s.store().chunk(c0).has_payload());
  EXPECT_FALSE(s.disk_copy_current(c0));
  auto* p = static_cast<std::uint16_t*>(s.access(ref(0), kHost, AccessMode::kRead));
  EXPECT_FALSE(s.disk_copy_current(c0));
  for (std::size_t i = 0; i < kFull; ++i) p[i] = value(0, i, 3);
  s.release(ref(0), TensorState::kHold);
  s.reset_stats();
  read_host(s, 1, 0);
  read_host(s, 2, 0);
  EXPECT_EQ(s.store().chunk(c0).space(), kDisk);
  EXPECT_EQ(s.stats().moves_host_to_disk, 1u);
  read_host(s, 0, 3);
  s.validate();
}

// One training-like step over `n` tensors with the 16-bit list on disk:
// forward reads each 16-bit chunk on the device (a read access); backward
// reads it again and a gradient lands in it (mark_written, as the hooks do
// when a gradient lands in an attached parameter); the step reads the
// gradient on the host and writes the new weights (a write access).
void train_step(ChunkScheduler& s, std::size_t n, int step) {
  auto device_check = [&](std::size_t t, const void* data, int version) {
    std::vector<std::uint16_t> back(kFull);
    auto stream = s.device().create_stream("test.d2h");
    s.device().copy_async(back.data(), data, kChunk, CopyKind::kDeviceToHost, *stream);
    stream->synchronize();
    for (std::size_t i = 0; i < kFull; ++i) {
      ASSERT_EQ(back[i], value(t, i, version)) << "step " << step << " tensor " << t << " element " << i;
    }
  };
  for (std::size_t t = 0; t < n; ++t) {
    const void* w = s.access(ref(t), kDev, AccessMode::kRead);
    device_check(t, w, 2 * step);
    s.release(ref(t), TensorState::kHoldAfterFwd);
  }
  for (std::size_t t = n; t-- > 0;) {
    void* w = s.access(ref(t), kDev, AccessMode::kRead);
    device_check(t, w, 2 * step);
    std::vector<std::uint16_t> grad(kFull);
    for (std::size_t i = 0; i < kFull; ++i) grad[i] = value(t, i, 2 * step + 1);
    s.mark_written(ref(t));
    auto stream = s.device().create_stream("test.h2d");
    s.device().copy_async(w, grad.data(), kChunk, CopyKind::kHostToDevice, *stream);
    stream->synchronize();
    s.release(ref(t), TensorState::kHoldAfterBwd);
  }
  for (std::size_t t = 0; t < n; ++t) {
    auto* p = static_cast<std::uint16_t*>(s.access(ref(t), kHost));
    for (std::size_t i = 0; i < kFull; ++i) {
      ASSERT_EQ(p[i], value(t, i, 2 * step + 1)) << "gradient, step " << step << " tensor " << t;
      p[i] = value(t, i, 2 * step + 2);
    }
    s.release(ref(t), TensorState::kHold);
  }
  s.end_step();
}

struct StepCounts {
  std::uint64_t read = 0, written = 0, skipped = 0;
};

StepCounts steady_step(bool skip, bool prefetch) {
  testing::TempDir dir("tidal_disk_clean_");
  constexpr std::size_t n = 8;
  ChunkSchedulerOptions o = options(dir, 3, 2, skip);
  o.prefetch = prefetch;
  ChunkScheduler s(full_tensors(n), make_device(kKiB * kKiB), o);
  for (std::size_t t = 0; t < n; ++t) write_host(s, t, 0);
  for (int step = 0; step < 2; ++step) {
    train_step(s, n, step);
    s.validate();
  }
  s.reset_stats();
  train_step(s, n, 2);
  s.validate();
  const ChunkSchedulerStats st = s.stats();
  EXPECT_EQ(st.bytes_host_to_disk, st.moves_host_to_disk * kChunk);
  return {st.moves_disk_to_host, st.moves_host_to_disk, st.disk_writes_skipped};
}

TEST(ChunkSchedulerDisk, ATrainingStepMovesTheSameChunksAndWritesFewer) {
  for (bool prefetch : {false, true}) {
    SCOPED_TRACE(prefetch ? "with prefetch" : "without prefetch");
    const StepCounts on = steady_step(/*skip=*/true, prefetch);
    const StepCounts off = steady_step(/*skip=*/false, prefetch);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_EQ(off.skipped, 0u);
    EXPECT_GT(on.skipped, 0u) << "forward reads chunks from disk that go back unchanged";
    // The skip changes no decision: the same chunks go to disk and come back.
    EXPECT_EQ(on.read, off.read);
    EXPECT_EQ(on.written + on.skipped, off.written);
    EXPECT_LT(on.written, off.written);
  }
}

}  // namespace
}  // namespace tidal
