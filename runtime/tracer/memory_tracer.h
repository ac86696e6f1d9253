// The engine's memory tracer and device-budget arbiter: at every hook (a
// trace point) it measures non-chunk device memory, records the interval's
// peak, and gives the chunk scheduler the device budget for the interval
// that starts there. One call per trace point; libtorch-free, so GoogleTest
// drives it on the simulated device with a scripted meter
// (tests/cpp/runtime/tracer/memory_tracer_test.cpp). The layer above the
// scheduler, below hooks/ (Note [The build's layers] in
// tests/cpp/check_layers.py), in namespace tidal beside the scheduler.
//
// Note [The memory tracer]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// N is non-chunk device memory (activations and every other torch tensor);
// a NonChunkMeter reads it and its peak since the previous point (the
// engine's meters: torch's CUDA caching allocator less the chunk blocks it
// holds for tidal, torch's reserved bytes where tidal's chunk blocks come
// from cudaMalloc, or torch's CPU allocations on the simulated device; see
// python/tidal/engine/engine.py). The first step (the warm-up) records the
// peak of every interval between two points; from then on, at point k the
// chunk budget is
//     device budget - margin - max(N now, recorded peak of interval k+1),
// so chunks give way before activations need the room, and OPT eviction
// plus prefetch follow the scheduler's own trace. While a step has more
// points than the recorded trace (the model's path changed) the budget uses
// the largest recorded peak; the step's own record replaces the trace at its
// end. A failed step's partial record is dropped; the trace stays.
//
// Note [The warm-up budget]
// ~~~~~~~~~~~~~~~~~~~~~~~~~
// In the warm-up step nothing says how far activations will grow after a
// point, so a budget from the live measurement alone lets chunks fill room
// the next interval's activations need, and the step's peak (chunks +
// non-chunk memory at the same moment) passes the device budget. As
// PatrickStar (warmup_gpu_chunk_mem_ratio) and Gemini (a non-model-data
// ratio during warm-up) do, chunks get a conservative share until the trace
// is known: at most tidal.warmup_chunk_share (default 0.2) of the budget less
// the margin, and never less than the largest module needs at once; when the
// parameters attached together need more (tied and shared parameters stay
// attached through backward), the engine grows the cap to that before the
// attach (grow_warmup_room). Only the first step is capped.
//
// Note [Chunks in use and activations share one budget]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The promise: at every moment, chunk bytes on the device + non-chunk bytes
// <= limit() (the device budget less the margin). The tracer's budget plans
// the chunks within it everywhere; what refuses an allocation that would
// break it depends on the backend:
//  * the simulated device, while the engine's forward and backward run
//    (set_enforce(true)): the tracer holds each side to what the other
//    leaves. Chunks: the scheduler's device ceiling is limit() less the
//    non-chunk bytes live now (install_ceiling), so chunks, prefetched ones
//    included, never grow into room that activations hold. Non-chunk bytes:
//    the meter's limit is limit() less the chunk bytes on the device
//    (update_nonchunk_limit, after every attach, detach and landing), so an
//    allocation past it first makes room (chunks not in use leave, or under
//    DTR with a known link the arbiter's choice: an activation) and else
//    fails as torch.OutOfMemoryError (Note [The simulated device's budget is
//    a hard limit] in hooks/host_allocation_counter.h);
//  * a GPU whose chunk blocks come from torch's caching allocator: the
//    tracer enforces nothing (its meter cannot refuse); torch's per-process
//    cap, set at the whole budget while the engine lives, refuses in
//    reserved bytes, and a cache miss past it first makes room the same way
//    (Note [Room on a cache miss] in hooks/cuda_room.h);
//  * a GPU whose chunk blocks come from cudaMalloc: nothing refuses short
//    of the card's memory; the budget only plans, and point() counts the
//    moments past it (overruns()).
// On every backend, wherever the chunk room grows for the parameters a
// module needs (the warm-up step, or DTR under the engine),
// DeviceRoom::reserve_for_chunks first asks activations to give way (DTR
// evicts one at a time); where they cannot, the attach fails with an
// OutOfMemoryError naming both sides rather than plan past the budget.
// Where the meter knows the bytes the device's allocator reserves (torch's on
// a GPU, the caching allocator model's on the simulated device), the promise
// is kept in those bytes against the whole budget instead, the margin being
// the allocator's room, and a request past it first makes room on the
// allocator's miss (Note [Who owns a device byte] in
// runtime/memory/caching_allocator_model.h); the meter's live bytes are then
// what the allocator cannot give back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal {

