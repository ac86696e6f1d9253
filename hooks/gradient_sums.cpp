#include "hooks/gradient_sums.h"

#include <c10/core/GradMode.h>

#include <algorithm>
#include <optional>
#include <tuple>

#include "runtime/core/error.h"

namespace tidal::hooks {

namespace {

constexpr std::uint64_t kBroken = ~std::uint64_t{0};

}  // namespace

void GradientSums::fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                        MemorySpace space, int num_threads, const cpu_adam::BlockRunner* runner,
                        bool whole_chunk) {
  if (ids.empty()) return;
  c10::NoGradGuard no_grad;
  StartedFold fold = begin_fold(ids, first, space, /*wait_for_copies=*/true, whole_chunk);
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

StartedFold GradientSums::start_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                                     bool whole_chunk, bool measure) {
  TIDAL_INTERNAL_ASSERT(binding_->torch_device(MemorySpace::kHost).is_cpu(),
                        "GradientSums::start_fold: the host is not CPU memory");
  StartedFold fold = begin_fold(ids, first, MemorySpace::kHost, /*wait_for_copies=*/false, whole_chunk);
  if (measure) fold.stats = std::make_shared<std::vector<cpu_adam::GradStats>>();
  return fold;
}

std::pair<std::int64_t, std::uint64_t> GradientSums::image_for(const std::vector<TensorId>& ids,
                                                               MemorySpace space,
                                                               bool whole_chunk) const {
  constexpr std::pair<std::int64_t, std::uint64_t> kNone{-1, 0};
  if (!use_images_ || !whole_chunk || ids.empty() || space != MemorySpace::kHost) return kNone;
  const ChunkStore& store = scheduler_->store();
  const ChunkId chunk = store.chunk_of(TensorRef{ChunkKind::kParam16, ids[0]});
  for (const TensorId id : ids) {
    if (store.chunk_of(TensorRef{ChunkKind::kParam16, id}) != chunk) return kNone;
  }
  const auto it = landings_.find(chunk);
  if (it == landings_.end() || it->second.made == kBroken) return kNone;
  const LandingWrites& w = it->second;
  // Nothing but the landings wrote the chunk since the block was its bytes.
  if (scheduler_->write_count(chunk) != w.before + w.made) return kNone;
  if (!scheduler_->image_cached(chunk, w.before)) return kNone;
  return {static_cast<std::int64_t>(chunk), w.before};
}

