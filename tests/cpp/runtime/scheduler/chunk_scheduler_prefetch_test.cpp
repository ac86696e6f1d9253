// Prefetch and OPT on repeated traces: prefetch turns misses into hits with
// a slow simulated link, compute waits only for the chunk it uses, prefetch
// never evicts a chunk needed sooner, and OPT moves no more bytes than LRU.
#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "runtime/core/error.h"
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
constexpr std::size_t kChunk = 4 * kKiB;
constexpr std::size_t kFull = 2048;

TensorRef p16(TensorId t) { return {ChunkKind::kParam16, t}; }

// Forward 0..n-1 then backward n-1..0 on the device, `steps` times; checks
// every tensor's bytes at every access and returns the counters of the
// steps after the first (the recorded one).
ChunkSchedulerStats run_forward_backward(bool prefetch, int n, int budget_chunks, int steps,
                                         double bandwidth) {
  auto device = make_device(kKiB * kKiB, bandwidth);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = budget_chunks * kChunk;
  options.prefetch = prefetch;
  options.prefetch_depth = 2;
  ChunkScheduler s(make_store(std::vector<std::size_t>(n, kFull), kChunk), device, options);
  std::vector<unsigned> version(n, 0);
  auto use = [&](TensorId t, TensorState after) {
    void* p = s.access(p16(t), kDev);
    if (version[t] > 0) {
      EXPECT_TRUE(has_pattern(p, kFull * 2, 1000 * t + version[t])) << "tensor " << t;
    }
    write_pattern(p, kFull * 2, 1000 * t + ++version[t]);
    s.release(p16(t), after);
  };
  for (int step = 0; step < steps; ++step) {
    if (step == 1) s.reset_stats();
    for (int t = 0; t < n; ++t) use(t, TensorState::kHoldAfterFwd);
    for (int t = n - 1; t >= 0; --t) use(t, TensorState::kHoldAfterBwd);
    if (step > 0) {
      EXPECT_TRUE(s.following_trace()) << "step " << step;
    }
    s.end_step();
    s.validate();
  }
  return s.stats();
}

TEST(ChunkSchedulerPrefetch, TurnsMissesIntoHitsOnARepeatedTrace) {
  // 4 KiB at 20 MB/s: every move takes about 0.2 ms.
  const ChunkSchedulerStats off = run_forward_backward(false, 8, 4, 4, 20e6);
  const ChunkSchedulerStats on = run_forward_backward(true, 8, 4, 4, 20e6);
  EXPECT_GT(off.misses, 0u);
  EXPECT_EQ(off.prefetch_hits, 0u);
  EXPECT_EQ(off.prefetches, 0u);
  EXPECT_EQ(on.misses, 0u) << "every chunk of a repeated step should arrive ahead of its use";
  EXPECT_EQ(on.prefetch_hits, off.misses);
  EXPECT_EQ(on.prefetches_wasted, 0u);
  // Prefetch moves the same chunks earlier; it does not move more.
  EXPECT_EQ(on.bytes_host_to_device, off.bytes_host_to_device);
  EXPECT_EQ(on.bytes_device_to_host, off.bytes_device_to_host);
  EXPECT_LE(on.peak_resident_bytes[index_of(kDev)], 4 * kChunk);
}

