// Adam and AdamW on the CPU over raw buffers, at memory-bandwidth speed.
//
// The caller owns every buffer; these functions only read and write the
// elements they are given. One call updates a list of spans (the tensors of
// a parameter group, or the slices of a chunk) with one set of
// hyperparameters; oneTBB spreads fixed blocks of every span over the cores.
// See Note [CPU Adam passes] for how overflow checks and clipping fit in, and
// Note [Deterministic blocks] for why the results do not depend on the
// thread count.
//
// Note [CPU Adam passes]
// ~~~~~~~~~~~~~~~~~~~~~~
// A mixed-precision step needs two facts about *all* gradients before it may
// change *any* parameter: whether one is inf/nan (then the step is skipped
// and params, m and v stay bit-for-bit untouched) and the global gradient
// norm (the clip coefficient scales every update). So a step is two passes:
//   1. grad_stats(): reads the gradients only (2 bytes/param for fp16) and
//      returns finite-ness and the sum of squares;
//   2. adam_update(): the update, which reads and writes everything once
//      (28 bytes/param for fp16 grads, fp32 master/m/v and an fp16 copy).
// Pass 1 is 2/28 = 7% of pass 2's traffic, but it is a single read stream
// per thread, which gets less bandwidth than the update's eight streams: on
// the 2-core machine of benchmarks/results/cpu_adam-cpu-2c.json the pass runs
// at about half the update's GB/s and a two-pass step takes 1.07-1.25x the
// update alone ("step_over_update"). That is the most a single fused pass
// could save, and a fused pass cannot keep the contract: blocks updated
// before an inf is met cannot be undone, and the clip coefficient is not
// known until the last gradient has been read. So tidal keeps two passes.
// When neither check nor clipping is asked for (fp32/bf16 grads without a
// loss scale), adam_step() skips pass 1 entirely.
//
// The step of a model held in many chunks needs the stats of *every* chunk
// before it updates any, so its pass 1 is a pass over all the gradients
// anyway (or, better, stats gathered as each chunk's gradients land). Such a
// caller passes them in AdamStepOptions::known_stats, and then
// adam_step()/adam_chunk_step() make exactly one memory pass over each
// chunk: unscale, clip, Adam/AdamW and the 16-bit write-back together.
//
// Note [Streaming the param copy]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The 16-bit param copy is the update's only write-only stream. A regular
// store to a line that is not in the cache first reads the line (a
// read-for-ownership), so an update that writes its copy to a buffer of its
// own moves 30 bytes/param, not 28, while torch.optim.AdamW(fused=True) and
// DeepSpeed's CPU Adam (fp32 grads, no copy) move exactly 28, a 7% handicap
// once the update is bound by memory bandwidth, as it is at 2^26+ params
// (the in-cache update runs at about twice DRAM speed on one Zen 3 core).
// "cached_copy_over_update" in benchmarks/results/cpu_adam-*.json measures
// what streaming saves (1.01-1.11x on the 2-core AVX2 machine, paired
// medians over several runs). On x86 AVX2/AVX-512 the kernels
// therefore store such a copy with non-temporal (streaming) stores, aligned
// to the copy's vector, with an sfence at the end of each block. Streaming
// pays only when the data does not stay in the cache, so by default
// (CopyStores::kAuto) it is used for calls of at least
// kStreamCopyMinElements elements; the copy that is the gradients' own slot
// (param_copy == grad) is always stored normally, its lines are already in
// the cache. Stores never change values: results are bitwise the same.
//
// Note [Deterministic blocks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Every span is cut into blocks of kBlockElements from its own start,
// independently of the thread count; threads take whole blocks. The update
// is elementwise, so its results cannot depend on the schedule. The sum of
// squares is accumulated per block (in a fixed lane order inside the block),
// stored per block, and the per-block partials are added in block order in
// double precision after the parallel loop. Results are therefore bitwise
// identical for any thread count, though they may differ between SIMD
// targets (different lane counts sum in a different order).
//
// Note [16-bit optimizer state]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// exp_avg and exp_avg_sq may be stored as bf16 (DType::kBFloat16) to save
// 4 of the 12 bytes/param of fp32 state and 8 of the 28 bytes/param of
// traffic. The arithmetic stays fp32: each element is widened, updated, and
// rounded back to nearest even. bf16 keeps fp32's exponent range (fp16 would
// flush the second moment of small gradients, g^2 < 6e-8, to zero) but only
// 8 significant bits: an exp_avg_sq update smaller than 2^-9 of its value
// (1 - beta2 = 1e-3 of a steady gradient, say) rounds away, so v follows the
// gradient scale only coarsely. It is an opt-in memory/bandwidth trade, not
// a default; torch.optim.AdamW has no equivalent to compare against.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tidal::cpu_adam {

