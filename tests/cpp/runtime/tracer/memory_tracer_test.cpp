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
