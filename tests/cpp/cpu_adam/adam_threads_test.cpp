// CPU Adam's multi-threaded contracts (Note [Deterministic blocks] and the
// all-or-nothing overflow of Note [CPU Adam passes]) with the default kernel
// target. Labelled "threaded": ThreadSanitizer runs this executable (see
// Note [ThreadSanitizer and oneTBB] in cpu_adam/adam.cpp).
#include <gtest/gtest.h>
#include <tbb/global_control.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <limits>
#include <thread>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/reference.h"
#include "tests/cpp/cpu_adam/adam_test_util.h"

namespace tidal::cpu_adam {
namespace {

using namespace test_util;  // NOLINT: test helpers

// Lets oneTBB run more threads than this (possibly 2-core) machine has.
class ManyThreads {
 public:
  ManyThreads() : control_(tbb::global_control::max_allowed_parallelism, 8) {}

 private:
  tbb::global_control control_;
};

TEST(AdamThreads, ManySpansInOneCallMatchReferencePerSpan) {
  ManyThreads allow;
  const AdamDTypes d{DType::kFloat16, DType::kFloat32, DType::kBFloat16};
  const AdamHyperParams h = non_default_hyper(true, true);
  const std::size_t lengths[] = {1, 70000, 3, kBlockElements, kBlockElements + 1, 0, 17, 100000};
  std::vector<SpanData> got, want;
  for (std::size_t i = 0; i < std::size(lengths); ++i) {
    got.emplace_back(d, lengths[i], i % 3, static_cast<std::uint32_t>(i));
  }
  want = got;
  std::vector<AdamSpan> spans;
  for (std::size_t i = 0; i < got.size(); ++i) {
    spans.push_back(got[i].span(static_cast<std::int64_t>(i + 1)));  // a step per span
    reference::adam_update(h, d, want[i].span(static_cast<std::int64_t>(i + 1)));
  }
  adam_update(h, d, spans, 1.0, ExecOptions{3});
  for (std::size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(span_close(got[i], want[i])) << "target " << kernel_target() << ", span " << i;
  }
}

// Note [Deterministic blocks]: bitwise equal results for any thread count.
TEST(AdamThreads, ResultsDoNotDependOnTheThreadCount) {
  ManyThreads allow;
  const AdamDTypes d{DType::kFloat16, DType::kFloat32, DType::kFloat16};
  const AdamHyperParams h = non_default_hyper(true, true);
  const std::size_t lengths[] = {(std::size_t{1} << 19) + 3, 5, 70001};
  std::vector<SpanData> initial;
  for (std::size_t i = 0; i < std::size(lengths); ++i) {
    initial.emplace_back(d, lengths[i], i, static_cast<std::uint32_t>(50 + i));
    initial.back().set_grads(static_cast<std::uint32_t>(60 + i), 1000.0f);
  }
  std::vector<SpanData> first;
  GradStats first_stats;
  for (int threads : {1, 2, 3, 4, 7}) {
    std::vector<SpanData> run = initial;
    std::vector<AdamSpan> spans;
    std::vector<GradSpan> grads;
    for (SpanData& s : run) {
      spans.push_back(s.span(4));
      grads.push_back({s.gp(), s.count});
    }
    const GradStats stats = grad_stats(d.grad, grads, 1.0 / 1000, ExecOptions{threads});
    adam_update(h, d, spans, 1.0 / 1000, ExecOptions{threads});
    if (first.empty()) {
      first = run;
      first_stats = stats;
      continue;
    }
    EXPECT_EQ(std::memcmp(&stats.sum_squares, &first_stats.sum_squares, sizeof(double)), 0)
        << threads << " threads: sum of squares " << stats.sum_squares << " vs "
        << first_stats.sum_squares;
    for (std::size_t i = 0; i < run.size(); ++i) {
      EXPECT_TRUE(same_bytes(run[i], first[i])) << threads << " threads, span " << i;
    }
  }
}

// One NaN in any block of any span stops the whole step, whichever thread
// meets it and whenever.
TEST(AdamThreads, AnOverflowInAnyBlockLeavesEverySpanUntouched) {
  ManyThreads allow;
  const AdamDTypes d{DType::kFloat16, DType::kFloat32, DType::kFloat16};
  const std::size_t n = 5 * kBlockElements + 9;
  for (std::size_t pos : {std::size_t{3}, 2 * kBlockElements + 1, n - 1}) {
    SpanData a(d, 1000, 1, 81);
    SpanData b(d, n, 2, 82);
    encode(DType::kFloat16, b.gp(), pos, std::numeric_limits<float>::infinity());
    const SpanData a0 = a, b0 = b;
    const AdamSpan spans[] = {a.span(2), b.span(2)};
    AdamStepOptions opt;
    opt.loss_scale = 1024.0;
    const AdamStepResult r = adam_step(non_default_hyper(true, true), d, spans, opt, ExecOptions{3});
    EXPECT_TRUE(r.overflow) << "inf at " << pos;
    EXPECT_TRUE(same_bytes(a, a0));
    EXPECT_TRUE(same_bytes(b, b0));
    const GradSpan grads[] = {{a.gp(), a.count}, {b.gp(), b.count}};
    EXPECT_FALSE(grad_stats(d.grad, grads, 1.0, ExecOptions{3}).finite);
  }
}

// Note [Whose threads run the update]: another pool's runner. This one runs
// uneven ranges, the last first, each on a thread of its own, and counts
// which blocks it was asked for.
class ReversedRunner final : public BlockRunner {
 public:
  void run(std::size_t n, int max_threads, const std::function<void(std::size_t, std::size_t)>& body) const override {
    last_max_threads = max_threads;
    std::vector<std::pair<std::size_t, std::size_t>> ranges;
    for (std::size_t b = 0, len = 1; b < n; b += len, ++len) ranges.emplace_back(b, std::min(n, b + len));
    std::vector<std::thread> threads;
    for (auto it = ranges.rbegin(); it != ranges.rend(); ++it) {
      threads.emplace_back([&, r = *it] {
        for (std::size_t b = r.first; b < r.second; ++b) seen[b].fetch_add(1);
        body(r.first, r.second);
      });
    }
    for (std::thread& t : threads) t.join();
    ++calls;
  }
  mutable std::vector<std::atomic<int>> seen = std::vector<std::atomic<int>>(64);
  mutable int calls = 0;
  mutable int last_max_threads = -1;
};

TEST(AdamThreads, AnotherPoolsRunnerGivesTheSameBytesAndCoversEveryBlockOnce) {
  const AdamDTypes d{DType::kBFloat16, DType::kFloat32, DType::kBFloat16};
  const AdamHyperParams h = non_default_hyper(true, true);
  const std::size_t lengths[] = {9 * kBlockElements + 7, 3, 2 * kBlockElements};
  std::vector<SpanData> initial;
  std::size_t total = 0;
  for (std::size_t i = 0; i < std::size(lengths); ++i) {
    initial.emplace_back(d, lengths[i], i, static_cast<std::uint32_t>(90 + i));
    total += lengths[i];
  }
  const std::size_t blocks = [&] {
    std::size_t b = 0;
    for (std::size_t n : lengths) b += (n + kBlockElements - 1) / kBlockElements;
    return b;
  }();
  ASSERT_LE(blocks, 64u);
  std::vector<SpanData> want = initial, got = initial;
  auto spans_of = [](std::vector<SpanData>& v) {
    std::vector<AdamSpan> spans;
    for (SpanData& s : v) spans.push_back(s.span(3));
    return spans;
  };
  auto grads_of = [](std::vector<SpanData>& v) {
    std::vector<GradSpan> grads;
    for (SpanData& s : v) grads.push_back({s.gp(), s.count});
    return grads;
  };
  const GradStats want_stats = grad_stats(d.grad, grads_of(want), 0.5, ExecOptions{});
  adam_update(h, d, spans_of(want), 0.5, ExecOptions{});

  ReversedRunner runner;
  const ExecOptions exec{5, CopyStores::kAuto, &runner};
  const GradStats got_stats = grad_stats(d.grad, grads_of(got), 0.5, exec);
  adam_update(h, d, spans_of(got), 0.5, exec);
  EXPECT_EQ(runner.calls, 2) << "both passes of " << total << " elements go to the runner";
  EXPECT_EQ(runner.last_max_threads, 5);
  for (std::size_t b = 0; b < runner.seen.size(); ++b) {
    EXPECT_EQ(runner.seen[b].load(), b < blocks ? 2 : 0) << "block " << b;
  }
  EXPECT_EQ(got_stats.finite, want_stats.finite);
  EXPECT_EQ(std::memcmp(&got_stats.sum_squares, &want_stats.sum_squares, sizeof(double)), 0)
      << got_stats.sum_squares << " vs " << want_stats.sum_squares;
  for (std::size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(same_bytes(got[i], want[i])) << "span " << i;
}

// The fp32 mode of adam_chunk_step (the "16-bit" buffer is float32: fp32
// gradients in, the updated masters out, copied block by block right after
// each block's update): bitwise the same for any thread count, the buffer
// equal to the masters afterwards; an overflow changes nothing, the buffer
// keeps its gradients.
TEST(AdamThreads, TheFp32ChunkStepCopiesEachBlockExactlyOnAnyThreadCount) {
  ManyThreads allow;
  const std::size_t numel = 3 * kBlockElements + 1001;
  const std::vector<ChunkRange> ranges{{0, 17, 1}, {32, kBlockElements + 5, 2}, {kBlockElements + 64, numel - kBlockElements - 64, 3}};
  auto init = [&](std::vector<float>& p, std::vector<float>& m, std::vector<float>& v, std::vector<float>& g) {
    p.resize(numel);
    m.resize(numel);
    v.resize(numel);
    g.resize(numel);
    for (std::size_t i = 0; i < numel; ++i) {
      p[i] = 0.5f - static_cast<float>(i % 97) / 97.0f;
      m[i] = static_cast<float>(i % 13) * 1e-3f;
      v[i] = static_cast<float>(i % 7) * 1e-4f;
      g[i] = static_cast<float>(static_cast<int>(i % 31) - 15) * 1e-2f;
    }
  };
  const AdamHyperParams h = non_default_hyper(true, true);
  std::vector<float> want_p;
  std::vector<float> want_g;
  for (int threads : {1, 2, 3, 8}) {
    std::vector<float> p, m, v, g;
    init(p, m, v, g);
    AdamChunk c{p.data(), m.data(), v.data(), g.data(), numel, DType::kFloat32, DType::kFloat32};
    const AdamStepResult r = adam_chunk_step(h, c, ranges, AdamStepOptions{}, ExecOptions{threads});
    ASSERT_FALSE(r.overflow);
    for (const ChunkRange& range : ranges) {
      for (std::size_t i = range.offset; i < range.offset + range.count; ++i) {
        ASSERT_EQ(std::memcmp(&g[i], &p[i], sizeof(float)), 0) << "element " << i << ", " << threads << " threads";
      }
    }
    // Elements outside the ranges keep their gradients.
    EXPECT_EQ(g[20], static_cast<float>(static_cast<int>(20 % 31) - 15) * 1e-2f);
    if (want_p.empty()) {
      want_p = p;
      want_g = g;
    } else {
      ASSERT_EQ(std::memcmp(p.data(), want_p.data(), numel * sizeof(float)), 0) << threads << " threads";
      ASSERT_EQ(std::memcmp(g.data(), want_g.data(), numel * sizeof(float)), 0) << threads << " threads";
    }
  }
  std::vector<float> p, m, v, g;
  init(p, m, v, g);
  g[kBlockElements + 100] = std::numeric_limits<float>::infinity();
  const std::vector<float> g0 = g, p0 = p;
  AdamChunk c{p.data(), m.data(), v.data(), g.data(), numel, DType::kFloat32, DType::kFloat32};
  AdamStepOptions o;
  o.check_overflow = true;
  EXPECT_TRUE(adam_chunk_step(h, c, ranges, o, ExecOptions{3}).overflow);
  EXPECT_EQ(std::memcmp(g.data(), g0.data(), numel * sizeof(float)), 0);
  EXPECT_EQ(std::memcmp(p.data(), p0.data(), numel * sizeof(float)), 0);
}

// copy_spans (Note [A second OpenMP team]): every byte of every span, spans
// shorter than a block, spanning several and ending inside one, on any thread
// count, against std::memcpy; bad spans are errors that copy nothing.
TEST(AdamThreads, CopySpansCopiesEveryByteOnAnyThreadCount) {
  ManyThreads many;
  const std::vector<std::size_t> sizes = {0, 1, 33, kCopyBlockBytes, 3 * kCopyBlockBytes + 5, 4097};
  for (int threads : {0, 1, 2, 5}) {
    std::vector<std::vector<unsigned char>> src, dst, want;
    std::vector<CopySpan> spans;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      src.emplace_back(sizes[i]);
      for (std::size_t b = 0; b < sizes[i]; ++b) src[i][b] = static_cast<unsigned char>((b * 131 + i * 7) & 0xff);
      dst.emplace_back(sizes[i] + 16, 0xAB);  // 16 guard bytes past the span must stay
      want.push_back(dst[i]);
      if (sizes[i] > 0) std::memcpy(want[i].data(), src[i].data(), sizes[i]);
    }
    for (std::size_t i = 0; i < sizes.size(); ++i) spans.push_back({dst[i].data(), src[i].data(), sizes[i]});
    copy_spans(spans, ExecOptions{threads});
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      EXPECT_EQ(dst[i], want[i]) << "span " << i << " of " << sizes[i] << " bytes, " << threads << " threads";
    }
  }
  std::vector<unsigned char> buf(64, 1), other(64, 2);
  const std::vector<CopySpan> overlapping = {{other.data(), buf.data(), 64}, {buf.data() + 8, buf.data(), 16}};
  EXPECT_THROW(copy_spans(overlapping), std::exception);
  const std::vector<CopySpan> null_src = {{buf.data(), nullptr, 4}};
  EXPECT_THROW(copy_spans(null_src), std::exception);
  EXPECT_EQ(other, std::vector<unsigned char>(64, 2)) << "a call with a bad span copied something";
}

}  // namespace
}  // namespace tidal::cpu_adam