// A: 4 KiB, B: a 256 KiB dedicated chunk that takes ~50 ms at 5 MB/s. Step:
// A and B on the device, then both on the host. When step 1 ends, prefetch
// starts moving A and then B back; the access of A in step 2 returns as soon
// as A landed, long before B has.
TEST(ChunkSchedulerPrefetch, ComputeWaitsOnlyForTheChunkItUses) {
  auto device = make_device(4 * kKiB * kKiB, 5e6);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = kKiB * kKiB;
  ChunkStore store({.chunk_bytes = kChunk});
  store.register_tensor("a", kFull);
  store.register_tensor("b", 128 * kKiB);
  EXPECT_EQ(store.take_warnings().size(), 1u);
  ChunkScheduler s(std::move(store), device, options);
  const ChunkId b_chunk = s.store().chunk_of(p16(1));
  const std::size_t b_bytes = 128 * kKiB * 2;
  unsigned version = 0;
  for (int step = 0; step < 2; ++step) {
    void* a = s.access(p16(0), kDev);
    if (step == 1) {
      EXPECT_TRUE(s.following_trace());
      EXPECT_EQ(s.stats().prefetches, 2u);
      EXPECT_EQ(s.stats().prefetch_hits, 1u);
      EXPECT_FALSE(s.chunk_ready(b_chunk)) << "access(a) waited for b's prefetch";
      EXPECT_TRUE(s.chunk_ready(s.store().chunk_of(p16(0))));
    }
    write_pattern(a, kFull * 2, 50 + step);
    s.release(p16(0), TensorState::kHold);
    void* b = s.access(p16(1), kDev);
    EXPECT_TRUE(s.chunk_ready(b_chunk));
    if (step == 1) {
      EXPECT_TRUE(has_pattern(b, b_bytes, version));
      EXPECT_EQ(s.stats().prefetch_hits, 2u);
    }
    write_pattern(b, b_bytes, ++version);
    s.release(p16(1), TensorState::kHold);
    EXPECT_TRUE(has_pattern(s.access(p16(0), kHost), kFull * 2, 50 + step));
    s.release(p16(0), TensorState::kHold);
    EXPECT_TRUE(has_pattern(s.access(p16(1), kHost), b_bytes, version));
    s.release(p16(1), TensorState::kHold);
    s.end_step();
    s.validate();
  }
}

// Step: A B A C with room for two chunks. While B is in use, C is next to
// fetch, but the only movable chunk is A, needed sooner: the prefetch waits,
// and send_ahead (whose room is a prefetch's) sends nothing either. Once B is
// released it is the chunk needed latest (next step), so the prefetch evicts
// B and fetches C, and A stays; there is nothing left to send ahead.
TEST(ChunkSchedulerPrefetch, NeverEvictsAChunkNeededSooner) {
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = 2 * kChunk;
  ChunkScheduler s(make_store({kFull, kFull, kFull}, kChunk), device, options);
  const TensorId sequence[] = {0, 1, 0, 2};
  auto where = [&](TensorId t) { return s.store().chunk(s.store().chunk_of(p16(t))).space(); };
  for (int step = 0; step < 3; ++step) {
    for (int m = 0; m < 4; ++m) {
      s.access(p16(sequence[m]), kDev);
      if (step >= 1 && m == 1) {
        EXPECT_FALSE(s.send_ahead(s.store().chunk_of(p16(2))));
        EXPECT_EQ(where(0), kDev) << "A, needed at the next moment, was evicted";
        EXPECT_NE(where(2), kDev);
      }
      s.release(p16(sequence[m]), TensorState::kHold);
      if (step >= 1 && m == 1) {
        EXPECT_EQ(where(2), kDev) << "C was not prefetched";
        EXPECT_EQ(where(1), kHost);
        EXPECT_EQ(where(0), kDev);
        EXPECT_FALSE(s.send_ahead(s.store().chunk_of(p16(2))));
      }
    }
    s.end_step();
    s.validate();
  }
  EXPECT_EQ(s.stats().prefetches_ahead, 0u);
  // Step 0 creates each chunk where it is first used; every later move is a prefetch.
  EXPECT_EQ(s.stats().misses, 0u);
  EXPECT_EQ(s.stats().materializations, 3u);
  EXPECT_GT(s.stats().prefetch_hits, 0u);
}

