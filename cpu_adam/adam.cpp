// Validation, target selection and the block-parallel driver of adam.h.
// The kernels themselves live in adam_kernels.cpp (SIMD) and reference.cpp.
#include "cpu_adam/adam.h"

#include <tbb/blocked_range.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cpu_adam/kernel_table.h"
#include "runtime/core/error.h"

namespace tidal::cpu_adam {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
  }
  return "unknown";
}

std::size_t dtype_size(DType dtype) { return dtype == DType::kFloat32 ? 4 : 2; }

namespace detail {

UpdateConstants make_update_constants(const AdamHyperParams& h, std::int64_t step,
                                      double grad_scale) {
  // Same double-precision expressions as torch.optim.adam._single_tensor_adam
  // (Python float arithmetic is C double arithmetic, ** is pow()).
  double step_size = h.lr;
  double bias_correction2_sqrt = 1.0;
  if (h.bias_correction) {
    const double t = static_cast<double>(step);
    const double bias_correction1 = 1.0 - std::pow(h.beta1, t);
    const double bias_correction2 = 1.0 - std::pow(h.beta2, t);
    step_size = h.lr / bias_correction1;
    bias_correction2_sqrt = std::pow(bias_correction2, 0.5);
  }
  const bool decoupled = h.adamw_mode && h.weight_decay != 0.0;
  UpdateConstants c{};
  c.grad_scale = static_cast<float>(grad_scale);
  c.weight_decay = static_cast<float>(h.weight_decay);
  c.decay_factor = decoupled ? static_cast<float>(1.0 - h.lr * h.weight_decay) : 1.0f;
  c.one_minus_beta1 = static_cast<float>(1.0 - h.beta1);
  c.beta2 = static_cast<float>(h.beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - h.beta2);
  c.bias_correction2_sqrt = static_cast<float>(bias_correction2_sqrt);
  c.eps = static_cast<float>(h.eps);
  c.neg_step_size = static_cast<float>(-step_size);
  return c;
}

}  // namespace detail

namespace {

using detail::KernelTable;

constexpr const char* kTargetEnv = "TIDAL_CPU_ADAM_TARGET";

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& ch : out) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

// Best first, the scalar reference last.
const std::vector<const KernelTable*>& all_tables() {
  static const std::vector<const KernelTable*> tables = [] {
    std::vector<const KernelTable*> t = detail::highway_kernel_tables();
    t.push_back(&detail::reference_kernel_table());
    return t;
  }();
  return tables;
}

const KernelTable& find_table(std::string_view name, const char* source) {
  const std::string wanted = lower(name);
  const auto& tables = all_tables();
  if (wanted.empty() || wanted == "auto") return *tables.front();
  if (wanted == "baseline") return *tables[tables.size() - 2];  // before the reference
  for (const KernelTable* t : tables) {
    if (lower(t->name) == wanted) return *t;
  }
  std::string known;
  for (const KernelTable* t : tables) known += std::string(known.empty() ? "" : ", ") + t->name;
  TIDAL_THROW(ValueError, "unknown or unsupported CPU Adam kernel target '", name, "'", source,
              "; this build and CPU run: ", known,
              " (or 'auto' for the best, 'baseline' for Highway's fallback)");
}

// nullptr until the first call or set_kernel_target().
std::atomic<const KernelTable*> g_active{nullptr};

const KernelTable& active_table() {
  if (const KernelTable* t = g_active.load(std::memory_order_acquire)) return *t;
  const char* env = std::getenv(kTargetEnv);
  const KernelTable& chosen =
      find_table(env != nullptr ? env : "", env != nullptr ? " (from TIDAL_CPU_ADAM_TARGET)" : "");
  const KernelTable* expected = nullptr;
  // A concurrent set_kernel_target() wins over the environment.
  g_active.compare_exchange_strong(expected, &chosen, std::memory_order_acq_rel);
  return *g_active.load(std::memory_order_acquire);
}

void check_hyper(const AdamHyperParams& h) {
  TIDAL_CHECK(std::isfinite(h.lr) && h.lr >= 0.0, "lr must be finite and >= 0, got ", h.lr);
  TIDAL_CHECK(h.beta1 >= 0.0 && h.beta1 < 1.0, "beta1 must be in [0, 1), got ", h.beta1);
  TIDAL_CHECK(h.beta2 >= 0.0 && h.beta2 < 1.0, "beta2 must be in [0, 1), got ", h.beta2);
  TIDAL_CHECK(std::isfinite(h.eps) && h.eps >= 0.0, "eps must be finite and >= 0, got ", h.eps);
  TIDAL_CHECK(std::isfinite(h.weight_decay) && h.weight_decay >= 0.0,
              "weight_decay must be finite and >= 0, got ", h.weight_decay);
}

