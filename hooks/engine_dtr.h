// The training engine's side of a DTR session in C++ (Note [DTR under the
// training engine] in python/tidal/engine/dtr_link.py).
//
// A session reaches the engine only through the engine's parameter
// provider, and the engine the session only through what the provider is
// told, so no process global ties them (the dispatcher's fallback keeps the
// one pointer it needs to find the session routing ops, interceptor.cpp):
//   * alias(): which of the engine's attached parameters a tensor views
//     (ModuleHooks::attached_at), for every tensor of every op;
//   * arbiter(): the engine's DeviceRoom (device_room.h), which prices and
//     moves its chunks (Note [The arbiter between chunks and activations]),
//     held weakly by the session's ArbiterSet through a handle that keeps
//     the whole ModuleHooks alive (ModuleHooks::room_handle);
//   * session_changed(): the session routing ops now, or none, kept by the
//     DeviceRoom (set_dtr_session) for the evictions chunk attaches ask for
//     and the threshold the arbiter sets.
// Replays (view(), end_replay_step()) and parameter names stay with the
// engine's Python side, a subclass (python/csrc/dtr_bindings.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>

#include "hooks/dtr/interceptor.h"
#include "hooks/module_hooks.h"

namespace tidal::hooks {

class EngineParamProvider : public dtr::ParamProvider {
 public:
  explicit EngineParamProvider(std::weak_ptr<ModuleHooks> hooks) : hooks_(std::move(hooks)) {}

  std::int64_t alias(const at::Tensor& t) override;
  std::uint64_t weights_epoch() const override { return epoch_.load(); }
  void set_weights_epoch(std::uint64_t epoch) { epoch_.store(epoch); }
  std::weak_ptr<dtr::ChunkArbiter> arbiter() const override;
  void session_changed(dtr::ActivationRoom* routing) override;

 private:
  std::weak_ptr<ModuleHooks> hooks_;
  std::atomic<std::uint64_t> epoch_{0};
};

}  // namespace tidal::hooks