enum class DType : std::uint8_t { kFloat32, kFloat16, kBFloat16 };

// "float32", "float16", "bfloat16".
const char* dtype_name(DType dtype);
std::size_t dtype_size(DType dtype);

// Elements per block of the fixed decomposition (Note [Deterministic blocks]).
// 32768 elements are 512 KiB of fp32 param/m/v + fp16 grad + fp16 copy: a
// block's working set fits in a core's L2 (its gradients, 64 KiB, in L1/L2
// for a check-then-update of the same block), and a block is long enough
// (tens of microseconds) to amortize the scheduling of a task.
inline constexpr std::size_t kBlockElements = std::size_t{1} << 15;

// The same numbers torch.optim.Adam/AdamW take. Validated on every call
// (ValueError naming the value): lr >= 0, 0 <= beta < 1, eps >= 0,
// weight_decay >= 0, all finite.
struct AdamHyperParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  // true: AdamW, decoupled decay p *= 1 - lr * weight_decay before the step.
  // false: Adam with L2, g += weight_decay * p.
  bool adamw_mode = true;
  // false: no bias correction (step size lr, denominator sqrt(v) + eps).
  bool bias_correction = true;
};

// Element types shared by every span of one call.
struct AdamDTypes {
  DType grad = DType::kFloat32;   // any of the three
  DType state = DType::kFloat32;  // exp_avg and exp_avg_sq: kFloat32 or kBFloat16
                                  // (Note [16-bit optimizer state])
  // kFloat16 or kBFloat16 when every span carries a param_copy destination
  // that receives the updated fp32 param rounded to nearest even.
  std::optional<DType> param_copy;
};

// One contiguous run of `count` elements: param[i], exp_avg[i], exp_avg_sq[i],
// grad[i] and param_copy[i] belong together. Any alignment is fine. The
// buffers of one span must not overlap each other, with one exception:
// param_copy may be exactly grad (same address and dtype), the 16-bit chunk
// that holds the gradients and receives the updated params; each element is
// read before it is overwritten.
struct AdamSpan {
  float* param = nullptr;           // fp32 master weights, updated in place
  void* exp_avg = nullptr;          // AdamDTypes::state, updated in place
  void* exp_avg_sq = nullptr;       // AdamDTypes::state, updated in place
  const void* grad = nullptr;       // AdamDTypes::grad
  void* param_copy = nullptr;       // AdamDTypes::param_copy, written; else null
  std::size_t count = 0;
  // The step this update makes, counting from 1: torch's state['step'] after
  // its increment. Only bias correction uses it.
  std::int64_t step = 1;
};

// Calls of at least this many elements stream a write-only param copy
// (Note [Streaming the param copy]): 1 Mi elements are 28 MiB of traffic,
// more than the caches of the cores one call uses keep.
inline constexpr std::size_t kStreamCopyMinElements = std::size_t{1} << 20;

enum class CopyStores : std::uint8_t {
  kAuto,    // stream when the call has >= kStreamCopyMinElements elements
  kStream,  // always stream a write-only copy (where the target can)
  kCache,   // never stream
};

