// CPU Adam against its memory-bandwidth limit, in one process with the
// samples interleaved: every repeat runs a triad, an axpy, tidal's update
// pass, its gradient pass and a full two-pass step back to back, so that all
// of them see the same machine (other processes, turbo, memory traffic).
// benchmarks/cpu_adam.py runs this and folds its JSON into the result file.
//
//   tidal_bench_cpu_adam --params 67108864 --repeats 9 --threads 1,2
//
// Every kernel runs on oneTBB threads over the same fixed 32768-element
// blocks (cpu_adam::kBlockElements), on aligned HostBuffer memory (huge pages
// where the OS gives them). Bytes are STREAM-counted (no write-allocate):
//   triad:  a = b + s * c                  12 B/element (fp32)
//   axpy:   a = a + s * b                  12 B/element, read-modify-write like
//                                          Adam's param/m/v
//   update: tidal Adam, fp16 grad, fp32 param/m/v, fp16 copy   28 B/param
//   stats:  tidal gradient pass (fp16)                            2 B/param
//   step:   stats + update (loss scale, clipping)                30 B/param
//   update_cached: update with the copy stored through the cache (no
//          streaming stores, CopyStores::kCache)                28 B/param
//   step_known: step with the gradient stats already known (one pass) 28 B/param
//   streams: Adam's access pattern with trivial arithmetic: reads fp16 g and
//          fp32 p, m, v; writes p, m, v and an fp16 copy      28 B/param
// triad/axpy/streams are plain loops (restrict pointers, -O3, baseline ISA).
// On a machine whose per-core memory parallelism, not DRAM, limits a
// 3-stream triad, the 8-stream pattern of Adam moves more bytes per second
// than the triad does; "streams" measures that pattern's own ceiling.
#include <tbb/blocked_range.h>
#include <tbb/global_control.h>
#include <tbb/parallel_for.h>
#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/float16.h"
#include "runtime/memory/host_buffer.h"

namespace {

namespace ca = tidal::cpu_adam;
using Clock = std::chrono::steady_clock;

template <class Body>
void parallel_blocks(tbb::task_arena& arena, std::size_t n, Body body) {
  arena.execute([&] {
    tbb::parallel_for(tbb::blocked_range<std::size_t>(0, (n + ca::kBlockElements - 1) / ca::kBlockElements),
                      [&](const tbb::blocked_range<std::size_t>& r) {
                        for (std::size_t b = r.begin(); b < r.end(); ++b) {
                          const std::size_t begin = b * ca::kBlockElements;
                          body(begin, std::min(n, begin + ca::kBlockElements));
                        }
                      });
  });
}

void triad(float* __restrict a, const float* __restrict b, const float* __restrict c, float s,
           std::size_t lo, std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) a[i] = b[i] + s * c[i];
}

void axpy(float* __restrict a, const float* __restrict b, float s, std::size_t lo, std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) a[i] = a[i] + s * b[i];
}

void streams(float* __restrict p, float* __restrict m, float* __restrict v,
             const std::uint16_t* __restrict g, std::uint16_t* __restrict copy, std::size_t lo,
             std::size_t hi) {
  for (std::size_t i = lo; i < hi; ++i) {
    const float x = static_cast<float>(g[i]) * 1e-30f;  // tiny: the values barely move
    p[i] += x;
    m[i] += x;
    v[i] += x;
    copy[i] = static_cast<std::uint16_t>(g[i] + 1u);
  }
}

template <class Fn>
double seconds(Fn&& fn) {
  const auto t0 = Clock::now();
  fn();
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::vector<int> parse_threads(const std::string& s) {
  std::vector<int> out;
  std::size_t pos = 0;
  while (pos < s.size()) {
    const std::size_t comma = s.find(',', pos);
    out.push_back(std::atoi(s.substr(pos, comma - pos).c_str()));
    if (comma == std::string::npos) break;
    pos = comma + 1;
  }
  return out;
}

void print_samples(const char* name, const std::vector<double>& v) {
  std::printf(", \"%s\": [", name);
  for (std::size_t i = 0; i < v.size(); ++i) std::printf("%s%.9f", i ? ", " : "", v[i]);
  std::printf("]");
}

}  // namespace

