// The chunk scheduler's disk tier (Note [Chunks on NVMe: the tier]): chunks
// of the optimizer's lists go to a file when the host is full and come back
// with their bytes; a sweep over states three times the host budget, as CPU
// Adam makes, keeps every value, with reads issued ahead by the trace; the
// lists kept off disk, the NVMe budget and a full host give errors that name
// what they need; the file goes with the scheduler.
#include "runtime/scheduler/chunk_scheduler.h"

#include <gtest/gtest.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstring>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <utility>
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

// ---- a disk that fails -------------------------------------------------------
// Note [Chunks on NVMe: after a failure]: a read or write that fails at any
// point of a step (forward, backward, the optimizer's sweep) surfaces as the
// disk's error, never an InternalError; the scheduler's state stays whole;
// every later access is refused with the first failure; the file still goes
// with the scheduler.

// Accesses made so far in a phase, released on the way out however it ends
// (as the engine's hooks and ParamStore.slots do).
struct Held {
  ChunkScheduler& s;
  std::vector<std::pair<TensorRef, TensorState>> refs;
  void* access(TensorRef ref, MemorySpace space, TensorState after) {
    void* p = s.access(ref, space);
    refs.emplace_back(ref, after);
    return p;
  }
  ~Held() {
    for (auto it = refs.rbegin(); it != refs.rend(); ++it) {
      try {
        s.release(it->first, it->second);
      } catch (const std::exception& e) {
        ADD_FAILURE() << "release threw: " << e.what();
      }
    }
  }
};

// One training step over `tensors` full tensors with every list allowed on
// disk (offload_param): forward and backward bring each 16-bit chunk to the
// device, the step sweeps each tensor's fp32 states and 16-bit copy on the
// host, checking the states against the last step and advancing them. Sets
// `phase` to the part of the step it is in, and calls `at_phase` as each
// part begins.
void train_step(ChunkScheduler& s, std::size_t tensors, int step, const char*& phase,
                const std::function<void()>& at_phase = [] {}) {
  phase = "forward";
  at_phase();
  for (std::size_t t = 0; t < tensors; ++t) {
    Held h{s, {}};
    h.access({ChunkKind::kParam16, static_cast<TensorId>(t)}, kDev, TensorState::kHoldAfterFwd);
  }
  phase = "backward";
  at_phase();
  for (std::size_t t = tensors; t-- > 0;) {
    Held h{s, {}};
    h.access({ChunkKind::kParam16, static_cast<TensorId>(t)}, kDev, TensorState::kHoldAfterBwd);
  }
  phase = "step";
  at_phase();
  for (std::size_t t = 0; t < tensors; ++t) {
    Held h{s, {}};
    std::vector<float*> data;
    for (ChunkKind kind : kStates) {
      data.push_back(static_cast<float*>(h.access({kind, static_cast<TensorId>(t)}, kHost, TensorState::kHold)));
    }
    h.access({ChunkKind::kParam16, static_cast<TensorId>(t)}, kHost, TensorState::kHold);
    for (std::size_t k = 0; k < data.size(); ++k) {
      for (std::size_t i = 0; i < kFull; ++i) {
        if (step > 0) {
          ASSERT_EQ(data[k][i], value(t, k, i, step - 1)) << "tensor " << t << " list " << k << " element " << i;
        }
        data[k][i] = value(t, k, i, step);
      }
    }
  }
  s.end_step();
}

constexpr std::size_t kFaultTensors = 10;

ChunkSchedulerOptions fault_options(const testing::TempDir& dir, bool prefetch) {
  // The host holds an eighth of the states and less than the 16-bit chunks,
  // the device two 16-bit chunks: the 16-bit chunks go to disk too, so (without
  // prefetch, which reads the next forward's chunks during the step) every
  // phase reads chunks and writes others to make room.
  ChunkSchedulerOptions o = disk_options(dir, 4 * kFp32Chunk);
  o.prefetch = prefetch;
  o.disk_request_bytes = kFp32Chunk;  // one request per chunk: the test makes many steps
  o.device_budget_bytes = 2 * kChunk;
  o.disk_kinds = ChunkSchedulerOptions::disk_kind_bits(
      {ChunkKind::kParam16, ChunkKind::kParam32, ChunkKind::kMomentum, ChunkKind::kVariance});
  return o;
}

// Reads and writes of the tier in a steady step, counted on a run without
// faults: {read, write} -> the phase each one is issued in, in order.
std::map<bool, std::vector<std::string>> steady_step_io(bool prefetch) {
  testing::TempDir dir("tidal_disk_tier_");
  ChunkScheduler s(full_tensors(kFaultTensors), make_device(kKiB * kKiB), fault_options(dir, prefetch));
  const char* phase = nullptr;
  for (int step = 0; step < 2; ++step) train_step(s, kFaultTensors, step, phase);
  std::map<bool, std::vector<std::string>> io;
  const char* last = nullptr;
  auto count = [&] {
    if (last != nullptr) {
      const ChunkSchedulerStats st = s.stats();
      io[false].resize(st.moves_disk_to_host, last);
      io[true].resize(st.moves_host_to_disk, last);
    }
    last = phase;
  };
  s.reset_stats();
  train_step(s, kFaultTensors, 2, phase, count);
  count();
  return io;
}

