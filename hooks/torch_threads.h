// cpu_adam's blocks on torch's intra-op threads (Note [Whose threads run the
// update] in cpu_adam/adam.h).
#pragma once

#include <string_view>

#include "cpu_adam/adam.h"

namespace tidal::hooks {

// Runs the blocks with at::parallel_for: on torch's intra-op pool (OpenMP
// in the CPU wheels), at most torch.get_num_threads() threads, fewer when
// max_threads asks, each taking the next block while any is left. Called
// inside a parallel region it runs on the calling thread, as every
// at::parallel_for does.
class TorchIntraOpRunner final : public cpu_adam::BlockRunner {
 public:
  void run(std::size_t num_blocks, int max_threads,
           const std::function<void(std::size_t, std::size_t)>& body) const override;
};

// The runner of a pool name: "torch" (TorchIntraOpRunner) or "onetbb"
// (nullptr: cpu_adam's own oneTBB driver). ValueError naming the value
// otherwise.
const cpu_adam::BlockRunner* block_runner(std::string_view pool);

}  // namespace tidal::hooks