// Where a trace point is: a module's forward pre-hook, its backward
// pre-hook, a parameter's gradient hook, or the end of a step.
enum class PointKind : std::uint8_t { kForward = 0, kBackward = 1, kGrad = 2, kStep = 3 };

const char* to_string(PointKind kind);

// Non-chunk device memory as the tracer sees it.
class NonChunkMeter {
 public:
  virtual ~NonChunkMeter() = default;
  // (bytes now, peak since the last restart_peak()), both at least 0.
  virtual std::pair<std::size_t, std::size_t> read() = 0;
  virtual void restart_peak() = 0;
  // The non-chunk bytes allowed from now on (Note [The simulated device's
  // budget is a hard limit] in hooks/host_allocation_counter.h), with the
  // numbers for its error message; a meter that cannot enforce ignores it.
  virtual void set_limit(std::size_t /*bytes*/, std::size_t /*budget*/, std::size_t /*chunk_bytes*/) {}
  virtual void clear_limit() {}
  // The whole device use (chunks + non-chunk bytes) at its worst moment, when
  // the meter sees it (the limited host counter does); else 0.
  virtual std::size_t device_peak() { return 0; }
  // What the device held at its worst moment since the last restart_peak(),
  // as its allocator holds it: chunk blocks, tensors and the allocator's
  // cached bytes (torch's reserved bytes on a GPU; the caching allocator
  // model's on the simulated device with tidal.simulated_allocator on). 0 when
  // the meter does not know (Note [Who owns a device byte] in
  // runtime/memory/caching_allocator_model.h).
  virtual std::size_t device_reserved_peak() { return 0; }
};

// One trace point of a step, for the memory profile.
struct TracePoint {
  std::uint32_t index = 0;         // position in its step
  PointKind kind = PointKind::kStep;
  std::int64_t what = -1;          // the engine's module index or tensor id; -1: none
  std::size_t chunk_bytes = 0;     // device chunk bytes held at the point
  std::size_t nonchunk_peak = 0;   // non-chunk peak of the interval ending here
  std::size_t nonchunk_now = 0;    // non-chunk bytes live at the point
  std::int64_t moment = -1;        // the scheduler's moment at the point (its latest access)
  std::uint64_t moves_host_to_device = 0;  // scheduler counters at the point
  std::uint64_t moves_device_to_host = 0;
  std::uint64_t evictions = 0;
};

struct MemoryTracerLimits {
  std::size_t device_budget = 0;   // chunks and everything else
  std::size_t margin = 0;          // kept free
  std::size_t warmup_room = 0;     // the warm-up cap on chunk bytes (Note [The warm-up budget])
};

class MemoryTracer {
 public:
  // `scheduler` is not owned and must outlive the tracer or be replaced
  // (set_scheduler) first. Restarts the meter's peak.
  MemoryTracer(ChunkScheduler* scheduler, std::unique_ptr<NonChunkMeter> meter,
               MemoryTracerLimits limits);
  ~MemoryTracer();
  MemoryTracer(const MemoryTracer&) = delete;
  MemoryTracer& operator=(const MemoryTracer&) = delete;

  // The engine rebuilt its chunks (first-use relayout): the new scheduler.
  void set_scheduler(ChunkScheduler* scheduler);
  void set_warmup_room(std::size_t bytes);

  // A trace point: measure, record the interval that ends here, set the
  // chunk budget for the interval that starts here (Note [The memory
  // tracer]). A budget the chunks in use (COMPUTE) already exceed is left as
  // it is (the scheduler waits or fails rather than grow). The point counts
  // an overrun (overruns()) when its interval passed the budget: where the
  // meter knows the device's reserved bytes, when their peak since the last
  // point passed the whole device budget; else when the chunk bytes held and
  // the non-chunk bytes live now pass the budget less the margin.
  void point(PointKind kind, std::int64_t what);
  // The step's last point; its record becomes the trace.
  void end_step();
  // After a failed forward or backward: the step's partial record goes, the
  // adopted trace stays.
  void drop_step();

