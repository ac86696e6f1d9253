// Parameters as views of chunk slots. attach() makes each parameter's data a
// view of its 16-bit slot (the scheduler's access: COMPUTE, the chunk moved
// into place first); detach() ends the use (release to a HOLD state) and
// points the data at an empty placeholder, so a stale use of a parameter
// outside its module's hooks fails loudly instead of reading moved memory.
//
// Note [Parameters keep their TensorImpl]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Both use Tensor::set_data, which swaps the storage under the parameter's
// own TensorImpl: autograd's AccumulateGrad, optimizer references and
// module attributes keep pointing at the same parameter object. A tensor
// that autograd saved for backward and that aliases the slot (a view such as
// weight.t()) would keep the old address, so the engine's saved-tensor hooks
// pack such tensors as (parameter, view geometry) and rebuild the view from
// the parameter's data at unpack time (python/tidal/engine/hooks.py).
#pragma once

#include <ATen/ATen.h>

#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/memory_space.h"
#include "chunk/tensor_state.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {

// A zero-copy tensor over `data`: contiguous `shape`, `dtype`, on `device`.
// The memory is not owned; the caller keeps it alive.
at::Tensor slot_view(void* data, at::IntArrayRef shape, at::ScalarType dtype,
                     const at::Device& device);

// The torch dtype of a chunk list's elements.
at::ScalarType scalar_type_of(DType dtype);

class ParamBinding {
 public:
  // `device_space` is the torch device that memory in MemorySpace::kDevice
  // is addressed as (cuda:N, or cpu for the simulated device).
  ParamBinding(ChunkScheduler& scheduler, at::Device device_space);

  // For each i: access (kind, ids[i]) in `space`, then params[i].set_data(view
  // of the slot shaped like shapes[i]). All or nothing: when an access throws,
  // the slots accessed so far are released to HOLD and detached again.
  void attach(const std::vector<at::Tensor>& params, const std::vector<TensorId>& ids,
              const std::vector<std::vector<std::int64_t>>& shapes, ChunkKind kind,
              MemorySpace space);
  // For each i: release (kind, ids[i]) to `state` and point params[i] at an
  // empty placeholder on `space`'s torch device.
  void detach(const std::vector<at::Tensor>& params, const std::vector<TensorId>& ids,
              ChunkKind kind, TensorState state, MemorySpace placeholder_space);

  // Access one slot and return a view of it (for copies in and out, and the
  // optimizer). The caller releases it through the scheduler.
  at::Tensor access(TensorId id, ChunkKind kind, MemorySpace space, at::IntArrayRef shape);

  at::Device torch_device(MemorySpace space) const;
  at::ScalarType dtype(ChunkKind kind) const;

 private:
  ChunkScheduler& scheduler_;
  at::Device device_space_;
};

}  // namespace tidal::hooks