// Note [Whose threads run the update]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// By default oneTBB runs the blocks (Note [Deterministic blocks]). Inside a
// training step the process has a second pool: torch's intra-op threads
// (OpenMP in the CPU wheels), which ran backward a moment before and, with
// libgomp's default wait policy, spin for a while before they sleep. A
// oneTBB update started then competes with them for the same cores. A
// BlockRunner hands the blocks to another pool instead; hooks/ (the libtorch
// side) has one over at::parallel_for, so the update runs on the very
// threads that just ran backward (tidal.cpu_adam_pool "torch", opt-in: on
// the 2-core AMD machine of benchmarks/results/engine_overhead-cpu-2c.json
// it is level with oneTBB inside the engine and slower for CPUAdam alone;
// the spinning it avoids was measured on an Intel Xeon). The blocks
// and the order of every reduction are the same under any runner, so the
// results are bitwise those of oneTBB. cpu_adam itself stays libtorch-free.
class BlockRunner {
 public:
  virtual ~BlockRunner() = default;
  // Calls body(b0, b1) over ranges that cover [0, num_blocks) exactly once,
  // possibly in parallel, on at most max_threads threads (0: the pool's
  // own count), and returns when all have run. The first exception a body
  // throws is rethrown.
  virtual void run(std::size_t num_blocks, int max_threads,
                   const std::function<void(std::size_t, std::size_t)>& body) const = 0;
};

struct ExecOptions {
  // Upper bound on the threads one call uses; 0 uses the calling oneTBB
  // arena, which is every core unless the caller limited it. A value > 0 runs
  // the call in an arena of that size kept for later calls; a caller that
  // runs its own parallel work between steps should rather call with 0 from
  // inside its own tbb::task_arena, so oneTBB's workers need not change
  // arenas on every call (see arena_for() in adam.cpp).
  int max_threads = 0;
  // How a param_copy that is not the grad buffer is stored (Note [Streaming
  // the param copy]). Values are the same either way.
  CopyStores copy_stores = CopyStores::kAuto;
  // Whose threads run the blocks (Note [Whose threads run the update]);
  // null: oneTBB's. Not owned; must outlive the call.
  const BlockRunner* runner = nullptr;
};

// One update pass (pass 2 of Note [CPU Adam passes]) over every span. The
// gradient the update sees is grad * grad_scale, computed in fp32: pass
// (1 / loss_scale) * clip_coef to unscale and clip in the same pass.
// grad_scale must be finite and > 0. No inf/nan check: a non-finite gradient
// propagates into param, m and v (run grad_stats() first, or adam_step()).
void adam_update(const AdamHyperParams& hyper, const AdamDTypes& dtypes,
                 std::span<const AdamSpan> spans, double grad_scale = 1.0,
                 const ExecOptions& exec = {});

struct GradSpan {
  const void* grad = nullptr;
  std::size_t count = 0;
};

struct GradStats {
  // false when any gradient element is inf or nan.
  bool finite = true;
  // Sum over elements of (grad * grad_scale)^2: squares in fp32, summed in
  // fp32 lanes over runs of 256 elements and in double above that (relative
  // error below 2e-5, about 1e-6 on SIMD targets). Only meaningful when
  // finite; may be +inf for huge finite fp32 gradients.
  double sum_squares = 0.0;
};

// Pass 1 of Note [CPU Adam passes]: reads the gradients only.
GradStats grad_stats(DType grad_dtype, std::span<const GradSpan> spans, double grad_scale = 1.0,
                     const ExecOptions& exec = {});

struct AdamStepOptions {
  // Gradients are stored multiplied by this (dynamic loss scaling); > 0.
  double loss_scale = 1.0;
  // > 0: scale the unscaled gradients by min(1, max_grad_norm / (norm + 1e-6))
  // as torch.nn.utils.clip_grad_norm_ does, with norm over every span of
  // this call. <= 0: no clipping.
  double max_grad_norm = 0.0;
  // Skip the whole step, leaving every buffer untouched, when any gradient
  // is inf or nan.
  bool check_overflow = true;
  // Stats of the gradients this step's clipping norm and overflow check
  // cover, already known to the caller: grad_stats(..., 1 / loss_scale)
  // over them, with sum_squares added over several calls (every chunk of a
  // model, say). When set, no gradient pass runs: overflow and the clip
  // coefficient come from these stats and the update is the only memory
  // pass (Note [CPU Adam passes]).
  std::optional<GradStats> known_stats;
};

