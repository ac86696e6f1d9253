// Gradient accumulation's fp32 sums in chunks (Note [Gradient sums in chunks]
// in cpu_adam/adam.h): folding landed 16-bit gradients into their sums,
// measuring the sums for the step, dropping them. Tensors are known here by
// the store's tensor id; ModuleHooks maps its parameter indexes to them and
// keeps the landed flags.
//
// Thread safety: none; ModuleHooks' thread rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/memory_space.h"
#include "cpu_adam/adam.h"
#include "hooks/grad_norms.h"
#include "hooks/param_binding.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {

// Note [The weights' image instead of the restore]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A fold on the host reads a chunk's landed gradients out of its 16-bit
// slots and then rounds the fp32 masters back into them (the restore), so
// the slots hold the weights for the next forward: 2 + 4 + 4 bytes per
// parameter for the sum and 4 + 2 for the restore, 16 in all (12 for a
// window's first). Gradient accumulation makes one per micro-batch; on a
// GPU whose host updates the states, that host memory traffic is the
// step's bottleneck in tidal.estimate's accumulation shapes, and the fold
// runs on the same memory as CPU Adam.
//
// But where the chunk went down with its gradients and came up for the
// forward before, the host block it came up from is often still cached,
// tagged with the chunk's write count (Note [A clean chunk goes down
// without a copy] in runtime/scheduler/chunk_scheduler.cpp): the weights
// that forward and backward read. If nothing but the gradients' landings
// wrote the chunk since (its write count then, plus what the landings
// added, is its count now) and the fold takes every gradient landed in it,
// that block holds exactly what the restore would write: the masters have
// not changed since the weights were last rounded from them (by the step,
// the last fold or a load; a write by user code between steps goes into the
// master and counts as a write: Note [Writes to a parameter] in
// module_hooks.cpp). So the fold leaves the restore out (FoldSpan::master
// null: 10 bytes per parameter, 6 for a first) and the chunk takes that
// block back as its payload (ChunkScheduler::take_back_image); the block
// that held the gradients goes to the pool, free for the next chunk's
// gradients. From the chunk's first landing on, the scheduler expects the
// image (ChunkScheduler::expect_image), and its pool hands out and frees
// every other block first (Note [Images someone still wants] in
// runtime/scheduler/chunk_scheduler.cpp). Where the block is gone by the
// time the fold's accesses are made (taken for a copy, this chunk's own
// copy down included), the pass restores as before; where it is gone by
// the fold's end or the chunk cannot change blocks (another of its slots in
// use), the fold restores from the masters then (late_restores()). Counted in
// ChunkSchedulerStats::images_taken_back. tidal.fold_images off (or
// tidal.skip_clean_copies off, or the NVMe tier): every fold restores.

// Writes the gradient landings of one 16-bit chunk made since its last fold
// (GradientSums::landing_began / landing_ended).
struct LandingWrites {
  std::uint64_t before = 0;  // the chunk's write count before the first landing
  std::uint64_t made = 0;    // what the landings added to it
};

// A fold begun on the host whose pass runs elsewhere (an update worker's job:
// Note [Folds on the worker] in python/tidal/engine/overlap.py): its slots
// in use (COMPUTE, so their chunks cannot move), the spans to fold, and what
// to wait on before reading them (copies into its chunks still running).
struct StartedFold {
  std::vector<std::size_t> params;  // ModuleHooks' indexes (set there)
  std::vector<TensorRef> refs;      // the slots in use, in access order
  std::vector<TensorState> before;  // their states before the fold
  std::vector<cpu_adam::FoldSpan> spans;
  cpu_adam::DType dtype = cpu_adam::DType::kBFloat16;
  // Note [The weights' image instead of the restore]: the 16-bit chunk that
  // takes back its image at the end (the spans' masters are null; masters
  // keeps them for a restore after all), or -1; the image's write count.
  std::int64_t image_chunk = -1;
  std::uint64_t image_version = 0;
  std::vector<const float*> masters;
  // Valid while the slots are in use; callable on any thread.
  std::vector<std::function<void()>> fences;
  // Non-null: the pass also measures the new sums, one per span (the
  // window's last fold: Note [Measured in the fold] in
  // python/tidal/engine/overlap.py); the worker's job writes them.
  std::shared_ptr<std::vector<cpu_adam::GradStats>> stats;
  bool ended = false;
  bool folded = false;  // ended with its pass run (end_fold's `folded`)
};

