#include "hooks/torch_threads.h"

#include <ATen/Parallel.h>

#include <cstdint>
#include <string>

#include "runtime/core/error.h"

namespace tidal::hooks {

void TorchIntraOpRunner::run(std::size_t num_blocks, int max_threads,
                             const std::function<void(std::size_t, std::size_t)>& body) const {
  const auto n = static_cast<std::int64_t>(num_blocks);
  // at::parallel_for splits [0, n) into one contiguous range per thread, on
  // min(threads, n / grain) threads: a grain of n / max_threads caps them.
  const std::int64_t grain = max_threads > 0 ? (n + max_threads - 1) / max_threads : 1;
  at::parallel_for(0, n, grain, [&](std::int64_t b0, std::int64_t b1) {
    body(static_cast<std::size_t>(b0), static_cast<std::size_t>(b1));
  });
}

const cpu_adam::BlockRunner* block_runner(std::string_view pool) {
  static const TorchIntraOpRunner torch_runner;
  if (pool == "torch") return &torch_runner;
  if (pool == "onetbb") return nullptr;
  TIDAL_THROW(ValueError, "CPU Adam thread pool '", std::string(pool), "': expected 'torch' or 'onetbb'");
}

}  // namespace tidal::hooks