int main(int argc, char** argv) {
  std::size_t n = std::size_t{1} << 26;
  int repeats = 9;
  std::vector<int> threads = {static_cast<int>(tbb::this_task_arena::max_concurrency())};
  for (int i = 1; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--params")) {
      n = std::strtoull(argv[i + 1], nullptr, 10);
    } else if (!std::strcmp(argv[i], "--repeats")) {
      repeats = std::atoi(argv[i + 1]);
    } else if (!std::strcmp(argv[i], "--threads")) {
      threads = parse_threads(argv[i + 1]);
    } else {
      std::fprintf(stderr, "unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (n == 0 || repeats <= 0 || threads.empty() ||
      *std::min_element(threads.begin(), threads.end()) <= 0) {
    std::fprintf(stderr, "usage: --params N --repeats R --threads t1,t2,...\n");
    return 2;
  }
  const int most = *std::max_element(threads.begin(), threads.end());
  tbb::global_control allow(tbb::global_control::max_allowed_parallelism,
                            static_cast<std::size_t>(most));

  tidal::HostBuffer abuf(n * 4), bbuf(n * 4), cbuf(n * 4);
  tidal::HostBuffer pbuf(n * 4), mbuf(n * 4), vbuf(n * 4), gbuf(n * 2), copybuf(n * 2);
  float* a = static_cast<float*>(abuf.data());
  float* b = static_cast<float*>(bbuf.data());
  float* c = static_cast<float*>(cbuf.data());
  float* p = static_cast<float*>(pbuf.data());
  float* m = static_cast<float*>(mbuf.data());
  float* v = static_cast<float*>(vbuf.data());
  auto* g = static_cast<std::uint16_t*>(gbuf.data());
  auto* copy = static_cast<std::uint16_t*>(copybuf.data());
  // First touch in parallel (pages land where the threads run), with values
  // like a real step's: params ~0.01, gradients ~1e-3 times a 1024 loss scale.
  {
    tbb::task_arena init(most);
    parallel_blocks(init, n, [&](std::size_t lo, std::size_t hi) {
      std::mt19937 rng(static_cast<unsigned>(lo));
      std::normal_distribution<float> normal;
      for (std::size_t i = lo; i < hi; ++i) {
        a[i] = 0.0f;
        b[i] = 1.0f;
        c[i] = 2.0f;
        p[i] = 0.01f * normal(rng);
        m[i] = 0.0f;
        v[i] = 0.0f;
        g[i] = ca::f32_to_f16_rne(1.024f * normal(rng));
        copy[i] = 0;
      }
    });
  }
  ca::AdamHyperParams hyper;
  hyper.lr = 1e-4;
  hyper.weight_decay = 0.01;
  const ca::AdamDTypes dtypes{ca::DType::kFloat16, ca::DType::kFloat32, ca::DType::kFloat16};
  std::int64_t step = 0;
  const float s = 0.5f;
  bool ok = true;

  std::printf("{\"params\": %zu, \"kernel_target\": \"%s\", \"huge_pages\": %s, "
              "\"bytes_per_param\": {\"triad\": 12, \"axpy\": 12, \"streams\": 28, \"update\": 28, "
              "\"stats\": 2, \"step\": 30, \"update_cached\": 28, \"step_known\": 28}, \"results\": [",
              n, ca::kernel_target().c_str(), pbuf.huge_pages() ? "true" : "false");
  for (std::size_t t = 0; t < threads.size(); ++t) {
    tbb::task_arena arena(threads[t]);
    // tidal runs inside the same arena as the reference loops (max_threads 0:
    // the calling arena), so no call waits for workers to change arenas.
    const ca::ExecOptions exec{0};
    auto in_arena = [&](auto&& fn) { return seconds([&] { arena.execute(fn); }); };
    std::vector<double> triad_s, axpy_s, streams_s, update, stats, full, update_cached, step_known;
    for (int r = 0; r < repeats + 1; ++r) {  // repeat 0 warms up
      const double t_triad = seconds([&] {
        parallel_blocks(arena, n, [&](std::size_t lo, std::size_t hi) { triad(a, b, c, s, lo, hi); });
      });
      const double t_axpy = seconds([&] {
        parallel_blocks(arena, n, [&](std::size_t lo, std::size_t hi) { axpy(a, b, s, lo, hi); });
      });
      const double t_streams = seconds([&] {
        parallel_blocks(arena, n,
                        [&](std::size_t lo, std::size_t hi) { streams(p, m, v, g, copy, lo, hi); });
      });
      const ca::AdamSpan span{p, m, v, g, copy, n, ++step};
      const double t_update = in_arena([&] { ca::adam_update(hyper, dtypes, {&span, 1}, 1.0 / 1024, exec); });
      const ca::GradSpan gspan{g, n};
      ca::GradStats st;
      const double t_stats = in_arena([&] { st = ca::grad_stats(dtypes.grad, {&gspan, 1}, 1.0 / 1024, exec); });
      ca::AdamStepOptions opt;
      opt.loss_scale = 1024.0;
      opt.max_grad_norm = 1.0;
      const ca::AdamSpan span2{p, m, v, g, copy, n, ++step};
      ca::AdamStepResult res;
      const double t_step = in_arena([&] { res = ca::adam_step(hyper, dtypes, {&span2, 1}, opt, exec); });
      // The same update with the copy stored through the cache (no
      // streaming stores; Note [Streaming the param copy]), and a step whose
      // gradient stats are already known (one memory pass, as the chunk
      // engine runs it once every chunk's stats are in).
      const ca::AdamSpan span3{p, m, v, g, copy, n, ++step};
      const ca::ExecOptions cached{0, ca::CopyStores::kCache};
      const double t_cached = in_arena([&] { ca::adam_update(hyper, dtypes, {&span3, 1}, 1.0 / 1024, cached); });
      opt.known_stats = st;
      const ca::AdamSpan span4{p, m, v, g, copy, n, ++step};
      ca::AdamStepResult res_known;
      const double t_known = in_arena([&] { res_known = ca::adam_step(hyper, dtypes, {&span4, 1}, opt, exec); });
      ok = ok && st.finite && !res.overflow && !res_known.overflow &&
           res_known.clip_coef == res.clip_coef;
      if (r > 0) {
        triad_s.push_back(t_triad);
        axpy_s.push_back(t_axpy);
        streams_s.push_back(t_streams);
        update.push_back(t_update);
        stats.push_back(t_stats);
        full.push_back(t_step);
        update_cached.push_back(t_cached);
        step_known.push_back(t_known);
      }
    }
    std::printf("%s{\"threads\": %d", t ? ", " : "", threads[t]);
    print_samples("triad_s", triad_s);
    print_samples("axpy_s", axpy_s);
    print_samples("streams_s", streams_s);
    print_samples("update_s", update);
    print_samples("stats_s", stats);
    print_samples("step_s", full);
    print_samples("update_cached_s", update_cached);
    print_samples("step_known_s", step_known);
    std::printf("}");
  }
  // Sanity: the params stayed finite and, after one more update, the copy is
  // their fp16 rounding ("streams" scribbles on the copy).
  const ca::AdamSpan last{p, m, v, g, copy, n, ++step};
  ca::adam_update(hyper, dtypes, {&last, 1}, 1.0 / 1024);
  for (std::size_t i = 0; i < n; i += 4099) {
    ok = ok && std::isfinite(p[i]) && copy[i] == ca::f32_to_f16_rne(p[i]);
  }
  double checksum = 0.0;
  for (std::size_t i = 0; i < n; i += 4099) checksum += a[i];
  std::printf("], \"checksum\": %.3f, \"sane\": %s}\n", checksum, ok ? "true" : "false");
  return ok ? 0 : 1;
}