class GradientSums {
 public:
  // Neither is owned; set_chunks replaces them.
  GradientSums(ChunkScheduler* scheduler, ParamBinding* binding)
      : scheduler_(scheduler), binding_(binding) {}
  void set_chunks(ChunkScheduler* scheduler, ParamBinding* binding) {
    scheduler_ = scheduler;
    binding_ = binding;
    landings_.clear();
  }

  // On: gradients land unmeasured (the sums are measured: measure()).
  void set_accumulating(bool on) { accumulating_ = on; }
  bool accumulating() const { return accumulating_; }
  // Note [The weights' image instead of the restore] on (the default) or
  // off (every fold restores from the masters: for comparisons).
  void set_use_images(bool on) { use_images_ = on; }
  bool use_images() const { return use_images_; }
  // Folds that left the restore out and made it at their end after all (the
  // image gone by then, or the chunk unable to change blocks).
  std::uint64_t late_restores() const { return late_restores_; }

  // The gradients in the 16-bit slots of tensors `ids` (one chunk's; none in
  // COMPUTE) are added into their sums (written when first[i]) in `space`,
  // and the slots get their weights back from the fp32 masters: one
  // cpu_adam::fold_gradients pass over CPU-addressable memory, torch ops on a
  // GPU. At most num_threads CPU threads (0: all). Every slot ends HOLD; on an
  // error the gradients stay in their slots and new sums hold nothing.
  // whole_chunk: `ids` are every tensor of their chunk with a gradient in its
  // slot (Note [The weights' image instead of the restore] may apply).
  void fold(const std::vector<TensorId>& ids, const std::vector<bool>& first, MemorySpace space,
            int num_threads, const cpu_adam::BlockRunner* runner, bool whole_chunk = false);
  // fold() split in two for a pass on another thread: the slots of `ids`
  // (one chunk's, on the host) are accessed as fold() accesses them but
  // without waiting for copies into their chunks (Note [A pin that does not
  // wait] in runtime/scheduler/chunk_scheduler.h), and stay in use until
  // end_fold. The caller runs cpu_adam::fold_gradients(answer.dtype,
  // answer.spans) after calling every fence, then end_fold(answer, true);
  // end_fold(answer, false) where the pass did not run (the slots go back to
  // their states before). On an error nothing stays in use.
  // measure: the pass also measures the new sums (StartedFold::stats).
  StartedFold start_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                         bool whole_chunk = false, bool measure = false);
  // The slots of `fold` are released: HOLD where `folded`, as fold() leaves
  // them; otherwise as they were (a new sum FREE again). Once per fold.
  void end_fold(StartedFold& fold, bool folded);
  // Measures the sums of `ids` (parameters `params`, one each) where their
  // chunks are, into `norms`.
  void measure(const std::vector<TensorId>& ids, const std::vector<std::size_t>& params,
               GradNorms& norms);
  // The sums of `ids` are consumed (the step) or dropped: FREE, so their
  // chunks give their memory back.
  void drop(const std::vector<TensorId>& ids);

  // Note [The weights' image instead of the restore]: a gradient of tensor
  // `id` is about to land in its 16-bit slot (the chunk's write count now,
  // for landing_ended; the chunk's first since its fold makes the scheduler
  // expect its image of that count), and has landed; a landing that failed
  // part-way passes ok false, and its chunk's fold restores from the masters.
  std::uint64_t landing_began(TensorId id);
  void landing_ended(TensorId id, std::uint64_t began, bool ok);
  // The landings of `ids`' chunks are forgotten (their gradients dropped).
  void forget_landings(const std::vector<TensorId>& ids);

 private:
  // The accesses of a fold (fold's, waiting for copies into the chunks, and
  // start_fold's, not waiting: then with the chunks' fences).
  StartedFold begin_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                         MemorySpace space, bool wait_for_copies, bool whole_chunk);
  // The 16-bit chunk whose image a fold of `ids` on the host may take back
  // instead of the restore, and the image's write count; -1 if none.
  std::pair<std::int64_t, std::uint64_t> image_for(const std::vector<TensorId>& ids,
                                                   MemorySpace space, bool whole_chunk) const;
  // The landings counted for 16-bit chunk `chunk` end (and the scheduler
  // expects no image for them any more).
  void forget_landings_of(ChunkId chunk);

  ChunkScheduler* scheduler_;
  ParamBinding* binding_;
  bool accumulating_ = false;
  bool use_images_ = true;
  std::uint64_t late_restores_ = 0;
  // By 16-bit chunk id; an entry with `made` = UINT64_MAX is broken.
  std::unordered_map<ChunkId, LandingWrites> landings_;
};

}  // namespace tidal::hooks
