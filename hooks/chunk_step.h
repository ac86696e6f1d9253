// The optimizer step of one chunk in one call (issue 32).
//
// Note [The step of a chunk in one call]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The engine's step went back and forth between Python and the scheduler
// for every chunk: the space decision asked for the chunk's space, the
// budgets, the held bytes and the capacities one call at a time, then the
// update made 4 access, N placement, 4 chunk_view, one adam_chunk_step and 4
// release calls: about 22 + N crossings of the binding per chunk, each
// taking and dropping the GIL. step_chunk() does it all in C++ with the GIL
// released: where the update runs (update_on_device(), the rule of hybrid
// Adam and of a host too small for the state), pinning the chunks of every
// kind the update uses in that space (access of the chunk's first tensor:
// COMPUTE, so the payload cannot move), the update over the ranges of the
// chunk's tensors, one call per parameter group (cpu_adam's adam_chunk_step
// with SIMD on the host and on the simulated device, whose memory is host
// memory; torch's fused Adam/AdamW on a GPU), and the releases, also after
// an error. Python keeps what is Python's: the loss scale, the clip factor,
// the learning-rate schedule (each group's lr), the steps of the tensors and
// the order of the chunks. One crossing per chunk; the per-tensor step
// counts and group membership are passed as plain lists.
//
// The per-tensor Adam step counts have one owner, the engine's parameter
// records (ParamRecord.step in python/tidal/engine/store.py); C++ keeps no
// copy between calls, each update reads the steps it is given. They stay
// Python's because every other reader and writer of them is: the step
// counts a tensor only when it got a gradient (torch's state['step']),
// CPU Adam during backward counts its speculative updates and counts them
// back when it undoes them (python/tidal/engine/overlap.py), and
// checkpoints save and load them by parameter name. A few integers per
// chunk per step cross with the call that needs them.
//
// Note [The fp32 working copy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// In fp32 training the "16-bit" list is fp32 by role: the working copy that
// forward and backward read, beside the fp32 master. Its slot takes the
// gradient after backward (Note [One layout, five lists]), so the bytes per
// parameter are those of any weights + gradients + moments layout: 16 (4
// working copy or gradient, 4 master, 4 + 4 moments). What it costs is
// traffic: the step reads master, gradient, m and v and writes master, m, v
// and the working copy, 32 bytes per parameter where torch's fused AdamW
// (weights updated in place, gradients apart) moves 28, so at the memory
// bandwidth limit the engine's fp32 step takes about 32/28 = 1.14x that of
// CPUAdam alone (benchmarks/engine_overhead.py). It stays because of the
// link, the scarcer bandwidth on a GPU: a chunk updated on the host goes
// down carrying its gradients and comes back carrying the new weights, 8
// bytes per parameter over the link. Without the copy the gradients would
// land in a list of their own (or in the master's slot) while the weights
// stay in theirs: for a chunk updated on the host both the gradients and
// the weights would go down, 12 bytes per parameter, and backward would hold
// two kinds of chunk per module on the device. Saving 4 bytes of host
// memory traffic per parameter at the price of 4 bytes over the link is a
// loss wherever the link is slower than host memory, as PCIe is. In 16-bit
// training the copy is the 16-bit weights the model needs anyway, and the
// step moves fewer bytes than CPUAdam over fp32 parameters.
#pragma once

#include <cstdint>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/memory_space.h"
#include "cpu_adam/adam.h"
#include "hooks/param_binding.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::hooks {

// One parameter group's share of a chunk: its hyper-parameters (cpu_adam's,
// whichever kernel runs the update) and the tensors of the chunk that belong
// to it, each with the step this update makes (torch's state['step'] after
// its increment).
struct ChunkStepGroup {
  cpu_adam::AdamHyperParams hyper;
  std::vector<TensorId> tensors;
  std::vector<std::int64_t> steps;
};

struct ChunkStepOptions {
  // The factor the 16-bit gradients are multiplied by: clip / loss scale.
  double grad_scale = 1.0;
  // Gradient accumulation: the fp32 sums (ChunkKind::kGradAccum) hold the gradients.
  bool use_sums = false;
  // Hybrid Adam: the chunk's states belong on the device (Note [Where a
  // chunk's Adam runs] in python/tidal/engine/placement.py) when it has room.
  bool prefer_device = true;
  // The host budget is too small for the state (Note [One place per chunk]).
  bool host_short = false;
  // On the device: cpu_adam's SIMD kernels (the simulated device) or torch's
  // fused kernel (a GPU).
  bool device_simd = true;
  // torch's fused kernel: at most this many bytes of fp32 temporaries at
  // once (0: no cap beyond fused_part's). The engine gives half its device
  // margin, so the step keeps within the budget whatever room the
  // activations leave.
  std::size_t max_temporary_bytes = 0;
  int num_threads = 0;
  // Whose threads run cpu_adam's blocks (Note [Whose threads run the
  // update] in cpu_adam/adam.h); null: oneTBB's.
  const cpu_adam::BlockRunner* runner = nullptr;
};

// Whether the update of `chunk` (the step, or a gradient fold) runs on the
// device, where it then needs the chunks of `kinds` beside its 16-bit chunk.
// A master the host budget spilled to the device is updated there; else only
// a chunk whose 16-bit copy is on the device, when the device has room for
// those of the others not there yet and prefer_device (or the host is too
// full to take the 16-bit chunk).
bool update_on_device(const ChunkScheduler& scheduler, std::uint32_t chunk, const std::vector<ChunkKind>& kinds,
                      bool host_short, bool prefer_device);

// `ranges` with every range longer than `part` elements cut into consecutive
// ranges of at most `part` (the same step), in order.
std::vector<cpu_adam::ChunkRange> split_ranges(const std::vector<cpu_adam::ChunkRange>& ranges, std::size_t part);
// The most elements torch's fused kernel updates in one call on a GPU: a
// quarter of a standard chunk of `store`'s 16-bit list, whatever the size of
// the chunk updated (a dedicated chunk's included), so every fp32 temporary
// of a call fits a freed chunk block; fewer where the call's temporaries (at
// most three fp32 copies of the part) would pass `max_temporary_bytes` (0: no
// cap), never fewer than one.
std::size_t fused_part(const ChunkStore& store, std::size_t max_temporary_bytes = 0);

// Note [The step of a chunk in one call]. Returns the space the update ran
// in. The caller holds no GIL.
MemorySpace step_chunk(ChunkScheduler& scheduler, const ParamBinding& binding, std::uint32_t chunk,
                       const std::vector<ChunkStepGroup>& groups, const ChunkStepOptions& options);

}  // namespace tidal::hooks
