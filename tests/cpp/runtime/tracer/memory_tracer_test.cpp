// The memory tracer and budget arbiter (Note [The memory tracer], Note [The
// warm-up budget]) on the simulated device, with a scripted non-chunk meter:
// the budget it gives the chunk scheduler at each point, the recorded trace,
// the peaks, a path that changes, a failed step, and overruns.
#include <gtest/gtest.h>

#include <algorithm>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/tracer/memory_tracer.h"
#include "runtime/core/error.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::kKiB;
using testing::make_device;
using testing::make_store;

constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr std::size_t kChunk = 4 * kKiB;  // 2048 fp16 elements per chunk
constexpr std::size_t kFull = 2048;

TensorRef p16(TensorId t) { return {ChunkKind::kParam16, t}; }

// Non-chunk memory set by the test: `now`, and a peak that follows it
// until restart_peak().
class ScriptedMeter final : public NonChunkMeter {
 public:
  struct State {
    std::size_t now = 0;
    std::size_t peak = 0;
    int restarts = 0;
  };
  explicit ScriptedMeter(std::shared_ptr<State> state) : state_(std::move(state)) {}
  std::pair<std::size_t, std::size_t> read() override { return {state_->now, state_->peak}; }
  void restart_peak() override {
    state_->peak = state_->now;
    ++state_->restarts;
  }

 private:
  std::shared_ptr<State> state_;
};

struct Rig {
  std::shared_ptr<ScriptedMeter::State> meter = std::make_shared<ScriptedMeter::State>();
  std::shared_ptr<Device> device = make_device(kKiB * kKiB);
  std::unique_ptr<ChunkScheduler> scheduler;
  std::unique_ptr<MemoryTracer> tracer;

  // Eight one-chunk tensors; device budget 100 KiB, margin 4 KiB, warm-up
  // room 12 KiB (three chunks).
  explicit Rig(std::size_t warmup_room = 3 * kChunk) {
    ChunkSchedulerOptions options;
    options.device_budget_bytes = 96 * kKiB;
    options.prefetch = false;
    scheduler = std::make_unique<ChunkScheduler>(
        make_store(std::vector<std::size_t>(8, kFull), kChunk), device, options);
    tracer = std::make_unique<MemoryTracer>(
        scheduler.get(), std::make_unique<ScriptedMeter>(meter),
        MemoryTracerLimits{.device_budget = 100 * kKiB, .margin = 4 * kKiB, .warmup_room = warmup_room});
  }
  // Non-chunk memory rises to `peak` within the interval, then is `now`.
  void activations(std::size_t peak, std::size_t now) {
    meter->now = peak;
    meter->peak = std::max(meter->peak, peak);
    meter->now = now;
  }
  std::size_t budget() const { return scheduler->budget(kDev); }
};

TEST(MemoryTracer, WarmupCapsChunksAtTheWarmupRoomWithinWhatActivationsLeave) {
  Rig rig;
  rig.activations(10 * kKiB, 10 * kKiB);
  rig.tracer->point(PointKind::kForward, 0);
  EXPECT_EQ(rig.budget(), 3 * kChunk);  // min(96 - 10 KiB, 12 KiB)
  rig.activations(90 * kKiB, 90 * kKiB);
  rig.tracer->point(PointKind::kForward, 1);
  EXPECT_EQ(rig.budget(), 6 * kKiB);  // 96 - 90 KiB: less than the room
  EXPECT_FALSE(rig.tracer->warmed_up());
}

