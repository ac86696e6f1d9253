#include "runtime/tracer/memory_tracer.h"

#include <algorithm>

#include "runtime/core/error.h"

namespace tidal {

namespace {

// A trace point's copy of the scheduler's move counters.
void take_moves(TracePoint& point, const ChunkSchedulerStats& stats) {
  point.moves_host_to_device = stats.moves_host_to_device;
  point.moves_device_to_host = stats.moves_device_to_host;
  point.evictions = stats.evictions;
}

}  // namespace

const char* to_string(PointKind kind) {
  switch (kind) {
    case PointKind::kForward: return "fwd";
    case PointKind::kBackward: return "bwd";
    case PointKind::kGrad: return "grad";
    case PointKind::kStep: return "step";
  }
  return "?";
}

MemoryTracer::MemoryTracer(ChunkScheduler* scheduler, std::unique_ptr<NonChunkMeter> meter,
                           MemoryTracerLimits limits)
    : scheduler_(scheduler), meter_(std::move(meter)), limits_(limits),
      warmup_room_(limits.warmup_room) {
  TIDAL_CHECK(scheduler_ != nullptr, "memory tracer: expected a chunk scheduler, got null");
  TIDAL_CHECK(meter_ != nullptr, "memory tracer: expected a non-chunk meter, got null");
  TIDAL_CHECK(limits_.margin < limits_.device_budget, "memory tracer: the margin of ",
              limits_.margin, " bytes leaves nothing of the device budget of ",
              limits_.device_budget, " bytes");
  meter_->restart_peak();
}

void MemoryTracer::set_scheduler(ChunkScheduler* scheduler) {
  TIDAL_CHECK(scheduler != nullptr, "memory tracer: expected a chunk scheduler, got null");
  if (enforce_) scheduler_->set_device_ceiling(nullptr);
  scheduler_ = scheduler;
  // A new scheduler counts its moves from its own start: the next step's
  // timeline counts from its counters now, not from the old one's.
  next_base_ = TracePoint{};
  take_moves(next_base_, scheduler_->stats());
  has_next_base_ = true;
  install_ceiling();
}

void MemoryTracer::set_warmup_room(std::size_t bytes) { warmup_room_ = std::min(bytes, limit()); }

std::size_t MemoryTracer::limit() const { return limits_.device_budget - limits_.margin; }

std::size_t MemoryTracer::live() { return meter_->read().first; }

void MemoryTracer::set_chunk_budget(std::size_t bytes) {
  if (bytes == scheduler_->budget(MemorySpace::kDevice)) return;
  try {
    // Note [Blocks leaving over a lowered budget] in chunk_scheduler.h.
    scheduler_->set_budget(MemorySpace::kDevice, bytes, BlockFrees::kWhenNeeded);
  } catch (const OutOfMemoryError&) {
    // Chunks in use (COMPUTE) hold more than that; the budget stays, and
    // the next access still cannot exceed it. (Not an overrun by itself:
    // point() counts those, chunks and non-chunk bytes at one moment.)
  }
}

void MemoryTracer::set_enforce(bool on) {
  enforce_ = on;
  install_ceiling();
  if (on) {
    update_nonchunk_limit();
  } else {
    meter_->clear_limit();
  }
}

// The scheduler's chunks never grow past what the non-chunk bytes live now
// leave (Note [Chunks in use and activations share one budget]).
void MemoryTracer::install_ceiling() {
  if (!enforce_) {
    scheduler_->set_device_ceiling(nullptr);
    return;
  }
  scheduler_->set_device_ceiling([this] {
    const std::size_t live = meter_->read().first;
    return room_at(live);
  });
}

MemoryTracer::~MemoryTracer() {
  if (enforce_ && scheduler_ != nullptr) scheduler_->set_device_ceiling(nullptr);
}

void MemoryTracer::update_nonchunk_limit() {
  if (!enforce_) return;
  const std::size_t held = scheduler_->stats().held_bytes[index_of(MemorySpace::kDevice)];
  meter_->set_limit(limit() > held ? limit() - held : 0, limit(), held);
}

void MemoryTracer::point(PointKind kind, std::int64_t what) {
  const auto [now, peak] = meter_->read();
  const std::size_t reserved = meter_->device_reserved_peak();
  meter_->restart_peak();
  const ChunkSchedulerStats stats = scheduler_->stats();
  const std::size_t held = stats.held_bytes[index_of(MemorySpace::kDevice)];
  if (reserved > 0) {
    // Note [Who owns a device byte]: the budget is a promise in reserved bytes.
    peak_reserved_ = std::max(peak_reserved_, reserved);
    if (reserved > limits_.device_budget) ++overruns_;
  } else if (held + now > limit()) {
    ++overruns_;  // past the budget at this moment
  }
  peak_nonchunk_ = std::max(peak_nonchunk_, peak);
  peak_total_ = std::max(peak_total_, held + peak);
  const auto k = static_cast<std::uint32_t>(recording_.size());
  recording_.push_back(peak);  // the interval that ends here
  timeline_recording_.push_back({k, kind, what, held, peak});
  timeline_recording_.back().nonchunk_now = now;
  timeline_recording_.back().moment = scheduler_->moment();
  take_moves(timeline_recording_.back(), stats);
  // Note [The warm-up budget]
  set_chunk_budget(has_trace_ ? room_after(k, now) : std::min(room_at(now), warmup_room_));
  if (has_trace_) plan_lowerings(k);
  update_nonchunk_limit();
}

std::size_t MemoryTracer::room_at(std::size_t nonchunk) const {
  return limit() > nonchunk ? limit() - nonchunk : 0;
}

std::size_t MemoryTracer::room_after(std::uint32_t k, std::size_t now) const {
  // The non-chunk bytes live now, or the last step's peak of the interval
  // that starts here, whichever is larger.
  const std::size_t next = k + 1 < trace_.size() ? trace_[k + 1] : trace_max_;
  return room_at(std::max(now, next));
}

void MemoryTracer::plan_lowerings(std::uint32_t k) {
  // The budget each later point of the last step would set now, as point()
  // sets it, from what that step recorded there, after the access it came
  // after then; only while this step has taken the same path so far. At the
  // step's point (the scheduler's next step has begun), the next step's
  // points, all of them.
  std::vector<PlannedLowering> plan;
  if (scheduler_->following_trace() && k < timeline_.size() && timeline_[k].moment == scheduler_->moment()) {
    const std::uint32_t first = timeline_[k].kind == PointKind::kStep ? 0 : k + 1;
    // (The step's point comes after the scheduler's step ended, at moment
    // -1: after the step's last access. A record longer than the trace the
    // scheduler follows, from a step it did not adopt, is planned no further.)
    const auto last = static_cast<std::int64_t>(scheduler_->trace().size()) - 1;
    plan.reserve(timeline_.size() - first);
    for (std::uint32_t j = first; j < timeline_.size(); ++j) {
      const TracePoint& p = timeline_[j];
      std::int64_t after = p.kind == PointKind::kStep ? last : p.moment;
      if (!plan.empty()) after = std::max(after, plan.back().after);
      if (after > last) break;
      plan.push_back({after, room_after(j, p.nonchunk_now)});
    }
  }
  scheduler_->plan_lowerings(std::move(plan));
}

void MemoryTracer::end_step() {
  point(PointKind::kStep, -1);
  // The step's point closes the step: its counters include the evictions the
  // point made to trim the chunks to the next interval's budget, and the next
  // step's first interval counts from here, so every move between two step
  // points is in one interval of the later step.
  take_moves(timeline_recording_.back(), scheduler_->stats());
  if (has_next_base_) {
    timeline_base_ = next_base_;  // the scheduler changed since the last step point
    has_next_base_ = false;
  } else {
    timeline_base_ = timeline_.empty() ? timeline_recording_.front() : timeline_.back();
  }
  timeline_.swap(timeline_recording_);
  timeline_recording_.clear();
  trace_.swap(recording_);
  recording_.clear();
  trace_max_ = trace_.empty() ? 0 : *std::max_element(trace_.begin(), trace_.end());
  has_trace_ = true;
}

void MemoryTracer::drop_step() {
  recording_.clear();
  timeline_recording_.clear();
}

void MemoryTracer::grow_warmup_room(std::size_t need) {
  if (has_trace_ || need <= warmup_room_) return;
  warmup_room_ = std::min(need, limit());
  const std::size_t now = live();
  const std::size_t room = room_at(now);
  const std::size_t budget = std::min(warmup_room_, room);
  if (budget > scheduler_->budget(MemorySpace::kDevice)) {
    // (A raise: blocks a lowering left stay until their room is needed.)
    scheduler_->set_budget(MemorySpace::kDevice, budget, BlockFrees::kWhenNeeded);
  }
  update_nonchunk_limit();
}

void MemoryTracer::make_room(std::size_t need) {
  need = std::min(need, limit());
  if (need > scheduler_->budget(MemorySpace::kDevice)) {
    scheduler_->set_budget(MemorySpace::kDevice, need, BlockFrees::kWhenNeeded);  // (as above)
  }
  update_nonchunk_limit();
}

}  // namespace tidal