void check_dtypes(const AdamDTypes& d) {
  TIDAL_CHECK_SUPPORTED(d.state != DType::kFloat16,
                        "exp_avg/exp_avg_sq must be float32 or bfloat16, got float16 "
                        "(fp16 flushes small second moments to zero; see Note [16-bit optimizer "
                        "state] in cpu_adam/adam.h)");
  TIDAL_CHECK_SUPPORTED(!d.param_copy || *d.param_copy != DType::kFloat32,
                        "param_copy must be float16 or bfloat16, got float32 "
                        "(the fp32 master param is already the fp32 copy)");
}

void check_grad_scale(double grad_scale) {
  TIDAL_CHECK(std::isfinite(grad_scale) && grad_scale >= 0.0,
              "grad_scale must be finite and >= 0, got ", grad_scale);
}

void check_exec(const ExecOptions& exec) {
  TIDAL_CHECK(exec.max_threads >= 0, "max_threads must be >= 0 (0: all), got ", exec.max_threads);
}

// Global block numbering over a list of spans (Note [Deterministic blocks]):
// span s owns blocks [first[s], first[s + 1]).
struct BlockMap {
  std::vector<std::size_t> first;
  std::size_t total_elements = 0;

  template <class Counts>
  explicit BlockMap(const Counts& counts) {
    first.reserve(counts.size() + 1);
    std::size_t blocks = 0;
    for (std::size_t c : counts) {
      first.push_back(blocks);
      blocks += (c + kBlockElements - 1) / kBlockElements;
      total_elements += c;
    }
    first.push_back(blocks);
  }
  std::size_t num_blocks() const { return first.back(); }
  // Calls fn(span, begin, count, block) for every block in [b0, b1).
  template <class Fn>
  void visit(std::size_t b0, std::size_t b1, const std::vector<std::size_t>& counts, Fn&& fn) const {
    if (b0 >= b1) return;
    std::size_t s = static_cast<std::size_t>(
        std::upper_bound(first.begin(), first.end(), b0) - first.begin() - 1);
    for (std::size_t b = b0; b < b1; ++b) {
      while (b >= first[s + 1]) ++s;
      const std::size_t begin = (b - first[s]) * kBlockElements;
      fn(s, begin, std::min(kBlockElements, counts[s] - begin), b);
    }
  }
};

// Note [ThreadSanitizer and oneTBB]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Debian's libtbb is not built with -fsanitize=thread, so TSan cannot see
// the synchronization inside it (task hand-off through its small-object
// pool, the join of parallel_for): every TBB parallel_for produces hundreds
// of false reports, in TBB's own headers (partitioner.h, blocked_range.h,
// _task.h) and in any code that reads the results after the join.
// Suppressions cannot be narrow (a report is suppressed when any frame of
// either stack matches, and every block body runs under tbb::detail frames),
// so a TSan build runs the same fixed blocks on plain std::threads instead,
// which TSan fully understands: it checks that our blocks write disjoint
// memory and that results are read only after the join. What it does not
// check is oneTBB itself.
#if defined(__SANITIZE_THREAD__)
#define TIDAL_CPU_ADAM_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define TIDAL_CPU_ADAM_TSAN 1
#endif
#endif

#if !defined(TIDAL_CPU_ADAM_TSAN)
// One arena per max_threads value, created on first use and kept (a fresh
// task_arena per call costs its creation and its workers' arrival on every
// call). NB: oneTBB's workers still have to move into it from whatever arena
// they served last; a caller that runs other parallel work between steps
// does better to call with max_threads = 0 inside its own arena, as
// benchmarks/cpu_adam_bench.cpp does (on 2 cores, 20 vs 15 GB/s for the
// update when the caller's arena alternates with ours).
// Never destroyed: arenas must not outlive libtbb's own teardown at exit.
tbb::task_arena& arena_for(int max_threads) {
  static std::mutex mu;
  static auto* arenas = new std::map<int, std::unique_ptr<tbb::task_arena>>();
  std::lock_guard<std::mutex> lock(mu);
  std::unique_ptr<tbb::task_arena>& arena = (*arenas)[max_threads];
  if (!arena) {
    arena = std::make_unique<tbb::task_arena>(max_threads);
    arena->initialize();
  }
  return *arena;
}
#endif