TEST(MemoryTracer, AfterTheWarmupTheBudgetLeavesRoomForTheNextIntervalsRecordedPeak) {
  Rig rig;
  // Warm-up: three intervals with peaks 20, 60, 30 KiB; the step point ends
  // a fourth (peak 5 KiB).
  const std::size_t peaks[] = {20 * kKiB, 60 * kKiB, 30 * kKiB, 5 * kKiB};
  rig.activations(0, 0);
  rig.tracer->point(PointKind::kForward, 0);  // interval 0 ends (peak 0)
  for (int i = 0; i < 3; ++i) {
    rig.activations(peaks[i], 0);
    rig.tracer->point(i < 2 ? PointKind::kForward : PointKind::kGrad, i + 1);
  }
  rig.activations(peaks[3], 0);
  rig.tracer->end_step();
  ASSERT_TRUE(rig.tracer->warmed_up());
  EXPECT_EQ(rig.tracer->trace(),
            (std::vector<std::size_t>{0, 20 * kKiB, 60 * kKiB, 30 * kKiB, 5 * kKiB}));
  EXPECT_EQ(rig.tracer->peak_nonchunk(), 60 * kKiB);
  // Step 2, at point k the budget is limit - max(now, trace[k + 1]).
  rig.tracer->point(PointKind::kForward, 0);
  EXPECT_EQ(rig.budget(), 96 * kKiB - 20 * kKiB);
  rig.activations(20 * kKiB, 40 * kKiB);
  rig.tracer->point(PointKind::kForward, 1);
  EXPECT_EQ(rig.budget(), 96 * kKiB - 60 * kKiB);
  rig.activations(60 * kKiB, 50 * kKiB);
  rig.tracer->point(PointKind::kForward, 2);
  EXPECT_EQ(rig.budget(), 96 * kKiB - 50 * kKiB);  // now (50) above the record (30)
  // A point the trace does not have (the path changed): the largest peak.
  rig.activations(0, 0);
  rig.tracer->point(PointKind::kGrad, 3);
  rig.tracer->point(PointKind::kGrad, 4);
  EXPECT_EQ(rig.budget(), 96 * kKiB - 60 * kKiB);
  // The longer step's record becomes the trace.
  rig.tracer->end_step();
  EXPECT_EQ(rig.tracer->trace().size(), 6u);
  EXPECT_EQ(rig.tracer->timeline().size(), 6u);
  EXPECT_EQ(rig.tracer->timeline().back().kind, PointKind::kStep);
}

TEST(MemoryTracer, PeakTotalIsChunksHeldPlusTheIntervalsNonChunkPeak) {
  Rig rig(/*warmup_room=*/8 * kChunk);
  rig.tracer->point(PointKind::kForward, 0);
  for (TensorId t = 0; t < 4; ++t) rig.scheduler->access(p16(t), kDev);  // 16 KiB of chunks
  rig.activations(30 * kKiB, 10 * kKiB);
  rig.tracer->point(PointKind::kForward, 1);
  EXPECT_EQ(rig.tracer->peak_total(), 4 * kChunk + 30 * kKiB);
  EXPECT_TRUE(rig.tracer->timeline().empty());  // published at end_step
  for (TensorId t = 0; t < 4; ++t) rig.scheduler->release(p16(t), TensorState::kHold);
  rig.tracer->end_step();
  const auto& timeline = rig.tracer->timeline();
  ASSERT_EQ(timeline.size(), 3u);
  EXPECT_EQ(timeline[1].chunk_bytes, 4 * kChunk);
  EXPECT_EQ(timeline[1].nonchunk_peak, 30 * kKiB);
  EXPECT_EQ(timeline[1].what, 1);
  EXPECT_EQ(timeline[1].moves_host_to_device, 0u);  // first placements are not moves
}

TEST(MemoryTracer, ABudgetTheChunksInUseExceedIsAnOverrunNotAnError) {
  Rig rig(/*warmup_room=*/8 * kChunk);
  rig.tracer->point(PointKind::kForward, 0);
  for (TensorId t = 0; t < 4; ++t) rig.scheduler->access(p16(t), kDev);  // in COMPUTE
  rig.activations(90 * kKiB, 90 * kKiB);  // leaves 6 KiB: less than the 16 KiB in use
  EXPECT_NO_THROW(rig.tracer->point(PointKind::kForward, 1));
  EXPECT_EQ(rig.tracer->overruns(), 1u);
  EXPECT_EQ(rig.budget(), 8 * kChunk);  // unchanged
  for (TensorId t = 0; t < 4; ++t) rig.scheduler->release(p16(t), TensorState::kHold);
}

TEST(MemoryTracer, AFailedStepDropsItsRecordAndKeepsTheTrace) {
  Rig rig;
  rig.tracer->point(PointKind::kForward, 0);
  rig.activations(40 * kKiB, 0);
  rig.tracer->end_step();
  const auto trace = rig.tracer->trace();
  rig.tracer->point(PointKind::kForward, 0);
  rig.tracer->point(PointKind::kForward, 1);
  rig.tracer->drop_step();
  EXPECT_EQ(rig.tracer->trace(), trace);
  // The next step starts at point 0 again: its budget is for interval 1.
  rig.tracer->point(PointKind::kForward, 0);
  EXPECT_EQ(rig.budget(), 96 * kKiB - 40 * kKiB);
}

TEST(MemoryTracer, TheWarmupRoomGrowsToWhatTheParametersInUseNeed) {
  Rig rig;  // room 12 KiB
  rig.activations(50 * kKiB, 50 * kKiB);
  rig.tracer->point(PointKind::kForward, 0);
  EXPECT_EQ(rig.budget(), 3 * kChunk);
  rig.tracer->grow_warmup_room(5 * kChunk);
  EXPECT_EQ(rig.budget(), 5 * kChunk);
  EXPECT_EQ(rig.tracer->warmup_room(), 5 * kChunk);
  // Within what activations leave: 96 - 50 = 46 KiB.
  rig.tracer->grow_warmup_room(20 * kChunk);
  EXPECT_EQ(rig.budget(), 46 * kKiB);
  // Once warmed up the room no longer applies.
  rig.tracer->end_step();
  rig.tracer->grow_warmup_room(24 * kChunk);
  EXPECT_EQ(rig.tracer->warmup_room(), 20 * kChunk);
}

