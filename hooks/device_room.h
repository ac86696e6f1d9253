// ModuleHooks' side of the one device budget: room for the chunks the
// attached parameters need beside the activations (Note [Chunks in use and
// activations share one budget] in runtime/tracer/memory_tracer.h), the room
// maker that answers an allocation past the budget (the simulated device's
// host counter, or torch's cache misses on a GPU: Note [Room on a cache miss]
// in hooks/cuda_room.h), and the arbiter between chunks and DTR's activations
// (Note [The arbiter between chunks and activations] in
// hooks/dtr/storage_runtime.h) with the DTR session its engine's parameter
// provider was told of (engine_dtr.h).
//
// It owns the room settings and the armed room maker; the scheduler (whose
// device budget it lowers to move chunks) and the tracer (whose limits it
// asks) are not owned. A member of ModuleHooks, which hands out a handle
// sharing its own lifetime (ModuleHooks::room_handle) for the callbacks
// (the room maker, DTR's arbiter set) that may outlive a call.
//
// Thread safety: ModuleHooks' rules, except free_device_room and the
// ChunkArbiter calls, which run on whatever thread allocates (backward runs on
// autograd's device thread) while the hooks' thread waits on it.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "hooks/dtr/storage_runtime.h"
#include "runtime/scheduler/chunk_scheduler.h"
#include "runtime/tracer/memory_tracer.h"

namespace tidal::hooks {

class DeviceRoom : public dtr::ChunkArbiter {
 public:
  // Neither is owned; set_scheduler replaces the first.
  DeviceRoom(ChunkScheduler* scheduler, MemoryTracer* tracer);
  ~DeviceRoom() override;  // disarms the room maker
  DeviceRoom(const DeviceRoom&) = delete;
  DeviceRoom& operator=(const DeviceRoom&) = delete;
  void set_scheduler(ChunkScheduler* scheduler) { scheduler_ = scheduler; }

  // ---- room for chunks in use ------------------------------------------------
  // DTR manages activations: the chunk room rises to what attaching needs
  // (MemoryTracer::make_room) in every step, not only in the warm-up.
  void set_make_room(bool on) { make_room_ = on; }
  // Whether the chunk room follows what the attached parameters need (the
  // warm-up step, or make_room on); otherwise the trace's budget holds.
  bool follows_need() const { return make_room_ || !tracer_->warmed_up(); }
  // Room for `need` chunk bytes in use at once (Note [The warm-up budget] in
  // runtime/tracer/memory_tracer.h; make_room under DTR: Note [DTR under the
  // training engine] in python/tidal/engine/dtr_link.py): activations give way
  // first (reserve_for_chunks), then the tracer's room follows.
  void make_room(std::size_t need);
  // Chunk bytes on the device changed (an attach, detach or landing): the
  // tracer's non-chunk limit and DTR's threshold follow.
  void chunks_moved() const {
    tracer_->update_nonchunk_limit();
    rebalance_dtr();
  }

  // ---- the room maker ----------------------------------------------------------
  // On the simulated device (Note [The simulated device's budget is a hard
  // limit] in hooks/host_allocation_counter.h): an allocation that would
  // pass the budget first moves chunks not in use off the device, on this
  // thread, before it fails (and DTR evicts activations).
  // On a GPU (after set_cuda_room) the same room maker answers torch's cache
  // misses instead (Note [Room on a cache miss] in hooks/cuda_room.h), on
  // whatever thread allocates. `self` is this room's handle
  // (ModuleHooks::room_handle), held weakly by the maker; arming does nothing
  // without one (a ModuleHooks not owned by a shared_ptr).
  void set_device_room_maker(bool on, const std::weak_ptr<DeviceRoom>& self);
  bool free_device_room(std::size_t bytes);
  // The engine's GPU: device `ordinal` and its budget `cap` (torch's cap for
  // this engine); from then on set_device_room_maker arms the CUDA callback.
  void set_cuda_room(int ordinal, std::size_t cap);
  bool on_cuda() const { return cuda_ordinal_ >= 0; }
  // At each hook on a GPU: this thread's cache misses are this engine's
  // (Note [Room on a cache miss]).
  void enter_hook() const;

  // ---- the arbiter between chunks and activations ----------------------------------
  // While on, every attach, detach and landed gradient sets the running DTR
  // session's eviction threshold to dtr_threshold() (Note [DTR under the
  // training engine]). link_bytes_per_s > 0 also prices chunks for the
  // sessions this engine's parameter provider joins: evictions go to a chunk
  // when its round trip over the link costs less per byte than the
  // activation's recompute.
  void set_dtr_arbiter(bool on, std::size_t limit, std::size_t cap, double link_bytes_per_s = 0);
  // The DTR session routing ops now, told by this engine's parameter
  // provider (EngineParamProvider, engine_dtr.h), or nullptr: the session
  // chunk attaches evict activations for and whose threshold the arbiter
  // sets. Not owned; the session clears it before it goes.
  void set_dtr_session(dtr::ActivationRoom* session) { dtr_session_.store(session); }
  double chunk_seconds_per_byte() const override;
  std::size_t evict_chunk() override;
  // limit - the chunk bytes held on the device, at most cap (when > 0), at
  // least 1 (0 would mean "no threshold").
  std::size_t dtr_threshold() const;
  void rebalance_dtr() const;

 private:
  void reserve_for_chunks(std::size_t need);

  ChunkScheduler* scheduler_;
  MemoryTracer* tracer_;
  bool make_room_ = false;
  // The arbiter (set_dtr_arbiter) and the session it serves.
  bool dtr_arbiter_ = false;
  std::atomic<dtr::ActivationRoom*> dtr_session_{nullptr};
  std::size_t dtr_limit_ = 0;
  std::size_t dtr_cap_ = 0;
  double dtr_link_bytes_per_s_ = 0;
  // The room maker: armed on the host counter, or on torch's CUDA callback.
  bool room_maker_ = false;
  int cuda_ordinal_ = -1;          // set_cuda_room: the CUDA callback instead of the host counter's
  std::size_t cuda_cap_ = 0;
  std::uint64_t cuda_room_token_ = 0;  // nonzero while this engine's callback is armed
};

}  // namespace tidal::hooks