// Runs body(b0, b1) over [0, num_blocks), in parallel when it is worth it.
template <class Body>
void run_blocks(const BlockMap& map, const ExecOptions& exec, Body&& body) {
  const std::size_t n = map.num_blocks();
  // Below two blocks of work, waking threads costs more than it saves.
  if (n <= 1 || exec.max_threads == 1 || map.total_elements < 2 * kBlockElements) {
    body(std::size_t{0}, n);
    return;
  }
  if (exec.runner != nullptr) {  // Note [Whose threads run the update]
    exec.runner->run(n, exec.max_threads, [&](std::size_t b0, std::size_t b1) { body(b0, b1); });
    return;
  }
#if defined(TIDAL_CPU_ADAM_TSAN)
  // See Note [ThreadSanitizer and oneTBB]: block b goes to thread b % threads.
  const std::size_t threads = std::min<std::size_t>(
      n, exec.max_threads > 0 ? static_cast<std::size_t>(exec.max_threads)
                              : std::max(2u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (std::size_t t = 1; t < threads; ++t) {
    pool.emplace_back([&, t] {
      for (std::size_t b = t; b < n; b += threads) body(b, b + 1);
    });
  }
  for (std::size_t b = 0; b < n; b += threads) body(b, b + 1);
  for (std::thread& th : pool) th.join();
#else
  auto loop = [&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, n),
                      [&](const tbb::blocked_range<std::size_t>& r) { body(r.begin(), r.end()); });
  };
  if (exec.max_threads > 0) {
    arena_for(exec.max_threads).execute(loop);
  } else {
    loop();
  }
#endif
}

int copy_index(const std::optional<DType>& copy) {
  if (!copy) return 0;
  return *copy == DType::kFloat16 ? 1 : 2;
}

}  // namespace

std::vector<std::string> available_kernel_targets() {
  std::vector<std::string> out;
  for (const KernelTable* t : all_tables()) out.emplace_back(t->name);
  return out;
}

void set_kernel_target(std::string_view name) {
  g_active.store(&find_table(name, ""), std::memory_order_release);
}

std::string kernel_target() { return active_table().name; }

namespace {

// adam_update's body. `f32_copies` (empty, or one per span): where each
// block's updated fp32 params are copied right after the block's update, on
// the thread that updated it, while its lines are in cache; the fp32 mode of
// adam_chunk_step, whose grad buffer takes the params (Note [The fp32
// working copy] in hooks/chunk_step.h). The block's grads are read before
// the copy overwrites them, and blocks are disjoint.
void update_impl(const AdamHyperParams& hyper, const AdamDTypes& dtypes, std::span<const AdamSpan> spans,
                 double grad_scale, const ExecOptions& exec, std::span<float* const> f32_copies) {
  check_hyper(hyper);
  check_dtypes(dtypes);
  check_grad_scale(grad_scale);
  check_exec(exec);
  std::vector<std::size_t> counts;
  counts.reserve(spans.size());
  std::vector<detail::UpdateConstants> constants;
  constants.reserve(spans.size());
  std::size_t total = 0;
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const AdamSpan& s = spans[i];
    TIDAL_CHECK(s.step >= 1, "span ", i, ": step must be >= 1 (the step this update makes), got ",
                s.step);
    if (s.count > 0) {
      TIDAL_CHECK(s.param != nullptr && s.exp_avg != nullptr && s.exp_avg_sq != nullptr &&
                      s.grad != nullptr,
                  "span ", i, ": param, exp_avg, exp_avg_sq and grad must be non-null for ",
                  s.count, " elements");
      TIDAL_CHECK((s.param_copy != nullptr) == dtypes.param_copy.has_value(), "span ", i,
                  ": param_copy is ", s.param_copy != nullptr ? "set" : "null",
                  " but AdamDTypes::param_copy is ",
                  dtypes.param_copy ? dtype_name(*dtypes.param_copy) : "unset",
                  "; give a destination exactly when a copy dtype is set");
    }
    counts.push_back(s.count);
    constants.push_back(detail::make_update_constants(hyper, s.step, grad_scale));
    total += s.count;
  }
  // Note [Streaming the param copy]; the kernels stream only a copy that is
  // not the grad buffer, on targets that can.
  const bool stream = exec.copy_stores == CopyStores::kStream ||
                      (exec.copy_stores == CopyStores::kAuto && total >= kStreamCopyMinElements);
  for (detail::UpdateConstants& c : constants) c.stream_copy = stream;
  const KernelTable& table = active_table();
  const bool l2 = !hyper.adamw_mode && hyper.weight_decay != 0.0;
  const detail::UpdateFn fn =
      table.update[static_cast<int>(dtypes.grad)][dtypes.state == DType::kBFloat16 ? 1 : 0]
                  [copy_index(dtypes.param_copy)][l2 ? 1 : 0];
  TIDAL_INTERNAL_ASSERT(fn != nullptr, "no update kernel in table ", table.name);
  const BlockMap map(counts);
  run_blocks(map, exec, [&](std::size_t b0, std::size_t b1) {
    map.visit(b0, b1, counts, [&](std::size_t s, std::size_t begin, std::size_t count, std::size_t) {
      const AdamSpan& span = spans[s];
      fn(constants[s], {span.param, span.exp_avg, span.exp_avg_sq, span.grad, span.param_copy},
         begin, count);
      if (!f32_copies.empty() && f32_copies[s] != nullptr) {
        std::memcpy(f32_copies[s] + begin, span.param + begin, count * sizeof(float));
      }
    });
  });
}

