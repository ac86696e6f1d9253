// Gradient accumulation's fp32 sums in chunks (Note [Gradient sums in chunks]
// in cpu_adam/adam.h): folding landed 16-bit gradients into their sums,
// measuring the sums for the step, dropping them. Tensors are known here by
// the store's tensor id; ModuleHooks maps its parameter indexes to them and
// keeps the landed flags.
//
// Thread safety: none; ModuleHooks' thread rules.
#pragma once

#include <cstddef>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/memory_space.h"
#include "cpu_adam/adam.h"
#include "hooks/grad_norms.h"
#include "hooks/param_binding.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {

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
  // Measures the sums of `ids` (parameters `params`, one each) where their
  // chunks are, into `norms`.
  void measure(const std::vector<TensorId>& ids, const std::vector<std::size_t>& params,
               GradNorms& norms);
  // The sums of `ids` are consumed (the step) or dropped: FREE, so their
  // chunks give their memory back.
  void drop(const std::vector<TensorId>& ids);

 private:
  ChunkScheduler* scheduler_;
  ParamBinding* binding_;
  bool accumulating_ = false;
};

}  // namespace tidal::hooks