TEST(MemoryTracer, MakeRoomRaisesTheBudgetUpToTheLimitOnly) {
  Rig rig;
  rig.activations(50 * kKiB, 50 * kKiB);
  rig.tracer->point(PointKind::kForward, 0);
  rig.tracer->make_room(10 * kChunk);
  EXPECT_EQ(rig.budget(), 10 * kChunk);
  rig.tracer->make_room(kChunk);  // never lowers
  EXPECT_EQ(rig.budget(), 10 * kChunk);
  rig.tracer->make_room(1000 * kChunk);
  EXPECT_EQ(rig.budget(), 96 * kKiB);
}

TEST(MemoryTracer, EveryPointRestartsTheMetersPeak) {
  Rig rig;
  const int before = rig.meter->restarts;
  rig.tracer->point(PointKind::kForward, 0);
  rig.tracer->point(PointKind::kBackward, 0);
  EXPECT_EQ(rig.meter->restarts, before + 2);
  rig.meter->now = 7;
  EXPECT_EQ(rig.tracer->live(), 7u);
  EXPECT_EQ(rig.meter->restarts, before + 2);  // live() does not restart it
}

// Note [Chunks leave ahead of a lowering] (runtime/scheduler/chunk_scheduler.h),
// as the tracer drives it. Forward 0..7 then backward 7..0, a point before
// each access (as a module's hook comes before its parameters' access), and
// 64 KiB of activations except in the intervals of accesses 6 to 9, which
// peak at 80 KiB: from the step after the warm-up, point 6 (after moment 5)
// lowers the budget from 8 chunks to 4, point 10 raises it again, and the
// step's point lowers it to 4 (the largest peak) until the next step's
// first. At each point the tracer tells the scheduler the lowerings the
// rest of the last step's record sets (plan_lowerings). Without the plan,
// chunks 0-3 leave at the lowering (point 6); with it, the lowering's
// victims leave at their forward access (0 and 1; in the first steady step
// 2 and 3 too, where chunks 6 and 7 are still up from the warm-up), and the
// others (2 and 3 where chunks 6 and 7 start the step on the host) as the
// prefetch of 6 and 7 makes room within the planned budget, all before
// point 6; no more bytes move either way and no access misses. `shift`: in
// the third step only, a point no access follows comes first (a hook the
// record does not have), so every point's moment differs from the record's
// and the tracer plans nothing in that step, nor in the next (whose record
// has the extra point).
struct TracedRun {
  ChunkSchedulerStats steady;
  // Per steady step, when each chunk left: 2i if at point i, 2i + 1 if
  // at access i (or its release).
  std::vector<std::vector<int>> left_at;
  std::vector<std::uint64_t> ahead;                // per steady step, evictions_ahead
  std::uint64_t steady_overruns = 0;
};

TracedRun run_traced(bool evict_ahead, bool shift = false) {
  constexpr int kN = 8;
  ChunkSchedulerOptions options;
  options.device_budget_bytes = kN * kChunk;
  options.prefetch_depth = 2;
  options.evict_ahead = evict_ahead;
  ChunkScheduler s(make_store(std::vector<std::size_t>(kN, kFull), kChunk), make_device(kKiB * kKiB, 20e6),
                   options);
  auto meter = std::make_shared<ScriptedMeter::State>();
  MemoryTracer tracer(&s, std::make_unique<ScriptedMeter>(meter),
                      MemoryTracerLimits{.device_budget = 100 * kKiB, .margin = 4 * kKiB,
                                         .warmup_room = kN * kChunk});
  TracedRun out;
  std::uint64_t overruns_before = 0, ahead_before = 0;
  for (int step = 0; step < 5; ++step) {
    if (step == 1) {
      s.reset_stats();
      overruns_before = tracer.overruns();
    }
    std::vector<int> left(kN, -1);
    const auto note_moves = [&](int when) {
      for (TensorId t = 0; t < kN; ++t) {
        if (s.store().chunk(s.store().chunk_of(p16(t))).space() == MemorySpace::kHost && left[t] < 0) left[t] = when;
      }
    };
    if (shift && step == 2) tracer.point(PointKind::kForward, -1);
    for (int i = 0; i < 2 * kN; ++i) {
      const TensorId t = i < kN ? i : 2 * kN - 1 - i;
      tracer.point(i < kN ? PointKind::kForward : PointKind::kBackward, t);
      note_moves(2 * i);
      meter->now = meter->peak = (i >= 6 && i <= 9) ? 80 * kKiB : 64 * kKiB;
      meter->now = 64 * kKiB;
      s.access(p16(t), kDev);
      s.release(p16(t), i < kN ? TensorState::kHoldAfterFwd : TensorState::kHoldAfterBwd);
      note_moves(2 * i + 1);
    }
    s.end_step();
    tracer.end_step();
    s.validate();
    if (step > 0) {
      EXPECT_TRUE(s.following_trace()) << "step " << step;
      out.left_at.push_back(left);
      out.ahead.push_back(s.stats().evictions_ahead - ahead_before);
      ahead_before = s.stats().evictions_ahead;
    }
  }
  out.steady = s.stats();
  out.steady_overruns = tracer.overruns() - overruns_before;
  return out;
}