// Belady: with chunks of one size and one chunk in use at a time, evicting
// the farthest next use moves the fewest chunks on a known sequence. The
// first step has no trace (both are LRU), later steps repeat it.
TEST(ChunkSchedulerPrefetch, OptMovesNoMoreBytesThanLruOnRepeatedTraces) {
  int strictly_better = 0;
  for (unsigned seed = 0; seed < 30; ++seed) {
    SCOPED_TRACE(seed);
    std::mt19937 rng(seed);
    const int n = 3 + static_cast<int>(rng() % 10);
    const int budget = 1 + static_cast<int>(rng() % (n - 1));
    std::vector<TensorId> sequence;
    for (int t = 0; t < n; ++t) sequence.push_back(t);
    const int extra = static_cast<int>(rng() % (3 * n));
    for (int i = 0; i < extra; ++i) sequence.push_back(rng() % n);
    std::shuffle(sequence.begin(), sequence.end(), rng);
    ChunkSchedulerStats result[2];
    for (int p = 0; p < 2; ++p) {
      auto device = make_device(kKiB * kKiB);
      ChunkSchedulerOptions options;
      options.device_budget_bytes = budget * kChunk;
      options.prefetch = false;
      options.policy = make_eviction_policy(p == 0 ? "opt" : "lru");
      ChunkScheduler s(make_store(std::vector<std::size_t>(n, kFull), kChunk), device, options);
      for (int step = 0; step < 4; ++step) {
        for (TensorId t : sequence) {
          s.access(p16(t), kDev);
          s.release(p16(t), TensorState::kHold);
        }
        s.end_step();
      }
      s.validate();
      result[p] = s.stats();
    }
    const ChunkSchedulerStats& opt = result[0];
    const ChunkSchedulerStats& lru = result[1];
    EXPECT_LE(opt.bytes_host_to_device, lru.bytes_host_to_device);
    EXPECT_LE(opt.bytes_host_to_device + opt.bytes_device_to_host,
              lru.bytes_host_to_device + lru.bytes_device_to_host);
    EXPECT_LE(opt.misses, lru.misses);
    strictly_better += opt.bytes_host_to_device < lru.bytes_host_to_device;
  }
  // The comparison can tell the policies apart: OPT wins outright somewhere.
  EXPECT_GT(strictly_better, 5);
}

TEST(ChunkSchedulerPrefetch, HostSideUsesArePrefetchedToo) {
  // Step: both chunks on the device, then both on the host (the optimizer).
  auto device = make_device(kKiB * kKiB, 20e6);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = 4 * kChunk;
  ChunkScheduler s(make_store({kFull, kFull}, kChunk), device, options);
  for (int step = 0; step < 3; ++step) {
    if (step == 1) s.reset_stats();
    for (TensorId t : {0u, 1u}) {
      write_pattern(s.access(p16(t), kDev), kFull * 2, 10 * step + t);
      s.release(p16(t), TensorState::kHoldAfterBwd);
    }
    for (TensorId t : {0u, 1u}) {
      EXPECT_TRUE(has_pattern(s.access(p16(t), kHost), kFull * 2, 10 * step + t));
      s.release(p16(t), TensorState::kHold);
    }
    s.end_step();
  }
  const ChunkSchedulerStats st = s.stats();
  EXPECT_GT(st.prefetches, 0u);
  EXPECT_GT(st.bytes_device_to_host, 0u);
  EXPECT_EQ(st.prefetch_hits + st.hits + st.misses + st.materializations, st.accesses);
  s.validate();
}

// Note [Sent ahead of the cursor]: the shape of CPU Adam during backward.
// Step: chunks 0..3 on the device (forward), then 3, 2, 1 accessed on the
// host and held in use (pinned for their updates, the last-used first), each
// written there (the update) and released in that order. The prefetch
// cursor is held back at the next step's use of chunk 1, in use until last;
// send_ahead moves chunks 3 and 2 up as soon as they are released, past the cursor,
// without counting against prefetch_depth, and the next step finds it there
// (a prefetch hit) with the bytes written on the host. The same chunks move
// as without it.
ChunkSchedulerStats run_updates_on_the_host(bool ahead) {
  auto device = make_device(kKiB * kKiB, 20e6);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = 8 * kChunk;
  options.prefetch_depth = 1;
  ChunkScheduler s(make_store({kFull, kFull, kFull, kFull}, kChunk), device, options);
  auto where = [&](TensorId t) { return s.store().chunk(s.store().chunk_of(p16(t))).space(); };
  std::vector<unsigned> version(4, 0);
  for (int step = 0; step < 4; ++step) {
    if (step == 1) s.reset_stats();
    for (TensorId t = 0; t < 4; ++t) {
      void* p = s.access(p16(t), kDev);
      if (version[t] > 0) {
        EXPECT_TRUE(has_pattern(p, kFull * 2, 100 * t + version[t])) << "step " << step << " tensor " << t;
      }
      s.release(p16(t), TensorState::kHoldAfterFwd);
    }
    for (TensorId t : {3u, 2u, 1u}) write_pattern(s.access(p16(t), kHost), kFull * 2, 100 * t + ++version[t]);
    // In use: never sent (and nothing happens to it).
    EXPECT_FALSE(s.send_ahead(s.store().chunk_of(p16(2))));
    EXPECT_EQ(where(2), kHost);
    for (TensorId t : {3u, 2u, 1u}) {
      s.release(p16(t), TensorState::kHold);
      const bool sent = ahead && s.send_ahead(s.store().chunk_of(p16(t)));
      // Step 0 records the trace: there is no next use to send a chunk to.
      // Chunk 1 is the cursor's: its release lets the prefetch itself move it.
      EXPECT_EQ(sent, ahead && step > 0 && t != 1) << "step " << step << " tensor " << t;
      if (sent) {
        EXPECT_EQ(where(t), kDev);
        // Already on its way: a second call starts nothing.
        EXPECT_FALSE(s.send_ahead(s.store().chunk_of(p16(t))));
      }
    }
    s.end_step();
    s.validate();
  }
  // The next forward: what the last step sent ahead, it would have moved anyway.
  for (TensorId t = 0; t < 4; ++t) {
    void* p = s.access(p16(t), kDev);
    if (version[t] > 0) EXPECT_TRUE(has_pattern(p, kFull * 2, 100 * t + version[t])) << "tensor " << t;
    s.release(p16(t), TensorState::kHoldAfterFwd);
  }
  s.validate();
  return s.stats();
}

