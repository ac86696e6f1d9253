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
  torch::autograd::Engine::get_default_engine().queue_callback([this, room, end = std::move(end), raw] {
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

}  // namespace tidal::hooks
