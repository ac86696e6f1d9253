#include "hooks/engine_dtr.h"

namespace tidal::hooks {

std::int64_t EngineParamProvider::alias(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || t.layout() != at::kStrided) return -1;
  const std::shared_ptr<ModuleHooks> hooks = hooks_.lock();
  return hooks ? hooks->attached_at(t.storage().data_ptr().get()) : -1;
}

std::weak_ptr<dtr::ChunkArbiter> EngineParamProvider::arbiter() const {
  const std::shared_ptr<ModuleHooks> hooks = hooks_.lock();
  return hooks ? hooks->room_handle() : std::weak_ptr<DeviceRoom>();
}

void EngineParamProvider::session_changed(dtr::ActivationRoom* routing) {
  if (const std::shared_ptr<ModuleHooks> hooks = hooks_.lock()) hooks->room().set_dtr_session(routing);
}

}  // namespace tidal::hooks