TEST(MemoryTracer, ChunksALoweringWillEvictLeaveAtTheirLastUseBeforeIt) {
  const TracedRun off = run_traced(false);
  const TracedRun on = run_traced(true);
  ASSERT_EQ(on.left_at.size(), 4u);
  for (std::size_t step = 0; step < on.left_at.size(); ++step) {
    for (TensorId t = 0; t < 4; ++t) {
      EXPECT_EQ(off.left_at[step][t], 2 * 6) << "tensor " << t << " (without the plan: at point 6)";
      EXPECT_LT(on.left_at[step][t], 2 * 6) << "tensor " << t << " step " << step << ": before the lowering";
      EXPECT_GE(on.left_at[step][t], 2 * t + 1) << "tensor " << t << ": not before its use";
    }
    EXPECT_EQ(on.left_at[step][0], 1);  // at its own access
    EXPECT_EQ(on.left_at[step][1], 3);
    EXPECT_GE(on.ahead[step], 4u) << "step " << step;  // (the lowerings' victims: 2 at moment 5, 2 at the step's point)
    EXPECT_EQ(off.ahead[step], 0u) << "step " << step;
  }
  EXPECT_EQ(on.left_at[0][2], 5);  // (the first steady step: 6 and 7 start it on the device)
  EXPECT_EQ(on.left_at[0][3], 7);
  // No more bytes either way than without the plan (which at times moves a
  // chunk or two more down, by the copies' timing: under AddressSanitizer
  // one in a fresh-clone CI run).
  EXPECT_LE(on.steady.bytes_device_to_host, off.steady.bytes_device_to_host);
  EXPECT_LE(on.steady.bytes_host_to_device, off.steady.bytes_host_to_device);
  EXPECT_EQ(on.steady.misses, 0u);
  EXPECT_EQ(on.steady_overruns, 0u);
  EXPECT_EQ(off.steady_overruns, 0u);
}

TEST(MemoryTracer, AStepWhosePointsAreNotTheRecordsPlansNoLowering) {
  const TracedRun on = run_traced(true);
  const TracedRun shifted = run_traced(true, /*shift=*/true);
  ASSERT_EQ(shifted.ahead.size(), 4u);
  EXPECT_EQ(shifted.ahead[0], on.ahead[0]);  // (step 1: the record's points)
  EXPECT_GT(on.ahead[1], 0u);
  // Step 2 has the extra point, and step 3 not (its record, step 2's, has
  // it): neither plans, and their lowerings' victims leave at the
  // lowering or as the prefetch makes room just before it. Step 4 follows
  // step 3's record and plans again.
  for (std::size_t step : {1u, 2u}) {
    EXPECT_EQ(shifted.ahead[step], 0u) << "step " << step + 1;
    for (TensorId t = 0; t < 4; ++t) EXPECT_GE(shifted.left_at[step][t], 2 * 4) << "tensor " << t;
  }
  EXPECT_GT(shifted.ahead[3], 0u);
  EXPECT_EQ(shifted.left_at[3][0], 1);
  EXPECT_EQ(shifted.steady.misses, 0u);
  EXPECT_EQ(shifted.steady_overruns, 0u);
}

TEST(MemoryTracer, AMarginThatLeavesNothingIsAnError) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({kFull}, kChunk), device, ChunkSchedulerOptions{});
  auto state = std::make_shared<ScriptedMeter::State>();
  EXPECT_THROW(MemoryTracer(&s, std::make_unique<ScriptedMeter>(state),
                            MemoryTracerLimits{.device_budget = kKiB, .margin = kKiB}),
               tidal::ValueError);
}

}  // namespace
}  // namespace tidal