AdamStepResult step_impl(const AdamHyperParams& hyper, const AdamDTypes& dtypes,
                         std::span<const AdamSpan> spans, const AdamStepOptions& options,
                         const ExecOptions& exec, std::span<float* const> f32_copies);

}  // namespace

void adam_update(const AdamHyperParams& hyper, const AdamDTypes& dtypes,
                 std::span<const AdamSpan> spans, double grad_scale, const ExecOptions& exec) {
  update_impl(hyper, dtypes, spans, grad_scale, exec, {});
}

GradStats grad_stats(DType grad_dtype, std::span<const GradSpan> spans, double grad_scale,
                     const ExecOptions& exec) {
  check_grad_scale(grad_scale);
  check_exec(exec);
  std::vector<std::size_t> counts;
  counts.reserve(spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    TIDAL_CHECK(spans[i].count == 0 || spans[i].grad != nullptr, "grad span ", i,
                ": grad must be non-null for ", spans[i].count, " elements");
    counts.push_back(spans[i].count);
  }
  const detail::StatsFn fn = active_table().stats[static_cast<int>(grad_dtype)];
  const BlockMap map(counts);
  // One slot per block, reduced in block order: Note [Deterministic blocks].
  std::vector<double> sums(map.num_blocks(), 0.0);
  std::vector<unsigned char> finite(map.num_blocks(), 1);
  run_blocks(map, exec, [&](std::size_t b0, std::size_t b1) {
    map.visit(b0, b1, counts, [&](std::size_t s, std::size_t begin, std::size_t count, std::size_t b) {
      const detail::BlockStats st = fn(spans[s].grad, begin, count);
      sums[b] = st.sum_squares;
      finite[b] = st.finite ? 1 : 0;
    });
  });
  GradStats out;
  double total = 0.0;
  for (std::size_t b = 0; b < sums.size(); ++b) {
    total += sums[b];
    out.finite = out.finite && finite[b] != 0;
  }
  out.sum_squares = total * grad_scale * grad_scale;
  return out;
}

void fold_gradients(DType half_dtype, std::span<const FoldSpan> spans, const ExecOptions& exec,
                    std::span<GradStats> stats) {
  check_exec(exec);
  TIDAL_CHECK(stats.empty() || stats.size() == spans.size(), "fold_gradients: ", stats.size(),
              " stats for ", spans.size(), " spans; give none or one per span");
  std::vector<std::size_t> counts;
  counts.reserve(spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const FoldSpan& s = spans[i];
    TIDAL_CHECK(s.count == 0 || (s.sum != nullptr && s.half != nullptr),
                "fold span ", i, ": sum and half must be non-null for ", s.count, " elements");
    counts.push_back(s.count);
  }
  const KernelTable& table = active_table();
  const auto& fold = table.fold[static_cast<int>(half_dtype)];
  const detail::StatsFn measure = table.stats[static_cast<int>(DType::kFloat32)];
  const BlockMap map(counts);
  // With stats: one slot per block and its span, reduced in block order
  // below, as grad_stats reduces a span's blocks (Note [Deterministic blocks]).
  const std::size_t slots = stats.empty() ? 0 : map.num_blocks();
  std::vector<double> sums(slots, 0.0);
  std::vector<unsigned char> finite(slots, 1);
  std::vector<std::size_t> span_of(slots, 0);
  run_blocks(map, exec, [&](std::size_t b0, std::size_t b1) {
    map.visit(b0, b1, counts, [&](std::size_t s, std::size_t begin, std::size_t count, std::size_t b) {
      fold[spans[s].first ? 1 : 0][spans[s].master != nullptr ? 1 : 0](spans[s], begin, count);
      if (slots == 0) return;
      const detail::BlockStats st = measure(spans[s].sum, begin, count);
      sums[b] = st.sum_squares;
      finite[b] = st.finite ? 1 : 0;
      span_of[b] = s;
    });
  });
  if (slots == 0) return;
  for (GradStats& st : stats) st = GradStats{};
  for (std::size_t b = 0; b < slots; ++b) {
    GradStats& st = stats[span_of[b]];
    st.sum_squares += sums[b];
    st.finite = st.finite && finite[b] != 0;
  }
}