TEST(DiskTier, AFailedReadOrWriteAnywhereInAStepIsRefusedWithTheFirstErrorFromThenOn) {
  testing::TempDir dir("tidal_disk_tier_");  // each scheduler's file goes with it
  for (const bool prefetch : {false, true}) {
  const std::map<bool, std::vector<std::string>> io = steady_step_io(prefetch);
  for (const bool write : {false, true}) {
    const std::vector<std::string>& issued = io.at(write);
    ASSERT_GT(issued.size(), 2u);
    if (!prefetch) {
      // Reads and writes happen in every part of the step, so faults are met in each.
      EXPECT_EQ(std::set<std::string>(issued.begin(), issued.end()),
                (std::set<std::string>{"forward", "backward", "step"})) << (write ? "writes" : "reads");
    }
    for (std::uint64_t n = 1; n <= issued.size(); ++n) {
      SCOPED_TRACE(testing::indexed_name(write ? "write " : "read ", n) + (prefetch ? " with prefetch" : ""));
      std::string path;
      {
        ChunkScheduler s(full_tensors(kFaultTensors), make_device(kKiB * kKiB), fault_options(dir, prefetch));
        path = s.disk()->path();
        const char* phase = nullptr;
        for (int step = 0; step < 2; ++step) train_step(s, kFaultTensors, step, phase);
        s.disk()->fail_nth(write, n, EIO);
        std::string first;
        for (int step = 2; step < 4 && first.empty(); ++step) {
          try {
            train_step(s, kFaultTensors, step, phase);
          } catch (const InternalError& e) {
            FAIL() << "an internal error in the " << phase << ": " << e.what();
          } catch (const Error& e) {
            first = e.what();
          }
        }
        ASSERT_FALSE(first.empty()) << "the injected failure never surfaced";
        ASSERT_TRUE(s.disk()->failed());
        const std::string failure = s.disk()->failure();
        EXPECT_NE(failure.find(std::string(write ? "writing " : "reading ")), std::string::npos) << failure;
        EXPECT_NE(failure.find(path), std::string::npos) << failure;
        EXPECT_NE(failure.find(std::strerror(EIO)), std::string::npos) << failure;
        EXPECT_NE(first.find(failure), std::string::npos) << first;
        s.validate();
        // Every later step is refused with the first failure, and the state stays whole.
        for (int again = 0; again < 2; ++again) {
          try {
            train_step(s, kFaultTensors, 9, phase);
            FAIL() << "a step after the failure ran";
          } catch (const InternalError& e) {
            FAIL() << "an internal error after the failure: " << e.what();
          } catch (const Error& e) {
            const std::string m = e.what();
            EXPECT_NE(m.find("the NVMe tier failed earlier"), std::string::npos) << m;
            EXPECT_NE(m.find(failure), std::string::npos) << m;
            EXPECT_EQ(std::string(phase), "forward") << m;  // at the step's first access
          }
          s.validate();
        }
        EXPECT_THROW(s.check_disk(), Error);
      }
      EXPECT_FALSE(exists(path)) << "the file outlived a failed scheduler";
    }
  }
  }
}

TEST(DiskTier, AFailedReadIsTheDisksErrorAtTheAccessThatWaitsForIt) {
  // Without prefetch, the access that reads the chunk is the one that fails,
  // naming the file; the chunk stays where it was read to, whole for validate().
  testing::TempDir dir("tidal_disk_tier_");
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions o = disk_options(dir, 2 * kFp32Chunk);
  o.prefetch = false;
  ChunkScheduler s(full_tensors(4), device, o);
  for (TensorId t = 0; t < 4; ++t) {
    s.access({ChunkKind::kParam32, t}, kHost);
    s.release({ChunkKind::kParam32, t}, TensorState::kHold);
  }
  ASSERT_EQ(s.store().chunk(s.store().chunk_of({ChunkKind::kParam32, 0})).space(), kDisk);
  s.disk()->fail_nth(/*write=*/false, 1, EIO);
  try {
    s.access({ChunkKind::kParam32, 0}, kHost);
    FAIL() << "a failed read went unnoticed";
  } catch (const InternalError& e) {
    FAIL() << e.what();
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("reading "), std::string::npos) << m;
    EXPECT_NE(m.find(s.disk()->path()), std::string::npos) << m;
    EXPECT_NE(m.find(std::strerror(EIO)), std::string::npos) << m;
  }
  s.validate();
  EXPECT_EQ(s.store().state({ChunkKind::kParam32, 0}), TensorState::kHold);
  // Chunks on the host are refused too: the step they belong to is lost.
  EXPECT_THROW(s.access({ChunkKind::kParam32, 3}, kHost), Error);
  s.validate();
}

}  // namespace
}  // namespace tidal
