#include "hooks/param_binding.h"

#include <exception>

#include "runtime/core/error.h"

namespace tidal::hooks {

at::Tensor slot_view(void* data, at::IntArrayRef shape, at::ScalarType dtype,
                     const at::Device& device) {
  TIDAL_INTERNAL_ASSERT(data != nullptr, "slot_view of a slot without payload");
  return at::from_blob(data, shape, at::TensorOptions().dtype(dtype).device(device));
}

at::ScalarType scalar_type_of(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return at::kHalf;
    case DType::kBFloat16:
      return at::kBFloat16;
    case DType::kFloat32:
      return at::kFloat;
  }
  TIDAL_INTERNAL_ASSERT(false, "unknown chunk dtype");
}

ParamBinding::ParamBinding(ChunkScheduler& scheduler, at::Device device_space)
    : scheduler_(scheduler), device_space_(device_space) {}

at::Device ParamBinding::torch_device(MemorySpace space) const {
  return space == MemorySpace::kDevice ? device_space_ : at::Device(at::kCPU);
}

at::ScalarType ParamBinding::dtype(ChunkKind kind) const {
  return scalar_type_of(scheduler_.store().list(kind).dtype());
}

at::Tensor ParamBinding::access(TensorId id, ChunkKind kind, MemorySpace space,
                                at::IntArrayRef shape, AccessMode mode, bool wait_for_copy) {
  void* data = scheduler_.access(TensorRef{kind, id}, space, mode, wait_for_copy);
  return slot_view(data, shape, dtype(kind), torch_device(space));
}

at::Tensor ParamBinding::placeholder(ChunkKind kind, MemorySpace space) const {
  return at::empty({0}, at::TensorOptions().dtype(dtype(kind)).device(torch_device(space)));
}

}  // namespace tidal::hooks
