#include "hooks/engine_chunks.h"

#include <utility>

#include "chunk/chunk_store.h"
#include "runtime/core/error.h"

namespace tidal::hooks {

DType parse_chunk_dtype(const std::string& name) {
  if (name == "float16") return DType::kFloat16;
  if (name == "bfloat16") return DType::kBFloat16;
  if (name == "float32") return DType::kFloat32;
  TIDAL_CHECK_TYPE(false, "unsupported parameter dtype '", name,
                   "'; tidal keeps parameters as float16, bfloat16 or float32");
}

EngineChunks::EngineChunks(std::shared_ptr<Device> device, const EngineChunksOptions& o) {
  TIDAL_CHECK(device != nullptr, "Chunks: device is None");
  if (o.compute_stream) {
    compute_stream_ = device->wrap_external_stream(*o.compute_stream, "torch-compute");
  }
  ChunkStoreOptions store_options;
  store_options.chunk_bytes = o.chunk_bytes;
  store_options.param_dtype = parse_chunk_dtype(o.param_dtype);
  store_options.state_dtype = parse_chunk_dtype(o.state_dtype);
  ChunkSchedulerOptions options;
  options.device_budget_bytes = o.device_budget;
  options.host_budget_bytes = o.host_budget == 0 ? options.host_budget_bytes : o.host_budget;
  options.use_trace = true;
  options.prefetch = o.prefetch;
  options.prefetch_depth = o.prefetch_depth;
  options.evict_ahead = o.evict_ahead;
  options.skip_clean_copies = o.skip_clean_copies;
  // Note [A clean chunk goes down without a copy]: the trainable parameters'
  // pool only (pool 0: _pool in python/tidal/engine/store.py); a frozen
  // chunk is its tensors' only copy.
  options.clean_copy_pools = 1u << 0;
  options.pin_host_memory = o.pin_host_memory;
  options.host_eviction_reserve_bytes = o.host_reserve;
  options.compute_stream = compute_stream_.get();
  options.policy = make_eviction_policy(o.policy);
  options.disk_path = o.disk_path;
  options.disk_budget_bytes = o.disk_budget;
  options.disk_kinds = 0;
  for (ChunkKind kind : o.disk_kinds) options.disk_kinds = static_cast<std::uint8_t>(options.disk_kinds | (1u << index_of(kind)));
  options.disk_threads = o.disk_threads;
  options.disk_request_bytes = o.disk_request_bytes;
  options.disk_allow_buffered = o.disk_allow_buffered;
  options.disk_backend = parse_direct_io_backend(o.disk_backend);
  options.disk_skip_clean_writes = o.disk_skip_clean_writes;
  scheduler_ = std::make_unique<ChunkScheduler>(ChunkStore(store_options), std::move(device), options);
  binding_ = std::make_unique<ParamBinding>(*scheduler_, at::Device(o.torch_device));
}

}  // namespace tidal::hooks
