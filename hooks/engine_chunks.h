// The engine's chunks: the chunk scheduler, the stream it orders against and
// the parameter binding, built together from the engine's settings and
// destroyed in the right order (binding, scheduler, then the stream the
// scheduler points to). tidal._C.chunks.Chunks is a binding of this class
// (python/csrc/chunk_bindings.cpp); the memory tracer and ModuleHooks work
// on the scheduler and binding it owns.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hooks/param_binding.h"
#include "runtime/device/device.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {

struct EngineChunksOptions {
  std::size_t chunk_bytes = 0;
  std::string param_dtype = "float16";  // "float16", "bfloat16" or "float32"
  std::string state_dtype = "float32";  // Adam's moments: "float32" or "bfloat16"
  std::size_t device_budget = 0;
  std::size_t host_budget = 0;          // 0: the scheduler's default
  bool prefetch = true;
  std::size_t prefetch_depth = 4;
  bool evict_ahead = true;
  bool skip_clean_copies = true;        // ChunkSchedulerOptions'
  std::string policy = "opt";
  bool pin_host_memory = true;
  std::optional<std::uintptr_t> compute_stream;  // torch's stream, to order copies against
  std::string torch_device = "cpu";     // how device memory is addressed by torch
  std::size_t host_reserve = 0;
  // The disk tier (Note [Chunks on NVMe: the tier] in runtime/scheduler/disk_tier.h);
  // empty path: none.
  std::string disk_path;
  std::size_t disk_budget = 0;          // 0: free space less 10%
  std::vector<ChunkKind> disk_kinds;    // the lists that may go to disk
  int disk_threads = 8;
  std::size_t disk_request_bytes = std::size_t{1} << 20;
  bool disk_allow_buffered = false;
  std::string disk_backend = "threads"; // "threads", "io_uring", "auto"
  bool disk_skip_clean_writes = true;   // ChunkSchedulerOptions'
};

class EngineChunks {
 public:
  EngineChunks(std::shared_ptr<Device> device, const EngineChunksOptions& options);
  EngineChunks(const EngineChunks&) = delete;
  EngineChunks& operator=(const EngineChunks&) = delete;

  ChunkScheduler& scheduler() { return *scheduler_; }
  ParamBinding& binding() { return *binding_; }

 private:
  std::unique_ptr<Stream> compute_stream_;
  std::unique_ptr<ChunkScheduler> scheduler_;
  std::unique_ptr<ParamBinding> binding_;
};

// "float16", "bfloat16", "float32"; a TypeError naming the others otherwise.
DType parse_chunk_dtype(const std::string& name);

}  // namespace tidal::hooks