struct AdamStepResult {
  bool overflow = false;    // true: nothing was written
  double grad_norm = -1.0;  // L2 norm of the unscaled gradients; -1 when not computed
  double clip_coef = 1.0;   // the factor applied to the unscaled gradients
};

// Both passes for one buffer set: grad_stats() when check_overflow or
// clipping asks for it, then adam_update() unless an overflow was found.
// A caller with several calls' worth of spans (gradients on two devices, say)
// runs grad_stats() on each, combines, and calls adam_update() itself.
AdamStepResult adam_step(const AdamHyperParams& hyper, const AdamDTypes& dtypes,
                         std::span<const AdamSpan> spans, const AdamStepOptions& options = {},
                         const ExecOptions& exec = {});

// --- one chunk ---------------------------------------------------------------
// The chunk engine's step for one chunk: the fp32 master chunk, the two state
// chunks and the 16-bit chunk, whose elements hold the (loss-scaled)
// gradients on entry (unless AdamChunk::grad gives them) and receive the updated params rounded to nearest even
// (dtype `half`: kFloat16 or kBFloat16). Tensor t of the chunk sits at the
// same element offset in all four. `half` may also be kFloat32 (the
// engine's fp32 mode, where the "16-bit" list is float32 by role): fp32
// gradients in, and the updated fp32 params copied in exactly after the step.
struct AdamChunk {
  float* param = nullptr;         // fp32 master, `numel` elements
  void* exp_avg = nullptr;        // state dtype, `numel` elements
  void* exp_avg_sq = nullptr;     // state dtype, `numel` elements
  void* half = nullptr;           // 16-bit grads in, 16-bit params out, `numel` elements
  std::size_t numel = 0;
  DType half_dtype = DType::kFloat16;
  DType state_dtype = DType::kFloat32;
  // Gradient accumulation: the fp32 gradient sums of the chunk (Note
  // [Gradient sums in chunks]). When set, the gradients are read from here
  // and `half` only receives the updated params.
  const float* grad = nullptr;
};

// Elements [offset, offset + count) of every buffer of a chunk, updated as
// step `step` (torch's state['step'] after its increment).
struct ChunkRange {
  std::size_t offset = 0;
  std::size_t count = 0;
  std::int64_t step = 1;
};

// adam_step() over the ranges of one chunk, in one call: the ranges must lie
// inside the chunk and not overlap (ValueError naming the range otherwise);
// elements outside every range (padding, frozen or unused tensors) are
// neither read nor written. One range {0, numel} covers a whole chunk. With
// options.known_stats (the stats of every chunk of the step) this is one
// memory pass: unscale by 1 / loss_scale, clip, inf/nan skip, Adam/AdamW and
// the 16-bit write-back together (Note [CPU Adam passes]); without, the
// overflow check and the norm cover only this chunk's ranges. Thread-safe for
// disjoint chunks; the Python binding releases the GIL around it.
AdamStepResult adam_chunk_step(const AdamHyperParams& hyper, const AdamChunk& chunk,
                               std::span<const ChunkRange> ranges,
                               const AdamStepOptions& options = {}, const ExecOptions& exec = {});

// --- gradient accumulation ----------------------------------------------------
// Note [Gradient sums in chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With gradient accumulation the engine's chunk store has a fifth list of
// fp32 chunks, the gradient sums (chunk/chunk_layout.h). A micro-batch's
// gradient lands in its parameter's 16-bit slot, as without accumulation;
// when backward returns, one fold_gradients() pass per chunk adds every landed
// gradient into its sum (the first micro-batch of a step writes the sum
// instead of adding, so sums are never zeroed) and rounds the fp32 master back
// into the 16-bit slot, which holds the weight again for the next forward.
// The step reads the sums (AdamChunk::grad), and their chunks give their
// memory back (an update the step leaves to the next forward reads them there
// first: Note [Measured where folded] in tidal/engine/overlap.py). So accumulation costs 4 bytes per parameter inside the
// chunks' budgets while a step is under way, no buffer outside them, and no
// per-parameter copy: one pass per chunk, where the chunk is.