void copy_spans(std::span<const CopySpan> spans, const ExecOptions& exec) {
  check_exec(exec);
  // The block map counts units of kCopyBlockBytes / kBlockElements bytes, so
  // that one of its blocks is kCopyBlockBytes.
  constexpr std::size_t kUnit = kCopyBlockBytes / kBlockElements;
  std::vector<std::size_t> counts;
  counts.reserve(spans.size());
  for (std::size_t i = 0; i < spans.size(); ++i) {
    const CopySpan& s = spans[i];
    TIDAL_CHECK(s.bytes == 0 || (s.dst != nullptr && s.src != nullptr), "copy span ", i,
                ": dst and src must be non-null for ", s.bytes, " bytes");
    const auto* d = static_cast<const char*>(s.dst);
    const auto* r = static_cast<const char*>(s.src);
    TIDAL_CHECK(s.bytes == 0 || d + s.bytes <= r || r + s.bytes <= d, "copy span ", i,
                ": dst and src overlap");
    counts.push_back((s.bytes + kUnit - 1) / kUnit);
  }
  const BlockMap map(counts);
  run_blocks(map, exec, [&](std::size_t b0, std::size_t b1) {
    map.visit(b0, b1, counts, [&](std::size_t s, std::size_t begin, std::size_t count, std::size_t) {
      const std::size_t lo = begin * kUnit;
      const std::size_t n = std::min(count * kUnit, spans[s].bytes - lo);
      std::memcpy(static_cast<char*>(spans[s].dst) + lo, static_cast<const char*>(spans[s].src) + lo, n);
    });
  });
}

AdamStepResult adam_step(const AdamHyperParams& hyper, const AdamDTypes& dtypes,
                         std::span<const AdamSpan> spans, const AdamStepOptions& options,
                         const ExecOptions& exec) {
  return step_impl(hyper, dtypes, spans, options, exec, {});
}

namespace {

AdamStepResult step_impl(const AdamHyperParams& hyper, const AdamDTypes& dtypes,
                         std::span<const AdamSpan> spans, const AdamStepOptions& options,
                         const ExecOptions& exec, std::span<float* const> f32_copies) {
  TIDAL_CHECK(std::isfinite(options.loss_scale) && options.loss_scale > 0.0,
              "loss_scale must be finite and > 0, got ", options.loss_scale);
  TIDAL_CHECK(!std::isnan(options.max_grad_norm), "max_grad_norm must not be NaN");
  // Validate everything before pass 1 so a bad argument never half-runs.
  check_hyper(hyper);
  check_dtypes(dtypes);
  check_exec(exec);
  const double inv_loss_scale = 1.0 / options.loss_scale;
  const bool clip = options.max_grad_norm > 0.0;
  AdamStepResult result;
  if (options.check_overflow || clip) {
    GradStats stats;
    if (options.known_stats) {
      // One memory pass: the caller already has the stats (Note [CPU Adam passes]).
      TIDAL_CHECK(!(options.known_stats->sum_squares < 0.0),
                  "known_stats.sum_squares must be >= 0, got ", options.known_stats->sum_squares);
      stats = *options.known_stats;
    } else {
      std::vector<GradSpan> grads;
      grads.reserve(spans.size());
      for (const AdamSpan& s : spans) grads.push_back({s.grad, s.count});
      stats = grad_stats(dtypes.grad, grads, inv_loss_scale, exec);
    }
    result.grad_norm = std::sqrt(stats.sum_squares);
    if (!stats.finite && options.check_overflow) {
      result.overflow = true;
      return result;
    }
    if (clip) {
      // torch.nn.utils.clip_grad_norm_: coef = max_norm / (norm + 1e-6), at most 1.
      result.clip_coef = std::min(1.0, options.max_grad_norm / (result.grad_norm + 1e-6));
      if (!std::isfinite(result.clip_coef)) result.clip_coef = 1.0;
    }
  }
  update_impl(hyper, dtypes, spans, inv_loss_scale * result.clip_coef, exec, f32_copies);
  return result;
}

}  // namespace

