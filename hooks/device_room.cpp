#include "hooks/device_room.h"

#include <algorithm>
#include <limits>
#include <string>
#include <thread>
#include <utility>

#include "hooks/cuda_room.h"
#include "hooks/host_allocation_counter.h"
#include "runtime/core/error.h"
#include "runtime/core/units.h"

namespace tidal::hooks {

DeviceRoom::DeviceRoom(ChunkScheduler* scheduler, MemoryTracer* tracer)
    : scheduler_(scheduler), tracer_(tracer) {}

DeviceRoom::~DeviceRoom() {
  if (room_maker_) set_device_room_maker(false, {});
}

void DeviceRoom::make_room(std::size_t need) {
  reserve_for_chunks(need);
  if (make_room_) {
    tracer_->make_room(need);
  } else {
    tracer_->grow_warmup_room(need);
  }
}

// Note [Chunks in use and activations share one budget]: raising the chunk
// room to what the attached parameters need must not take it past the
// budget beside the non-chunk bytes live now; activations give way first
// (DTR evicts one at a time, when a session runs), and where they cannot the
// attach fails with an OutOfMemoryError naming both sides, never an overrun.
void DeviceRoom::reserve_for_chunks(std::size_t need) {
  const std::size_t limit = tracer_->limit();
  dtr::ActivationRoom* session = dtr_session_.load();
  for (;;) {
    const std::size_t live = tracer_->live();
    if (need <= limit && live <= limit - need) return;
    if (session == nullptr || !session->evict_one()) {
      TIDAL_THROW(OutOfMemoryError, "chunks in use need ", format_bytes(need),
                  " on the device and non-chunk device memory (activations and other tensors) "
                  "holds ", format_bytes(live),
                  session != nullptr
                      ? detail::str_cat(" (DTR tracks ", format_bytes(session->tracked_bytes()),
                                        " of it and can evict no more)")
                      : std::string(),
                  ", together past the device budget less the margin, ", format_bytes(limit));
    }
    rebalance_dtr();
  }
}

void DeviceRoom::set_device_room_maker(bool on, const std::weak_ptr<DeviceRoom>& self) {
  if (!on) {
    if (cuda_room_token_ != 0) {
      disarm_cuda_room(cuda_room_token_);
      cuda_room_token_ = 0;
    } else if (room_maker_) {
      set_host_allocation_room_maker(nullptr, std::thread::id());
    }
    room_maker_ = false;
    return;
  }
  if (self.expired()) return;
  RoomMaker maker = [self](std::size_t bytes) {
    const std::shared_ptr<DeviceRoom> room = self.lock();
    return room != nullptr && room->free_device_room(bytes);
  };
  if (cuda_ordinal_ >= 0) {
    // (Re-armed when another engine armed since: its maker must not run for us.)
    if (cuda_room_token_ == 0 || armed_cuda_room() != cuda_room_token_) {
      cuda_room_token_ = arm_cuda_room(cuda_ordinal_, cuda_cap_, std::move(maker));
    }
    set_cuda_room_thread();
  } else {
    set_host_allocation_room_maker(std::move(maker), std::this_thread::get_id());
  }
  room_maker_ = true;
}

void DeviceRoom::set_cuda_room(int ordinal, std::size_t cap) {
  TIDAL_CHECK(ordinal >= 0 && cap > 0, "set_cuda_room: expected a device ordinal >= 0 and a cap > 0, got ",
              ordinal, " and ", cap);
  track_cuda_requests(ordinal);
  cuda_ordinal_ = ordinal;
  cuda_cap_ = cap;
}

void DeviceRoom::enter_hook() const {
  if (cuda_ordinal_ >= 0) set_cuda_room_thread();
}

bool DeviceRoom::free_device_room(std::size_t bytes) {
  // Under DTR with a known link, each piece of room goes to the arbiter's
  // choice (Note [The arbiter between chunks and activations]): an
  // activation that costs less per byte to recompute than a chunk's round
  // trip is evicted instead of a chunk. Without a link, chunks first, and
  // activations once no chunk can leave.
  dtr::ActivationRoom* session = dtr_session_.load();
  const bool arbiter = session != nullptr && dtr_arbiter_ && dtr_link_bytes_per_s_ > 0;
  std::size_t freed = 0;
  bool any = false;
  // One activation evicted; false when none can go.
  auto evict_activation = [&] {
    const std::size_t before = session->tracked_bytes();
    if (!session->evict_one()) return false;
    const std::size_t after = session->tracked_bytes();
    freed += before > after ? before - after : 0;
    any = true;
    return true;
  };
  while (freed < bytes) {
    if (arbiter && session->best_eviction_seconds_per_byte() <= chunk_seconds_per_byte()) {
      if (!evict_activation()) break;
      continue;
    }
    const std::size_t one = evict_chunk();  // (a cached block or a chunk not in use)
    if (one > 0) {
      freed += one;
      any = true;
      if (arbiter) session->count_chunk_eviction(one);  // (the arbiter's choice of a chunk)
      continue;
    }
    if (session == nullptr || arbiter || !evict_activation()) break;
  }
  tracer_->update_nonchunk_limit();
  return any;
}

void DeviceRoom::set_dtr_arbiter(bool on, std::size_t limit, std::size_t cap, double link_bytes_per_s) {
  dtr_arbiter_ = on;
  dtr_limit_ = limit;
  dtr_cap_ = cap;
  dtr_link_bytes_per_s_ = link_bytes_per_s;
}

double DeviceRoom::chunk_seconds_per_byte() const {
  if (!dtr_arbiter_ || dtr_link_bytes_per_s_ <= 0) return std::numeric_limits<double>::infinity();
  // The block's eviction_threshold binds: a chunk leaving would not raise DTR's threshold.
  if (dtr_cap_ > 0 && dtr_threshold() >= dtr_cap_) return std::numeric_limits<double>::infinity();
  return 2.0 / dtr_link_bytes_per_s_;  // out now, back when next used
}

std::size_t DeviceRoom::evict_chunk() {
  const std::size_t device = index_of(MemorySpace::kDevice);
  const std::size_t held = scheduler_->stats().held_bytes[device];
  const std::size_t budget = scheduler_->budget(MemorySpace::kDevice);
  if (held == 0) return 0;
  // A block a lowering left over the budget first (Note [Blocks leaving over
  // a lowered budget] in runtime/scheduler/chunk_scheduler.h): this room is
  // what it was left for.
  if (scheduler_->free_leaving_block(MemorySpace::kDevice)) {
    const std::size_t now = scheduler_->stats().held_bytes[device];
    chunks_moved();
    return held > now ? held - now : 0;
  }
  try {
    // One byte under what is held: the scheduler frees a cached block or
    // moves one chunk (its choice, by the trace) off the device.
    scheduler_->set_budget(MemorySpace::kDevice, held - 1);
  } catch (const OutOfMemoryError&) {
    scheduler_->set_budget(MemorySpace::kDevice, budget);  // every chunk there is in use
    return 0;
  }
  const std::size_t now = scheduler_->stats().held_bytes[device];
  chunks_moved();
  return held > now ? held - now : 0;
}

std::size_t DeviceRoom::dtr_threshold() const {
  // Blocks a lowering left over the budget are the activations' room once
  // freed (Note [Blocks leaving over a lowered budget]): the room maker
  // frees them when an allocation needs it, so DTR does not evict for them.
  const ChunkSchedulerStats s = scheduler_->stats();
  const std::size_t device = index_of(MemorySpace::kDevice);
  const std::size_t held = std::min(s.held_bytes[device], s.budget_bytes[device]);
  std::size_t limit = dtr_limit_ > held ? dtr_limit_ - held : 0;
  if (dtr_cap_ > 0) limit = std::min(limit, dtr_cap_);
  return std::max<std::size_t>(limit, 1);
}

void DeviceRoom::rebalance_dtr() const {
  if (!dtr_arbiter_) return;
  if (dtr::ActivationRoom* s = dtr_session_.load()) s->set_eviction_threshold(dtr_threshold());
}

}  // namespace tidal::hooks
