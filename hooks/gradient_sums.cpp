#include "hooks/gradient_sums.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <optional>

#include "runtime/core/error.h"

namespace tidal::hooks {

void GradientSums::fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                        MemorySpace space, int num_threads, const cpu_adam::BlockRunner* runner) {
  if (ids.empty()) return;
  c10::NoGradGuard no_grad;
  StartedFold fold = begin_fold(ids, first, space, /*wait_for_copies=*/true);
  try {
    if (binding_->torch_device(space).is_cpu()) {
      cpu_adam::fold_gradients(fold.dtype, fold.spans,
                               cpu_adam::ExecOptions{num_threads, cpu_adam::CopyStores::kAuto, runner});
    } else {
      const at::Device device = binding_->torch_device(space);
      const at::ScalarType half_type = binding_->dtype(ChunkKind::kParam16);
      std::vector<at::Tensor> halves;
      for (const cpu_adam::FoldSpan& span : fold.spans) {
        const std::int64_t n = static_cast<std::int64_t>(span.count);
        const at::Tensor half = slot_view(span.half, {n}, half_type, device);
        const at::Tensor sum = slot_view(span.sum, {n}, at::kFloat, device);
        if (span.first) {
          sum.copy_(half);
        } else {
          sum.add_(half);
        }
        halves.push_back(half);
      }
      for (std::size_t k = 0; k < fold.spans.size(); ++k) {
        const std::int64_t n = static_cast<std::int64_t>(fold.spans[k].count);
        halves[k].copy_(slot_view(const_cast<float*>(fold.spans[k].master), {n}, at::kFloat, device));
      }
    }
  } catch (...) {
    // A gradient that was in its slot stays there (HOLD_AFTER_BWD cannot be
    // re-entered; the engine still counts it as landed and restores it).
    end_fold(fold, false);
    throw;
  }
  end_fold(fold, true);
}

StartedFold GradientSums::start_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first) {
  TIDAL_INTERNAL_ASSERT(binding_->torch_device(MemorySpace::kHost).is_cpu(),
                        "GradientSums::start_fold: the host is not CPU memory");
  return begin_fold(ids, first, MemorySpace::kHost, /*wait_for_copies=*/false);
}

StartedFold GradientSums::begin_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                                     MemorySpace space, bool wait_for_copies) {
  TIDAL_INTERNAL_ASSERT(first.size() == ids.size(), "GradientSums: ", first.size(),
                        " first flags for ", ids.size(), " tensors to fold");
  const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(binding_->dtype(ChunkKind::kParam16));
  TIDAL_INTERNAL_ASSERT(dtype.has_value(), "a 16-bit chunk list of another dtype");
  constexpr ChunkKind kKinds[3] = {ChunkKind::kParam16, ChunkKind::kParam32, ChunkKind::kGradAccum};
  StartedFold fold;
  fold.dtype = *dtype;
  fold.refs.reserve(3 * ids.size());
  fold.before.reserve(3 * ids.size());
  try {
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::size_t numel = scheduler_->store().tensor_numel(ids[k]);
      void* data[3];
      for (int j = 0; j < 3; ++j) {
        const TensorRef ref{kKinds[j], ids[k]};
        const TensorState before = scheduler_->store().state(ref);
        data[j] = scheduler_->access(ref, space, AccessMode::kWrite, wait_for_copies);
        fold.refs.push_back(ref);
        fold.before.push_back(before);
      }
      fold.spans.push_back({static_cast<float*>(data[2]), data[0], static_cast<const float*>(data[1]),
                            numel, static_cast<bool>(first[k])});
    }
    if (!wait_for_copies) {
      // Each chunk's fence once (the three chunks of the fold's chunk, in
      // the usual case of one chunk's tensors).
      std::vector<ChunkId> fenced;
      for (const TensorRef& ref : fold.refs) {
        const ChunkId chunk = scheduler_->store().chunk_of(ref);
        if (std::find(fenced.begin(), fenced.end(), chunk) != fenced.end()) continue;
        fenced.push_back(chunk);
        if (const Event* fence = scheduler_->copy_fence(chunk)) {
          fold.fences.push_back([fence] { fence->synchronize(); });
        }
      }
    }
  } catch (...) {
    end_fold(fold, false);
    throw;
  }
  return fold;
}

void GradientSums::end_fold(StartedFold& fold, bool folded) {
  TIDAL_INTERNAL_ASSERT(!fold.ended, "GradientSums::end_fold: this fold has ended");
  fold.ended = true;
  fold.fences.clear();
  if (folded) {
    for (const TensorRef& ref : fold.refs) scheduler_->release(ref, TensorState::kHold);
    return;
  }
  // The pass did not run: the gradient stays in its slot, the master is
  // unchanged, a sum written for the first time holds nothing.
  for (std::size_t i = 0; i < fold.refs.size(); ++i) {
    try {
      scheduler_->release(fold.refs[i], fold.before[i] == TensorState::kFree ? TensorState::kFree
                                                                             : TensorState::kHold);
    } catch (...) {
    }
  }
}

void GradientSums::measure(const std::vector<TensorId>& ids, const std::vector<std::size_t>& params,
                           GradNorms& norms) {
  TIDAL_INTERNAL_ASSERT(params.size() == ids.size(), "GradientSums::measure: ", params.size(),
                        " parameter indexes for ", ids.size(), " tensors");
  c10::NoGradGuard no_grad;
  for (std::size_t k = 0; k < ids.size(); ++k) {
    const TensorId id = ids[k];
    const TensorRef ref{ChunkKind::kGradAccum, id};
    const ChunkId chunk = scheduler_->store().chunk_of(ref);
    const MemorySpace space = scheduler_->store().chunk(chunk).space();
    TIDAL_CHECK(holds_data(scheduler_->store().state(ref)), "measure_sums: parameter '",
                scheduler_->store().tensor_name(id), "' has no gradient sum");
    const std::int64_t n = static_cast<std::int64_t>(scheduler_->store().tensor_numel(id));
    void* data = scheduler_->access(ref, space);
    try {
      norms.measure(params[k], slot_view(data, {n}, at::kFloat, binding_->torch_device(space)));
    } catch (...) {
      scheduler_->release(ref, TensorState::kHold);
      throw;
    }
    scheduler_->release(ref, TensorState::kHold);
  }
}

void GradientSums::drop(const std::vector<TensorId>& ids) {
  for (const TensorId id : ids) {
    scheduler_->set_state(TensorRef{ChunkKind::kGradAccum, id}, TensorState::kFree);
  }
}

}  // namespace tidal::hooks
