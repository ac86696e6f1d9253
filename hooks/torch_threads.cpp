#include "hooks/torch_threads.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <string>

#include "runtime/core/error.h"

namespace tidal::hooks {

void TorchIntraOpRunner::run(std::size_t num_blocks, int max_threads,
                             const std::function<void(std::size_t, std::size_t)>& body) const {
  std::int64_t threads = at::get_num_threads();
  if (max_threads > 0) threads = std::min<std::int64_t>(threads, max_threads);
  threads = std::clamp<std::int64_t>(threads, 1, static_cast<std::int64_t>(num_blocks));
  // One task per thread, each taking the next block until none is left:
  // at::parallel_for alone would give each thread a fixed contiguous share,
  // and one thread held up (by another pool spinning on its core, say) would
  // hold up the step, where oneTBB's stealing moves its work to the others.
  // Inside a parallel region at::parallel_for calls this once, and the one
  // task runs every block.
  std::atomic<std::size_t> next{0};
  at::parallel_for(0, threads, 1, [&](std::int64_t, std::int64_t) {
    for (std::size_t b = next.fetch_add(1, std::memory_order_relaxed); b < num_blocks;
         b = next.fetch_add(1, std::memory_order_relaxed)) {
      body(b, b + 1);
    }
  });
}

const cpu_adam::BlockRunner* block_runner(std::string_view pool) {
  static const TorchIntraOpRunner torch_runner;
  if (pool == "torch") return &torch_runner;
  if (pool == "onetbb") return nullptr;
  TIDAL_THROW(ValueError, "CPU Adam thread pool '", std::string(pool), "': expected 'torch' or 'onetbb'");
}

}  // namespace tidal::hooks