TEST(ChunkSchedulerPrefetch, SendAheadMovesAFinishedChunkPastTheCursor) {
  const ChunkSchedulerStats off = run_updates_on_the_host(false);
  const ChunkSchedulerStats on = run_updates_on_the_host(true);
  EXPECT_EQ(off.prefetches_ahead, 0u);
  EXPECT_EQ(on.prefetches_ahead, 2u * 3u);  // chunks 3 and 2 in each of steps 1-3
  EXPECT_EQ(on.prefetches_wasted, 0u);
  EXPECT_EQ(on.misses, 0u);
  EXPECT_GE(on.prefetch_hits, on.prefetches_ahead);
  EXPECT_EQ(on.bytes_host_to_device, off.bytes_host_to_device);
  EXPECT_EQ(on.bytes_device_to_host, off.bytes_device_to_host);
  EXPECT_EQ(on.prefetch_hits + on.hits + on.misses + on.materializations, on.accesses);
}

// Note [Sent ahead and evicted] (python/tidal/engine/overlap.py): the chunks
// send_ahead moved that an eviction for room takes before the use they were
// sent for are named once by take_ahead_wasted(); those their use finds, and
// a move an access makes, are not. The shape of SendAheadMovesAFinishedChunk-
// PastTheCursor: chunks 3 and 2 sent ahead after their updates on the host;
// in one step the device budget then shrinks to one chunk (the room the next
// forward's peak leaves), and OPT evicts the chunks used last.
TEST(ChunkSchedulerPrefetch, TakeAheadWastedNamesTheSendsEvictedBeforeTheirUse) {
  auto device = make_device(kKiB * kKiB, 20e6);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = 8 * kChunk;
  options.prefetch_depth = 1;
  ChunkScheduler s(make_store({kFull, kFull, kFull, kFull}, kChunk), device, options);
  auto id = [&](TensorId t) { return s.store().chunk_of(p16(t)); };
  // One step; returns the chunks sent ahead.
  auto step = [&](bool shrink, bool fetch_three_back) {
    for (TensorId t = 0; t < 4; ++t) {
      s.access(p16(t), kDev);
      s.release(p16(t), TensorState::kHoldAfterFwd);
    }
    for (TensorId t : {3u, 2u, 1u}) write_pattern(s.access(p16(t), kHost), kFull * 2, 7 * t);
    std::vector<ChunkId> sent;
    for (TensorId t : {3u, 2u, 1u}) {
      s.release(p16(t), TensorState::kHold);
      if (s.send_ahead(id(t))) sent.push_back(id(t));
    }
    if (shrink) {
      s.set_budget(kDev, kChunk);
      s.set_budget(kDev, 8 * kChunk);
    }
    if (fetch_three_back) {
      // An access that moves a chunk sent ahead back down: not the room's doing.
      s.access(p16(3), kHost);
      s.release(p16(3), TensorState::kHold);
    }
    s.end_step();
    s.validate();
    return sent;
  };
  EXPECT_TRUE(step(false, false).empty());  // (step 0 records the trace: nothing to send to)
  const std::vector<ChunkId> kept = step(false, false);
  EXPECT_EQ(kept, (std::vector<ChunkId>{id(3), id(2)}));
  EXPECT_TRUE(s.take_ahead_wasted().empty());  // (the next forward used the ones kept)
  const std::vector<ChunkId> sent = step(true, false);
  EXPECT_EQ(sent, (std::vector<ChunkId>{id(3), id(2)}));
  std::vector<ChunkId> wasted = s.take_ahead_wasted();
  std::sort(wasted.begin(), wasted.end());
  EXPECT_EQ(wasted, (std::vector<ChunkId>{id(2), id(3)}));
  EXPECT_TRUE(s.take_ahead_wasted().empty());  // (named once)
  step(false, true);
  EXPECT_TRUE(s.take_ahead_wasted().empty());
  EXPECT_GT(s.stats().prefetches_wasted, 0u);
}


