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
                                at::IntArrayRef shape) {
  void* data = scheduler_.access(TensorRef{kind, id}, space);
  return slot_view(data, shape, dtype(kind), torch_device(space));
}

void ParamBinding::attach(const std::vector<at::Tensor>& params, const std::vector<TensorId>& ids,
                          const std::vector<std::vector<std::int64_t>>& shapes, ChunkKind kind,
                          MemorySpace space) {
  TIDAL_CHECK(params.size() == ids.size() && ids.size() == shapes.size(),
              "attach: params, ids and shapes must have one entry each, got ", params.size(),
              ", ", ids.size(), ", ", shapes.size());
  const at::ScalarType type = dtype(kind);
  const at::Device device = torch_device(space);
  std::size_t done = 0;
  try {
    for (; done < params.size(); ++done) {
      void* data = scheduler_.access(TensorRef{kind, ids[done]}, space);
      at::Tensor param = params[done];  // shares the TensorImpl
      param.set_data(slot_view(data, shapes[done], type, device));
    }
  } catch (...) {
    for (std::size_t i = 0; i < done; ++i) {
      scheduler_.release(TensorRef{kind, ids[i]}, TensorState::kHold);
      at::Tensor param = params[i];
      param.set_data(at::empty({0}, at::TensorOptions().dtype(type).device(device)));
    }
    throw;
  }
}

void ParamBinding::detach(const std::vector<at::Tensor>& params, const std::vector<TensorId>& ids,
                          ChunkKind kind, TensorState state, MemorySpace placeholder_space) {
  TIDAL_CHECK(params.size() == ids.size(), "detach: params and ids must have one entry each, got ",
              params.size(), ", ", ids.size());
  const at::TensorOptions empty =
      at::TensorOptions().dtype(dtype(kind)).device(torch_device(placeholder_space));
  for (std::size_t i = 0; i < params.size(); ++i) {
    scheduler_.release(TensorRef{kind, ids[i]}, state);
    at::Tensor param = params[i];
    param.set_data(at::empty({0}, empty));
  }
}

}  // namespace tidal::hooks