AdamStepResult adam_chunk_step(const AdamHyperParams& hyper, const AdamChunk& chunk,
                               std::span<const ChunkRange> ranges, const AdamStepOptions& options,
                               const ExecOptions& exec) {
  TIDAL_CHECK(chunk.half_dtype == DType::kFloat16 || chunk.half_dtype == DType::kBFloat16 ||
                  chunk.half_dtype == DType::kFloat32,
              "the chunk's 16-bit buffer must be float16, bfloat16 or (fp32 mode) float32, got ",
              dtype_name(chunk.half_dtype));
  // fp32 mode (the engine's exactness mode: the "16-bit" list is float32 by
  // role): the kernel reads fp32 gradients from the buffer, and each block's
  // updated masters are copied into it right after the block (update_impl),
  // an exact copy; nothing is copied when the step finds an overflow.
  const bool copy_after = chunk.half_dtype == DType::kFloat32;
  TIDAL_CHECK(chunk.numel == 0 || (chunk.param != nullptr && chunk.exp_avg != nullptr &&
                                   chunk.exp_avg_sq != nullptr && chunk.half != nullptr),
              "the chunk's param, exp_avg, exp_avg_sq and 16-bit buffers must be non-null for ",
              chunk.numel, " elements");
  // Ranges inside the chunk and pairwise disjoint: an element updated twice
  // would take two Adam steps.
  std::vector<std::size_t> order(ranges.size());
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    const ChunkRange& r = ranges[i];
    TIDAL_CHECK(r.offset <= chunk.numel && r.count <= chunk.numel - r.offset, "range ", i,
                ": elements [", r.offset, ", ", r.offset + r.count,
                ") are out of range for a chunk of ", chunk.numel, " elements");
    order[i] = i;
  }
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    return ranges[a].offset < ranges[b].offset;
  });
  for (std::size_t k = 1; k < order.size(); ++k) {
    const ChunkRange& a = ranges[order[k - 1]];
    const ChunkRange& b = ranges[order[k]];
    TIDAL_CHECK(a.count == 0 || b.count == 0 || a.offset + a.count <= b.offset, "ranges ",
                order[k - 1], " [", a.offset, ", ", a.offset + a.count, ") and ", order[k], " [",
                b.offset, ", ", b.offset + b.count, ") overlap; each element may be updated once");
  }
  const std::size_t state_size = dtype_size(chunk.state_dtype);
  const std::size_t half_size = dtype_size(chunk.half_dtype);
  std::vector<AdamSpan> spans;
  spans.reserve(ranges.size());
  std::vector<float*> f32_copies;
  for (const ChunkRange& r : ranges) {
    if (r.count == 0) continue;
    void* half = static_cast<char*>(chunk.half) + r.offset * half_size;
    if (copy_after) f32_copies.push_back(static_cast<float*>(half));
    const void* grad = chunk.grad != nullptr ? chunk.grad + r.offset : half;
    spans.push_back(AdamSpan{chunk.param + r.offset,
                             static_cast<char*>(chunk.exp_avg) + r.offset * state_size,
                             static_cast<char*>(chunk.exp_avg_sq) + r.offset * state_size, grad,
                             copy_after ? nullptr : half, r.count, r.step});
  }
  // Steps of empty ranges are checked too, as adam_update() checks every span.
  for (std::size_t i = 0; i < ranges.size(); ++i) {
    TIDAL_CHECK(ranges[i].step >= 1, "range ", i,
                ": step must be >= 1 (the step this update makes), got ", ranges[i].step);
  }
  AdamDTypes dtypes{chunk.grad != nullptr ? DType::kFloat32 : chunk.half_dtype, chunk.state_dtype,
                    chunk.half_dtype};
  if (copy_after) dtypes.param_copy.reset();
  return step_impl(hyper, dtypes, spans, options, exec, f32_copies);
}

}  // namespace tidal::cpu_adam