// One run of `count` elements of a fold.
struct FoldSpan {
  float* sum = nullptr;           // fp32 gradient sums: sum += grad (sum = grad when first)
  void* half = nullptr;           // the landed gradients in; the master rounded out
  // fp32 master params; null: the 16-bit buffer keeps the gradient, the
  // caller gives it its weights back another way (Note [The weights' image
  // instead of the restore] in hooks/gradient_sums.h)
  const float* master = nullptr;
  std::size_t count = 0;
  bool first = false;             // the step's first gradient for these elements
};

// For each element of each span: sum = (first ? 0 : sum) + grad, with grad
// the `half_dtype` value of `half` widened to fp32 (a first sum is the
// gradient exactly), then half = master rounded to nearest even (copied when
// half_dtype is kFloat32), unless the span's master is null. Spans must not
// overlap each other; within a span, `half` may not overlap `sum` or `master`.
//
// `stats` empty, or one per span: then each span's new sums are also
// measured as they are written, and stats[i] is bitwise what
// grad_stats(DType::kFloat32, {sums of span i}) returns after the fold (the
// same blocks, Note [Deterministic blocks], each measured right after it is
// folded, while it is in cache): Note [Measured in the fold] in
// python/tidal/engine/overlap.py.
void fold_gradients(DType half_dtype, std::span<const FoldSpan> spans,
                    const ExecOptions& exec = {}, std::span<GradStats> stats = {});

// One byte range to copy: `bytes` from `src` to `dst` (which must not overlap).
struct CopySpan {
  void* dst = nullptr;
  const void* src = nullptr;
  std::size_t bytes = 0;
};

// memcpy of every span, on the threads the update runs on (`exec`), in blocks
// of kCopyBlockBytes. For copies a thread other than the script's makes
// beside the update (the undo copies of a speculative update, Note
// [Speculative updates and their undo] in python/tidal/engine/overlap.py):
// see Note [A second OpenMP team].
//
// Note [A second OpenMP team]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// libgomp gives every native thread that starts a parallel region its own
// team of workers. A torch operator large enough to run in parallel, called
// on a second thread (a Python worker), therefore adds a second team beside
// the one of the thread that runs forward and backward, and keeps it while
// that thread lives. Once a process holds more OpenMP workers than cores,
// libgomp stops spinning at its barriers and sleeps on a futex instead, in
// every team: the script's own operators then pay a sleep and a wake-up at
// each parallel region, for as long as the second thread lives, idle or not.
// So the copies and updates made on tidal's worker go through oneTBB, never
// through torch's parallel operators (test_cpu_adam_api.py shows the team a
// torch copy_ on a second thread starts).
inline constexpr std::size_t kCopyBlockBytes = std::size_t{1} << 20;
void copy_spans(std::span<const CopySpan> spans, const ExecOptions& exec = {});

// --- kernel targets -----------------------------------------------------------
// The kernels exist once per SIMD target Highway compiled (AVX3, AVX2, SSE4,
// SSSE3 and the one-lane fallback, SCALAR or EMU128 depending on the
// compiler, on x86; NEON, SVE on Arm) plus "reference", the plain C++ scalar
// reference kernel (cpu_adam/reference.h). By default the best target this
// CPU runs is used; the environment variable TIDAL_CPU_ADAM_TARGET (read at
// the first call) or set_kernel_target() selects another, so CI can run
// everything on the scalar reference or on Highway's baseline.

// Targets this build holds and this CPU runs, best first; "reference" last.
std::vector<std::string> available_kernel_targets();
// Selects the kernels for every later call in the process. Case-insensitive
// target names, or: "auto" (or "") for the best, "baseline" for Highway's
// fallback target (the last before "reference"), "reference" for the scalar
// reference. Throws ValueError naming the available targets for an unknown
// or unrunnable one.
void set_kernel_target(std::string_view name);
// The target calls use now, spelled as in available_kernel_targets().
std::string kernel_target();

}  // namespace tidal::cpu_adam