// Note [Chunks leave ahead of a lowering]. Forward 0..7 then backward 7..0
// on the device, as a memory tracer drives it: the budget (all 8 chunks)
// drops to 4 after forward's sixth access (moment 5, the activation peak's
// interval) and comes back after backward's second (moment 9), each time
// with BlockFrees::kWhenNeeded, and after the first step the scheduler is
// told the lowerings still to come: at every access, or (as a tracer whose
// points are modules apart) only at the step's start and at each lowering.
// OPT's victims at the lowering are chunks 0-3 (used last in backward); each
// is last used before it at its forward access, so with the plan each
// leaves right after that access (at the plan, or at the release that ends
// the use), and the prefetch cursor does not bring them back before the
// budget rises. Without the plan they leave at the lowering. The same chunks
// move either way, and every byte is checked at every access.
struct LoweringRun {
  ChunkSchedulerStats steady;
  // Per steady step, the moment of each chunk's move off the device.
  std::vector<std::vector<std::int64_t>> left_at;
};

LoweringRun run_with_a_lowering(bool evict_ahead, bool plan_at_every_access = true) {
  constexpr int kN = 8;
  auto device = make_device(kKiB * kKiB, 20e6);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = kN * kChunk;
  options.prefetch_depth = 2;
  options.evict_ahead = evict_ahead;
  ChunkScheduler s(make_store(std::vector<std::size_t>(kN, kFull), kChunk), device, options);
  const std::vector<PlannedLowering> plan{{5, 4 * kChunk}, {9, kN * kChunk}};
  std::vector<unsigned> version(kN, 0);
  LoweringRun out;
  for (int step = 0; step < 4; ++step) {
    if (step == 1) s.reset_stats();
    const auto plan_from = [&](std::int64_t moment) {
      if (step == 0) return;  // (no trace yet: a tracer plans from the last step)
      const bool at_a_point = moment == -1 || std::any_of(plan.begin(), plan.end(), [&](const PlannedLowering& l) {
                                return l.after == moment;
                              });
      if (!plan_at_every_access && !at_a_point) return;
      std::vector<PlannedLowering> rest;
      for (const PlannedLowering& l : plan) {
        if (l.after > moment) rest.push_back(l);
      }
      s.plan_lowerings(rest);
    };
    std::vector<std::int64_t> left(kN, -1);
    const auto note_moves = [&](std::int64_t moment) {
      for (TensorId t = 0; t < kN; ++t) {
        const MemorySpace space = s.store().chunk(s.store().chunk_of(p16(t))).space();
        if (space == kHost && left[t] < 0) left[t] = moment;
      }
    };
    plan_from(-1);
    std::int64_t moment = -1;
    const auto use = [&](TensorId t, TensorState after) {
      void* p = s.access(p16(t), kDev);
      ++moment;
      if (version[t] > 0) {
        EXPECT_TRUE(has_pattern(p, kFull * 2, 1000 * t + version[t])) << "tensor " << t;
      }
      write_pattern(p, kFull * 2, 1000 * t + ++version[t]);
      s.release(p16(t), after);
      for (const PlannedLowering& l : plan) {
        if (l.after == moment) s.set_budget(kDev, l.bytes, BlockFrees::kWhenNeeded);
      }
      plan_from(moment);
      note_moves(moment);
    };
    for (TensorId t = 0; t < kN; ++t) use(t, TensorState::kHoldAfterFwd);
    for (TensorId t = kN; t-- > 0;) use(t, TensorState::kHoldAfterBwd);
    if (step > 0) {
      EXPECT_TRUE(s.following_trace()) << "step " << step;
      out.left_at.push_back(left);
    }
    s.end_step();
    s.validate();
  }
  out.steady = s.stats();
  return out;
}

