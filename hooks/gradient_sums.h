// Gradient accumulation's fp32 sums in chunks (Note [Gradient sums in chunks]
// in cpu_adam/adam.h): folding landed 16-bit gradients into their sums,
// measuring the sums for the step, dropping them. Tensors are known here by
// the store's tensor id; ModuleHooks maps its parameter indexes to them and
// keeps the landed flags.
//
// Thread safety: none; ModuleHooks' thread rules.
#pragma once

#include <cstddef>
#include <functional>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/memory_space.h"
#include "cpu_adam/adam.h"
#include "hooks/grad_norms.h"
#include "hooks/param_binding.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {

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
  // Valid while the slots are in use; callable on any thread.
  std::vector<std::function<void()>> fences;
  bool ended = false;
};

class GradientSums {
 public:
  // Neither is owned; set_chunks replaces them.
  GradientSums(ChunkScheduler* scheduler, ParamBinding* binding)
      : scheduler_(scheduler), binding_(binding) {}
  void set_chunks(ChunkScheduler* scheduler, ParamBinding* binding) {
    scheduler_ = scheduler;
    binding_ = binding;
  }

  // On: gradients land unmeasured (the sums are measured: measure()).
  void set_accumulating(bool on) { accumulating_ = on; }
  bool accumulating() const { return accumulating_; }

  // The gradients in the 16-bit slots of tensors `ids` (one chunk's; none in
  // COMPUTE) are added into their sums (written when first[i]) in `space`,
  // and the slots get their weights back from the fp32 masters: one
  // cpu_adam::fold_gradients pass over CPU-addressable memory, torch ops on a
  // GPU. At most num_threads CPU threads (0: all). Every slot ends HOLD; on an
  // error the gradients stay in their slots and new sums hold nothing.
  void fold(const std::vector<TensorId>& ids, const std::vector<bool>& first, MemorySpace space,
            int num_threads, const cpu_adam::BlockRunner* runner);
  // fold() split in two for a pass on another thread: the slots of `ids`
  // (one chunk's, on the host) are accessed as fold() accesses them but
  // without waiting for copies into their chunks (Note [A pin that does not
  // wait] in runtime/scheduler/chunk_scheduler.h), and stay in use until
  // end_fold. The caller runs cpu_adam::fold_gradients(answer.dtype,
  // answer.spans) after calling every fence, then end_fold(answer, true);
  // end_fold(answer, false) where the pass did not run (the slots go back to
  // their states before). On an error nothing stays in use.
  StartedFold start_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first);
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

 private:
  // The accesses of a fold (fold's, waiting for copies into the chunks, and
  // start_fold's, not waiting: then with the chunks' fences).
  StartedFold begin_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                         MemorySpace space, bool wait_for_copies);

  ChunkScheduler* scheduler_;
  ParamBinding* binding_;
  bool accumulating_ = false;
};

}  // namespace tidal::hooks
