// Parameters as views of chunk slots. ModuleHooks (module_hooks.h) makes a
// parameter's data a view of its 16-bit slot (access(): COMPUTE, the chunk
// moved into place first) and, when the use ends (release to a HOLD state),
// points the data at placeholder(), so a stale use of a parameter outside
// its module's hooks fails loudly instead of reading moved memory.
//
// Note [Parameters keep their TensorImpl]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Both go through Tensor::set_data, which swaps the storage under the parameter's
// own TensorImpl: autograd's AccumulateGrad, optimizer references and
// module attributes keep pointing at the same parameter object. A tensor
// that autograd saved for backward and that aliases the slot (a view such as
// weight.t()) would keep the old address, so the engine's saved-tensor hooks
// pack such tensors as (parameter, view geometry) and rebuild the view from
// the parameter's data at unpack time (PackHook and UnpackHook in
// python/csrc/hook_callables.cpp, the pair ModuleHooks.saved_tensor_hooks
// gives the engine).
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

  // Access one slot and return a view of it (for copies in and out, and the
  // optimizer). The caller releases it through the scheduler. `mode`:
  // ChunkScheduler::access's (a write unless the caller knows it reads);
  // wait_for_copy: as ChunkScheduler::access (Note [A pin that does not wait]).
  at::Tensor access(TensorId id, ChunkKind kind, MemorySpace space, at::IntArrayRef shape,
                    AccessMode mode = AccessMode::kWrite, bool wait_for_copy = true);

  // The empty tensor a detached parameter's data points at: `kind`'s dtype,
  // on `space`'s torch device.
  at::Tensor placeholder(ChunkKind kind, MemorySpace space) const;

  at::Device torch_device(MemorySpace space) const;
  at::ScalarType dtype(ChunkKind kind) const;

 private:
  ChunkScheduler& scheduler_;
  at::Device device_space_;
};

}  // namespace tidal::hooks
