#include "hooks/gradient_sums.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <optional>

#include "runtime/core/error.h"

namespace tidal::hooks {

void GradientSums::fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                        MemorySpace space, int num_threads, const cpu_adam::BlockRunner* runner) {
  TIDAL_INTERNAL_ASSERT(first.size() == ids.size(), "GradientSums::fold: ", first.size(),
                        " first flags for ", ids.size(), " tensors");
  if (ids.empty()) return;
  c10::NoGradGuard no_grad;
  constexpr ChunkKind kKinds[3] = {ChunkKind::kParam16, ChunkKind::kParam32, ChunkKind::kGradAccum};
  // The states to go back to on an error: the gradient stays in its slot, the
  // master is unchanged, a sum written for the first time holds nothing.
  struct Held {
    TensorRef ref;
    TensorState before;
  };
  std::vector<Held> held;
  held.reserve(3 * ids.size());
  const bool host_memory = binding_->torch_device(space).is_cpu();
  std::vector<cpu_adam::FoldSpan> spans;
  std::vector<at::Tensor> halves, masters, sums;
  try {
    for (std::size_t k = 0; k < ids.size(); ++k) {
      const std::size_t numel = scheduler_->store().tensor_numel(ids[k]);
      void* data[3];
      for (int j = 0; j < 3; ++j) {
        const TensorRef ref{kKinds[j], ids[k]};
        const TensorState before = scheduler_->store().state(ref);
        data[j] = scheduler_->access(ref, space);
        held.push_back({ref, before});
      }
      if (host_memory) {
        spans.push_back({static_cast<float*>(data[2]), data[0], static_cast<const float*>(data[1]),
                         numel, static_cast<bool>(first[k])});
      } else {
        const std::int64_t n = static_cast<std::int64_t>(numel);
        const at::Device device = binding_->torch_device(space);
        halves.push_back(slot_view(data[0], {n}, binding_->dtype(ChunkKind::kParam16), device));
        masters.push_back(slot_view(data[1], {n}, at::kFloat, device));
        sums.push_back(slot_view(data[2], {n}, at::kFloat, device));
      }
    }
    if (host_memory) {
      const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(binding_->dtype(ChunkKind::kParam16));
      TIDAL_INTERNAL_ASSERT(dtype.has_value(), "a 16-bit chunk list of another dtype");
      cpu_adam::fold_gradients(*dtype, spans,
                               cpu_adam::ExecOptions{num_threads, cpu_adam::CopyStores::kAuto, runner});
    } else {
      for (std::size_t k = 0; k < ids.size(); ++k) {
        if (first[k]) {
          sums[k].copy_(halves[k]);
        } else {
          sums[k].add_(halves[k]);
        }
      }
      for (std::size_t k = 0; k < ids.size(); ++k) halves[k].copy_(masters[k]);
    }
  } catch (...) {
    for (const Held& h : held) {
      try {
        scheduler_->release(h.ref, h.before == TensorState::kFree ? TensorState::kFree
                                                                  : TensorState::kHold);
      } catch (...) {
      }
    }
    // A gradient that was in its slot stays there (HOLD_AFTER_BWD cannot be
    // re-entered; the engine still counts it as landed and restores it).
    throw;
  }
  for (const Held& h : held) scheduler_->release(h.ref, TensorState::kHold);
}

StartedFold GradientSums::start_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first) {
  TIDAL_INTERNAL_ASSERT(first.size() == ids.size(), "GradientSums::start_fold: ", first.size(),
                        " first flags for ", ids.size(), " tensors");
  TIDAL_INTERNAL_ASSERT(binding_->torch_device(MemorySpace::kHost).is_cpu(),
                        "GradientSums::start_fold: the host is not CPU memory");
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
        data[j] = scheduler_->access(ref, MemorySpace::kHost, AccessMode::kWrite,
                                     /*wait_for_copy=*/false);
        fold.refs.push_back(ref);
        fold.before.push_back(before);
      }
      fold.spans.push_back({static_cast<float*>(data[2]), data[0], static_cast<const float*>(data[1]),
                            numel, static_cast<bool>(first[k])});
    }
    // Each chunk's fence once (the three chunks of the fold's chunk, in the
    // usual case of one chunk's tensors).
    std::vector<ChunkId> fenced;
    for (const TensorRef& ref : fold.refs) {
      const ChunkId chunk = scheduler_->store().chunk_of(ref);
      if (std::find(fenced.begin(), fenced.end(), chunk) != fenced.end()) continue;
      fenced.push_back(chunk);
      if (const Event* fence = scheduler_->copy_fence(chunk)) {
        fold.fences.push_back([fence] { fence->synchronize(); });
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
