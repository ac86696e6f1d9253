// A thread that runs chunk updates (CPU Adam) off the caller's thread, one
// after another in the order they were submitted.
//
// Note [The worker without the GIL]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The engine's updates that run beside compute (Notes [CPU Adam during
// backward] and [CPU Adam under the next forward] in
// python/tidal/engine/overlap.py) ran on a Python thread
// (concurrent.futures): each job needed the GIL to start, between its calls
// and to finish, while the thread that drives compute (backward's landings,
// the step's hand-offs, the next forward's hooks; on a GPU every kernel
// launch) holds it most of the time and lets it go only when it blocks or
// after the interpreter's switch interval (5 ms). With the clip firing every
// step (benchmarks/step_overlap_clip.py, clip_all, vocab 2048, 2 cores) the
// first update the step left to the next forward started about 1.7 ms after
// the step handed it over, and the forward waited for it: 2-3 ms of the
// 4.3 ms of CPU Adam exposed per step. Here a job is a plain struct run by a
// C++ thread that never takes the GIL: the copies into the chunk waited for
// (`fences`), the undo copy of a speculative update (`undo`), then one
// adam_chunk_step per parameter group (`calls`). The caller keeps every
// buffer a job points into alive and in place (the chunks pinned) until the
// job's ticket is done.
//
// Note [A waiter runs the job itself]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A thread that must wait for a job (the next forward at its first module,
// the step for the updates launched during backward) is idle until it is
// done, and the worker may not have started it: busy with the jobs before
// it, or not yet woken. On 2 cores with torch's OpenMP thread spinning after
// backward, the worker woke about 2 ms after the step handed it the first
// chunk, by which time the next forward had reached that chunk and waited:
// most of the CPU Adam exposed per step with the clip firing every step
// (benchmarks/step_overlap_clip.py, clip_all). So run_or_wait takes a job
// the worker has not started out of the queue and runs it on the waiting
// thread, beside whatever the worker runs. The update is elementwise: the
// same bits on any thread. Not where a job before it in the queue, or the
// one running, updates the same chunk: those run first, in order.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "cpu_adam/adam.h"

namespace tidal::cpu_adam {

// One adam_chunk_step of a job: one parameter group's ranges of the chunk.
struct ChunkCall {
  AdamHyperParams hyper;
  std::vector<ChunkRange> ranges;
  AdamStepOptions options;
};

struct UpdateJob {
  // Waited for first, in order, on the worker (a copy into the chunk still
  // running: Note [A pin that does not wait] in runtime/scheduler).
  std::vector<std::function<void()>> fences;
  // Then folded (fold_gradients(fold_dtype, folds, exec)): a micro-batch's
  // gradients into their sums (Note [Folds on the worker] in
  // python/tidal/engine/overlap.py); a job may be only this.
  std::vector<FoldSpan> folds;
  DType fold_dtype = DType::kBFloat16;
  // Non-null: the fold also measures its new sums, one GradStats per span,
  // into it (fold_gradients' stats); read it once the ticket is done.
  std::shared_ptr<std::vector<GradStats>> fold_stats;
  // Then copied (copy_spans): a speculative update's undo copy. A failure
  // here leaves the chunk untouched (UpdateTicket::undo_failed).
  std::vector<CopySpan> undo;
  // Then adam_chunk_step(call.hyper, chunk, call.ranges, call.options, exec)
  // for each call. chunk.param also names the job's chunk for run_or_wait
  // (a fold-only job: its first span's master).
  AdamChunk chunk;
  std::vector<ChunkCall> calls;
  ExecOptions exec;
};

// Seconds on std::chrono::steady_clock (CLOCK_MONOTONIC on Linux, the clock
// of Python's time.perf_counter()).
struct UpdateTimes {
  double fenced_from = 0.0;  // the job began (its fences' wait)
  double started = 0.0;      // the fences passed: the undo copy and the update began
  double ended = 0.0;
};

// A submitted job's state; any thread may read it.
class UpdateTicket {
 public:
  bool done() const;
  // Blocks until done().
  void wait() const;
  // Valid once done().
  UpdateTimes times() const;
  // The exception the job threw (null: it ran to the end); valid once done().
  std::exception_ptr error() const;
  // The job failed before updating anything (a fence or the undo copy).
  bool undo_failed() const;

 private:
  friend class UpdateWorker;
  void finish(const UpdateTimes& times, std::exception_ptr error, bool undo_failed);

  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  bool done_ = false;
  UpdateTimes times_;
  std::exception_ptr error_;
  bool undo_failed_ = false;
};

class UpdateWorker {
 public:
  // on_start runs first on the worker's thread (the engine's: Note [tidal's
  // own host allocations] in runtime/core/uncounted.h).
  explicit UpdateWorker(std::function<void()> on_start = {});
  // Runs every job submitted, then joins the thread.
  ~UpdateWorker();
  UpdateWorker(const UpdateWorker&) = delete;
  UpdateWorker& operator=(const UpdateWorker&) = delete;

  std::shared_ptr<const UpdateTicket> submit(UpdateJob job);

  // Blocks until `ticket`'s job is done, running it on the calling thread
  // when the worker has not started it and no job before it in the queue,
  // nor the one the worker runs, updates the same chunk (Note [A waiter runs
  // the job itself]). True: it ran here. `ticket` must be one of this
  // worker's.
  bool run_or_wait(const UpdateTicket& ticket);

 private:
  using Item = std::pair<UpdateJob, std::shared_ptr<UpdateTicket>>;
  static void run(Item& item);
  void loop(const std::function<void()>& on_start);

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Item> queue_;
  // The chunk (its master's address) of the job the worker runs; null: none.
  const float* running_ = nullptr;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace tidal::cpu_adam