StartedFold GradientSums::begin_fold(const std::vector<TensorId>& ids, const std::vector<bool>& first,
                                     MemorySpace space, bool wait_for_copies, bool whole_chunk) {
  TIDAL_INTERNAL_ASSERT(first.size() == ids.size(), "GradientSums: ", first.size(),
                        " first flags for ", ids.size(), " tensors to fold");
  const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(binding_->dtype(ChunkKind::kParam16));
  TIDAL_INTERNAL_ASSERT(dtype.has_value(), "a 16-bit chunk list of another dtype");
  constexpr ChunkKind kKinds[3] = {ChunkKind::kParam16, ChunkKind::kParam32, ChunkKind::kGradAccum};
  StartedFold fold;
  fold.dtype = *dtype;
  // (Before the fold's own accesses, which count as writes.)
  std::tie(fold.image_chunk, fold.image_version) = image_for(ids, space, whole_chunk);
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
      const auto* master = static_cast<const float*>(data[1]);
      fold.masters.push_back(master);
      fold.spans.push_back({static_cast<float*>(data[2]), data[0], fold.image_chunk >= 0 ? nullptr : master,
                            numel, static_cast<bool>(first[k])});
    }
    if (fold.image_chunk >= 0 &&
        !scheduler_->image_cached(static_cast<ChunkId>(fold.image_chunk), fold.image_version)) {
      // The accesses took the image (the chunk's copy down, into a block
      // when no other was free): the pass restores after all.
      fold.image_chunk = -1;
      for (std::size_t k = 0; k < fold.spans.size(); ++k) fold.spans[k].master = fold.masters[k];
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
  fold.folded = folded;
  fold.fences.clear();
  // The landings counted for these chunks end here, folded or not (the
  // fold's accesses count as writes).
  for (const TensorRef& ref : fold.refs) {
    if (ref.kind == ChunkKind::kParam16) forget_landings_of(scheduler_->store().chunk_of(ref));
  }
  if (folded) {
    // Note [The weights' image instead of the restore].
    const auto chunk = static_cast<ChunkId>(fold.image_chunk);
    std::size_t param16 = 0;  // the fold's 16-bit slots (all of one chunk's, in use)
    for (const TensorRef& ref : fold.refs) param16 += ref.kind == ChunkKind::kParam16;
    bool take_back = false;
    if (fold.image_chunk >= 0) {
      take_back = scheduler_->image_cached(chunk, fold.image_version) &&
                  scheduler_->store().chunk(chunk).count(TensorState::kCompute) == param16;
      if (!take_back) {
        // The restore the pass left out, from the masters.
        ++late_restores_;
        c10::NoGradGuard no_grad;
        const at::ScalarType half_type = binding_->dtype(ChunkKind::kParam16);
        for (std::size_t k = 0; k < fold.spans.size(); ++k) {
          const std::int64_t n = static_cast<std::int64_t>(fold.spans[k].count);
          slot_view(fold.spans[k].half, {n}, half_type, at::kCPU)
              .copy_(slot_view(const_cast<float*>(fold.masters[k]), {n}, at::kFloat, at::kCPU));
        }
      }
    }
    // The chunk's last slot released takes the image back, before a
    // prefetch could send the gradients up as weights.
    for (const TensorRef& ref : fold.refs) {
      if (take_back && ref.kind == ChunkKind::kParam16 && --param16 == 0) {
        const bool taken = scheduler_->release_taking_image(ref, TensorState::kHold, fold.image_version);
        TIDAL_INTERNAL_ASSERT(taken, "GradientSums::end_fold: chunk ", chunk, " did not take its image back");
      } else {
        scheduler_->release(ref, TensorState::kHold);
      }
    }
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

std::uint64_t GradientSums::landing_began(TensorId id) {
  const ChunkId chunk = scheduler_->store().chunk_of(TensorRef{ChunkKind::kParam16, id});
  const std::uint64_t now = scheduler_->write_count(chunk);
  // The chunk's first landing since its last fold: that fold will want the
  // image of this count (Note [Images someone still wants] in
  // chunk_scheduler.cpp), from now on, since the chunk may go down with the
  // gradient before landing_ended.
  if (use_images_ && landings_.find(chunk) == landings_.end()) scheduler_->expect_image(chunk, now);
  return now;
}

void GradientSums::landing_ended(TensorId id, std::uint64_t began, bool ok) {
  const ChunkId chunk = scheduler_->store().chunk_of(TensorRef{ChunkKind::kParam16, id});
  const auto it = landings_.try_emplace(chunk, LandingWrites{began, 0}).first;
  LandingWrites& w = it->second;
  if (w.made == kBroken) return;
  const std::uint64_t now = scheduler_->write_count(chunk);
  if (!ok || now < began) {
    w.made = kBroken;
    scheduler_->forget_expected_image(chunk);
    return;
  }
  w.made += now - began;
}

void GradientSums::forget_landings(const std::vector<TensorId>& ids) {
  for (const TensorId id : ids) forget_landings_of(scheduler_->store().chunk_of(TensorRef{ChunkKind::kParam16, id}));
}

void GradientSums::forget_landings_of(ChunkId chunk) {
  if (landings_.erase(chunk) > 0) scheduler_->forget_expected_image(chunk);
}

void GradientSums::drop(const std::vector<TensorId>& ids) {
  for (const TensorId id : ids) {
    scheduler_->set_state(TensorRef{ChunkKind::kGradAccum, id}, TensorState::kFree);
  }
}

}  // namespace tidal::hooks