class ChunksALoweringEvicts : public ::testing::TestWithParam<bool> {};

TEST_P(ChunksALoweringEvicts, LeaveAtTheirLastUseBeforeIt) {
  const LoweringRun off = run_with_a_lowering(false, GetParam());
  const LoweringRun on = run_with_a_lowering(true, GetParam());
  // Each steady step evicts six chunks: the lowering's four, and two that
  // the prefetch of chunks 3 and 2 for backward evicts within the lowered
  // budget (7 and 6, done until the next step's forward) after their
  // backward use.
  EXPECT_EQ(off.steady.evictions, 3u * 6u);
  EXPECT_EQ(off.steady.evictions_ahead, 0u);
  EXPECT_EQ(on.steady.evictions, off.steady.evictions);
  EXPECT_EQ(on.steady.evictions_ahead, 3u * 4u);
  ASSERT_EQ(on.left_at.size(), 3u);
  for (std::size_t step = 0; step < on.left_at.size(); ++step) {
    for (TensorId t = 0; t < 4; ++t) {
      EXPECT_EQ(off.left_at[step][t], 5) << "tensor " << t << " (without the plan: at the lowering)";
      EXPECT_EQ(on.left_at[step][t], static_cast<std::int64_t>(t)) << "tensor " << t << ": at its forward access";
    }
    EXPECT_EQ(on.left_at[step][4], -1);
    EXPECT_EQ(on.left_at[step][5], -1);
    EXPECT_EQ(on.left_at[step][6], off.left_at[step][6]);
    EXPECT_EQ(on.left_at[step][7], off.left_at[step][7]);
  }
  // Nothing came back up before its use could keep it (the prefetches kept
  // within the lowered budget), so the same bytes moved, all ahead of use.
  EXPECT_EQ(on.steady.bytes_device_to_host, off.steady.bytes_device_to_host);
  EXPECT_EQ(on.steady.bytes_host_to_device, off.steady.bytes_host_to_device);
  EXPECT_EQ(on.steady.bytes_host_to_device, 3u * 6u * kChunk);
  EXPECT_EQ(on.steady.misses, 0u);
  EXPECT_EQ(on.steady.prefetches_wasted, 0u);
}

INSTANTIATE_TEST_SUITE_P(ChunkSchedulerPrefetch, ChunksALoweringEvicts, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) {
                           return info.param ? "PlannedAtEveryAccess" : "PlannedAtPointsOnly";
                         });

TEST(ChunkSchedulerPrefetch, APlanOfLoweringsOutOfOrderIsAnError) {
  ChunkScheduler s(make_store({kFull, kFull}, kChunk), make_device(kKiB * kKiB), ChunkSchedulerOptions{});
  for (int step = 0; step < 2; ++step) {
    for (TensorId t = 0; t < 2; ++t) {
      s.access(p16(t), kDev);
      s.release(p16(t), TensorState::kHold);
    }
    s.end_step();
  }
  s.access(p16(0), kDev);
  s.release(p16(0), TensorState::kHold);
  EXPECT_THROW(s.plan_lowerings({{1, kChunk}, {0, kChunk}}), ValueError);
  EXPECT_THROW(s.plan_lowerings({{2, kChunk}}), ValueError);  // past the step's last moment
  EXPECT_EQ(s.plan_lowerings({{1, 2 * kChunk}}), 0u);
  s.validate();
}

}  // namespace
}  // namespace tidal
