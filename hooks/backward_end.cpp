#include "hooks/backward_end.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "hooks/host_allocation_counter.h"
#include "runtime/core/error.h"

namespace tidal::hooks {

bool BackwardEnd::due() const {
  return !queued_ && torch::autograd::get_current_graph_task_id() != -1;
}

void BackwardEnd::queue(const std::weak_ptr<DeviceRoom>& room, std::function<void()> end) {
  TIDAL_CHECK(engine_backward_ || refusal_.empty(), refusal_);
  const std::shared_ptr<DeviceRoom> r = room.lock();
  if (r == nullptr) return;
  const bool raw = !engine_backward_;
  if (raw && raw_limit_ && !r->on_cuda()) {
    // Limited from here as under engine.backward() (set_raw_backward_limits).
    tracer_->set_enforce(true);
    if (raw_room_maker_) r->set_device_room_maker(true, room);
  }
  // Note [A failed backward lifts its limits]: autograd runs final callbacks
  // only when the backward succeeds. One that raises (an out-of-memory error
  // inside a script's torch.autograd.grad) drops its graph task, and with it
  // this callback unrun: the guard it holds lifts the limits then, so plain
  // PyTorch code after the error allocates freely, and the next backward
  // queues its own end.
  auto lift = std::shared_ptr<LiftLimits>(new LiftLimits{this, room});
  torch::autograd::Engine::get_default_engine().queue_callback([this, room, end = std::move(end), raw, lift] {
    lift->armed = false;
    if (const std::shared_ptr<DeviceRoom> alive = room.lock()) {
      end();
      // What the engine's _count(False) does after its own backward.
      tracer_->set_enforce(false);
      alive->set_device_room_maker(false, room);
      set_host_allocation_counting(false);
      if (raw) raw_ended_ = true;
    }
  });
  queued_ = true;
}

BackwardEnd::LiftLimits::~LiftLimits() {
  if (!armed) return;
  try {
    if (const std::shared_ptr<DeviceRoom> alive = room.lock()) {
      owner->tracer_->set_enforce(false);
      alive->set_device_room_maker(false, room);
      set_host_allocation_counting(false);
      owner->queued_ = false;
    }
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor; the backward's own error stands
  }
}

}  // namespace tidal::hooks
