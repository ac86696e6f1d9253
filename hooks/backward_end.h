// The end of each backward the engine's hooks see, and the rules for a
// backward engine.backward() does not run (a "raw" backward).
//
// Note [The end of a backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// engine.backward() ends each backward with end_backward(). A script that
// calls loss.backward() itself (the Hugging Face Trainer, accelerate) does
// not: the first backward_pre or land_gradient of a backward queues a final
// callback on autograd's engine (the graph task's final callbacks run before
// backward returns), which does the same: the parameters attached for
// backward go back to their chunks, the tracer's hard limit and the room
// maker are lifted, and the simulated device's meter of torch's CPU
// allocations stops (Note [The memory tracer] in
// runtime/tracer/memory_tracer.h). Only for a ModuleHooks owned by a
// shared_ptr (the engine's). Such a backward is known to the engine by
// take_ended(); what engine.backward() does after its backward (gradient
// accumulation's fold, counting the micro-step) the engine does at its next
// call. Where a backward must go through engine.backward() (fp16 loss
// scaling, data parallel), set_raw_backward() holds the reason, and the first
// hook of a backward not run by it raises it, before any gradient lands.
// Between a forward and its backward nothing is limited, so a raw backward
// on the simulated device limits itself again at its first hook, as
// engine.backward() does before it starts (set_raw_backward_limits).
//
// Thread safety: ModuleHooks' rules; the final callback runs on autograd's
// thread while the caller waits.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>

#include "hooks/device_room.h"
#include "runtime/tracer/memory_tracer.h"

namespace tidal::hooks {

class BackwardEnd {
 public:
  // Not owned.
  explicit BackwardEnd(MemoryTracer* tracer) : tracer_(tracer) {}

  // engine.backward() is running its backward.
  void set_engine_backward(bool running) { engine_backward_ = running; }
  // Non-empty: a raw backward raises `refusal` at its first hook.
  void set_raw_backward(std::string refusal) { refusal_ = std::move(refusal); }
  // A raw backward turns on at its first hook the tracer's hard limit
  // (`limit`) and the room maker with it (`room_maker`); not on a GPU.
  void set_raw_backward_limits(bool limit, bool room_maker) {
    raw_limit_ = limit;
    raw_room_maker_ = room_maker;
  }
  // Whether a raw backward ended since the last call.
  bool take_ended() {
    const bool ended = raw_ended_;
    raw_ended_ = false;
    return ended;
  }

  // Whether this hook is the first of a backward whose end is not queued yet.
  bool due() const;
  // At that hook: raises the refusal of a raw backward, limits it, and queues
  // on autograd's engine a final callback that runs `end` (the hooks'
  // end_backward) and lifts the limits. `room` is the hooks' room handle; it
  // also keeps this object alive for the callback, which does nothing once
  // the hooks are gone. Nothing is queued without a handle.
  void queue(const std::weak_ptr<DeviceRoom>& room, std::function<void()> end);
  // The queued end ran, or the hooks released everything (end_backward,
  // release_all): the next backward queues its own.
  void ended() { queued_ = false; }

 private:
  // Held by the queued end: if autograd drops it unrun (the backward raised),
  // lifts the limits (Note [A failed backward lifts its limits] in
  // backward_end.cpp).
  struct LiftLimits {
    BackwardEnd* owner;
    std::weak_ptr<DeviceRoom> room;
    bool armed = true;
    ~LiftLimits();
  };

  MemoryTracer* tracer_;
  bool queued_ = false;
  bool engine_backward_ = false;
  bool raw_ended_ = false;
  bool raw_limit_ = false;
  bool raw_room_maker_ = false;
  std::string refusal_;
};

}  // namespace tidal::hooks