  // Warm-up only: the cap grows to `need` chunk bytes (what the parameters
  // in use plus those being attached need at once), and the budget follows
  // within what non-chunk memory leaves now. No-op once a trace is known.
  void grow_warmup_room(std::size_t need);
  // DTR under the engine: activations give way, so the chunk budget rises to
  // `need` (capped by the budget less the margin) whenever it is below.
  void make_room(std::size_t need);

  // Chunks plus every other byte the meter sees stay within the budget less
  // the margin: the meter's limit follows the chunk bytes on the device.
  // Call after chunk bytes on the device changed (ModuleHooks does, at every
  // attach, detach and landing: DeviceRoom::chunks_moved). On: every point
  // and room change too.
  void set_enforce(bool on);
  void update_nonchunk_limit();

  // Non-chunk bytes now (for error messages); does not restart the peak.
  std::size_t live();
  std::size_t limit() const;  // device budget - margin
  bool warmed_up() const { return has_trace_; }
  std::size_t warmup_room() const { return warmup_room_; }
  std::size_t peak_nonchunk() const { return peak_nonchunk_; }
  // Chunks + non-chunk bytes at one moment where the meter knows it (the
  // simulated device with the budget enforced), else the largest sum of a
  // point's chunk bytes and its interval's non-chunk peak (an upper bound).
  std::size_t peak_total() const {
    const std::size_t exact = meter_->device_peak();
    return exact > 0 ? exact : peak_total_;
  }
  // Trace points whose interval passed the budget: where the meter knows the
  // reserved bytes, the device's reserved peak past the device budget (the
  // cap torch or the model enforces); else chunks and non-chunk bytes live at
  // the point past the budget less the margin.
  std::uint64_t overruns() const { return overruns_; }
  // The largest device_reserved_peak() seen (0 where the meter does not know).
  std::size_t peak_reserved() const { return peak_reserved_; }
  const std::vector<std::size_t>& trace() const { return trace_; }
  // The trace points of the last completed step.
  const std::vector<TracePoint>& timeline() const { return timeline_; }
  // The point its first interval counts from: the previous step's last point
  // (the first step's own first point; after set_scheduler, the new
  // scheduler's counters then). Its counters only are meaningful.
  const TracePoint& timeline_base() const { return timeline_base_; }

 private:
  void set_chunk_budget(std::size_t bytes);
  // The chunk room beside `nonchunk` bytes (the limit less them, or 0), and
  // the room point k sets with `now` bytes live (Note [The memory tracer]).
  std::size_t room_at(std::size_t nonchunk) const;
  std::size_t room_after(std::uint32_t k, std::size_t now) const;
  // At point k of a step that repeats the last: tells the scheduler the
  // budgets the points after it will set (Note [Chunks leave ahead of a
  // lowering] in runtime/scheduler/chunk_scheduler.h).
  void plan_lowerings(std::uint32_t k);
  void install_ceiling();

  ChunkScheduler* scheduler_;
  std::unique_ptr<NonChunkMeter> meter_;
  MemoryTracerLimits limits_;
  std::size_t warmup_room_;
  bool has_trace_ = false;
  std::vector<std::size_t> trace_;       // interval peaks of the adopted trace
  std::size_t trace_max_ = 0;
  std::vector<std::size_t> recording_;   // this step's, so far
  std::vector<TracePoint> timeline_;
  std::vector<TracePoint> timeline_recording_;
  TracePoint timeline_base_;
  TracePoint next_base_;  // set_scheduler: where the next step's timeline counts from
  bool has_next_base_ = false;
  std::size_t peak_nonchunk_ = 0;
  std::size_t peak_total_ = 0;
  std::uint64_t overruns_ = 0;
  std::size_t peak_reserved_ = 0;
  bool enforce_ = false;
};

}  // namespace tidal
