// The worker that runs chunk updates off the caller's thread (Note [The
// worker without the GIL] in cpu_adam/update_worker.h): each job's values
// are those of the same adam_chunk_step calls made on the caller's thread,
// the fences hold the copy and the update back, jobs run in submission
// order, an error stays the job's, destruction runs what was submitted, and
// a waiter runs a job the worker has not started (Note [A waiter runs the job
// itself]) unless a job before it updates the same chunk.
// Labelled "threaded": ThreadSanitizer runs this executable.
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

#include "cpu_adam/adam.h"
#include "cpu_adam/float16.h"
#include "cpu_adam/update_worker.h"

namespace tidal::cpu_adam {
namespace {

// The four buffers of one chunk: fp32 master and moments, bf16 gradients in
// and weights out.
struct ChunkData {
  std::vector<float> param, m, v;
  std::vector<std::uint16_t> half;

  ChunkData(std::size_t n, std::uint32_t seed) : param(n), m(n), v(n), half(n) {
    std::uint32_t x = seed * 2654435761u + 1;
    auto next = [&x] {
      x = x * 1664525u + 1013904223u;
      return static_cast<float>(x >> 8) / static_cast<float>(1u << 24) - 0.5f;
    };
    for (std::size_t i = 0; i < n; ++i) {
      param[i] = next();
      m[i] = 0.1f * next();
      v[i] = 0.01f * (next() + 0.5f);
      half[i] = f32_to_bf16_rne(next());
    }
  }

  AdamChunk chunk() {
    return AdamChunk{param.data(), m.data(), v.data(), half.data(), param.size(),
                     DType::kBFloat16, DType::kFloat32};
  }

  bool operator==(const ChunkData& o) const {
    auto same = [](const auto& a, const auto& b) {
      return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(a[0])) == 0;
    };
    return same(param, o.param) && same(m, o.m) && same(v, o.v) && same(half, o.half);
  }
};

// Two parameter groups over two ranges of the chunk, with their own
// hyperparameters and steps, and a loss scale.
std::vector<ChunkCall> two_groups(std::size_t n) {
  ChunkCall a, b;
  a.hyper.lr = 1e-2;
  a.hyper.weight_decay = 0.1;
  a.ranges = {{0, n / 3, 4}, {n / 3, n / 6, 2}};
  b.hyper.lr = 3e-3;
  b.hyper.beta1 = 0.8;
  b.hyper.adamw_mode = false;
  b.hyper.weight_decay = 0.01;
  b.ranges = {{n / 2, n - n / 2 - 5, 7}};
  for (ChunkCall* c : {&a, &b}) {
    c->options.loss_scale = 512.0;
    c->options.check_overflow = false;
  }
  return {a, b};
}

TEST(UpdateWorker, EachJobUpdatesAsTheSameCallsOnTheCallersThread) {
  constexpr std::size_t kN = 70001;
  std::vector<ChunkData> got, want;
  for (std::uint32_t i = 0; i < 3; ++i) got.emplace_back(kN, i);
  want = got;
  const ExecOptions exec{2};
  std::vector<std::shared_ptr<const UpdateTicket>> tickets;
  {
    UpdateWorker worker;
    for (ChunkData& d : got) {
      UpdateJob job;
      job.chunk = d.chunk();
      job.calls = two_groups(kN);
      job.exec = exec;
      tickets.push_back(worker.submit(std::move(job)));
    }
    for (ChunkData& d : want) {
      for (const ChunkCall& c : two_groups(kN)) adam_chunk_step(c.hyper, d.chunk(), c.ranges, c.options, exec);
    }
    for (const auto& t : tickets) t->wait();
  }
  for (std::size_t i = 0; i < got.size(); ++i) {
    EXPECT_EQ(tickets[i]->error(), nullptr);
    const UpdateTimes t = tickets[i]->times();
    EXPECT_LE(t.fenced_from, t.started);
    EXPECT_LE(t.started, t.ended);
    EXPECT_TRUE(got[i] == want[i]) << "chunk " << i;
  }
}

TEST(UpdateWorker, TheFencesHoldTheUndoCopyAndTheUpdateBack) {
  constexpr std::size_t kN = 4096;
  ChunkData d(kN, 7);
  const ChunkData before = d;
  std::vector<float> undo(kN, 0.0f);
  std::atomic<bool> open{false};
  std::atomic<int> fences_run{0};
  UpdateWorker worker;
  UpdateJob job;
  job.fences = {[&] { fences_run.fetch_add(1); },
                [&] {
                  while (!open.load()) std::this_thread::yield();
                  fences_run.fetch_add(1);
                }};
  job.undo = {CopySpan{undo.data(), d.param.data(), kN * sizeof(float)}};
  job.chunk = d.chunk();
  job.calls = two_groups(kN);
  auto ticket = worker.submit(std::move(job));
  while (fences_run.load() < 1) std::this_thread::yield();
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(ticket->done());
  // (Read while the job waits on its fence: nothing has been written.)
  EXPECT_TRUE(std::all_of(undo.begin(), undo.end(), [](float x) { return x == 0.0f; }));
  open.store(true);
  ticket->wait();
  EXPECT_EQ(fences_run.load(), 2);
  EXPECT_EQ(ticket->error(), nullptr);
  EXPECT_EQ(std::memcmp(undo.data(), before.param.data(), kN * sizeof(float)), 0);
  EXPECT_FALSE(d == before);
}

// A fold job's buffers: sums, masters and bf16 gradients of `n` elements.
struct FoldBuffers {
  std::vector<float> sum, master;
  std::vector<std::uint16_t> half;
  explicit FoldBuffers(std::size_t n) : sum(n), master(n), half(n) {
    for (std::size_t i = 0; i < n; ++i) {
      sum[i] = 0.25f * static_cast<float>(i % 97) - 3.0f;
      master[i] = 0.001f * static_cast<float>(i % 1013) - 0.4f;
      half[i] = f32_to_bf16_rne(0.01f * static_cast<float>(i % 61) - 0.2f);
    }
  }
};

// A fold job (Note [Folds on the worker] in python/tidal/engine/overlap.py):
// after its fence, each span's sum is (first ? 0 : sum) + the bf16 gradient
// and the 16-bit slot holds the master rounded to nearest even, element by
// element as written out here; nothing outside the spans is touched.
TEST(UpdateWorker, AFoldJobFoldsAfterItsFence) {
  constexpr std::size_t kN = 50001;
  FoldBuffers b(kN);
  std::vector<float>& sum = b.sum;
  std::vector<float>& master = b.master;
  std::vector<std::uint16_t>& half = b.half;
  const std::vector<float> sum0 = sum;
  const std::vector<std::uint16_t> half0 = half;
  std::atomic<bool> open{false};
  UpdateWorker worker;
  UpdateJob job;
  job.fences = {[&] {
    while (!open.load()) std::this_thread::yield();
  }};
  // Two spans, the second a first sum; elements [1000, 1500) in neither.
  job.folds = {FoldSpan{sum.data(), half.data(), master.data(), 1000, false},
               FoldSpan{sum.data() + 1500, half.data() + 1500, master.data() + 1500, kN - 1500, true}};
  job.fold_dtype = DType::kBFloat16;
  job.chunk.param = master.data();
  job.exec = ExecOptions{2};
  auto ticket = worker.submit(std::move(job));
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(ticket->done());
  open.store(true);
  ticket->wait();
  ASSERT_EQ(ticket->error(), nullptr);
  for (std::size_t i = 0; i < kN; ++i) {
    if (i >= 1000 && i < 1500) {
      ASSERT_EQ(std::memcmp(&sum[i], &sum0[i], 4), 0) << i;
      ASSERT_EQ(half[i], half0[i]) << i;
      continue;
    }
    const float g = bf16_to_f32(half0[i]);
    const float want = i < 1000 ? sum0[i] + g : g;
    ASSERT_EQ(std::memcmp(&sum[i], &want, 4), 0) << i << ": " << sum[i] << " vs " << want;
    ASSERT_EQ(half[i], f32_to_bf16_rne(master[i])) << i;
  }
}

// A fold job with fold_stats (Note [Measured in the fold] in
// python/tidal/engine/overlap.py): one measure per span, of its new sums,
// as grad_stats finds them once the job is done.
TEST(UpdateWorker, AMeasuringFoldJobMeasuresEachSpansNewSums) {
  constexpr std::size_t kN = 3 * kBlockElements + 17;
  FoldBuffers b(kN);
  std::vector<float>& sum = b.sum;
  std::vector<std::uint16_t>& half = b.half;
  UpdateWorker worker;
  UpdateJob job;
  job.folds = {FoldSpan{sum.data(), half.data(), nullptr, kBlockElements + 5, false},
               FoldSpan{sum.data() + kBlockElements + 5, half.data() + kBlockElements + 5, nullptr,
                        kN - kBlockElements - 5, true}};
  job.fold_dtype = DType::kBFloat16;
  job.fold_stats = std::make_shared<std::vector<GradStats>>();
  job.chunk.param = b.master.data();
  job.exec = ExecOptions{2};
  const auto stats = job.fold_stats;
  auto ticket = worker.submit(std::move(job));
  ticket->wait();
  ASSERT_EQ(ticket->error(), nullptr);
  ASSERT_EQ(stats->size(), 2u);
  const GradSpan spans[2] = {{sum.data(), kBlockElements + 5},
                             {sum.data() + kBlockElements + 5, kN - kBlockElements - 5}};
  for (int i = 0; i < 2; ++i) {
    const GradStats want = grad_stats(DType::kFloat32, {&spans[i], 1});
    EXPECT_TRUE((*stats)[i].finite);
    EXPECT_GT(want.sum_squares, 0.0);
    EXPECT_EQ(std::memcmp(&(*stats)[i].sum_squares, &want.sum_squares, sizeof(double)), 0)
        << i << ": " << (*stats)[i].sum_squares << " vs " << want.sum_squares;
  }
}

TEST(UpdateWorker, RunsTheJobsInSubmissionOrder) {
  std::mutex mu;
  std::vector<int> order;
  std::vector<std::shared_ptr<const UpdateTicket>> tickets;
  UpdateWorker worker;
  for (int i = 0; i < 50; ++i) {
    UpdateJob job;
    job.fences = {[&, i] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(i);
    }};
    tickets.push_back(worker.submit(std::move(job)));
  }
  // A later ticket done means every earlier one is.
  tickets.back()->wait();
  for (const auto& t : tickets) EXPECT_TRUE(t->done());
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(order.size(), 50u);
  for (int i = 0; i < 50; ++i) EXPECT_EQ(order[i], i);
}

TEST(UpdateWorker, AnErrorIsItsJobsAndTheNextJobRuns) {
  constexpr std::size_t kN = 1024;
  ChunkData bad(kN, 1), fenced(kN, 2), good(kN, 3);
  const ChunkData fenced_before = fenced;
  ChunkData want = good;
  UpdateWorker worker;
  UpdateJob out_of_chunk;  // a range past the chunk's end: adam_chunk_step refuses it
  out_of_chunk.chunk = bad.chunk();
  out_of_chunk.calls = two_groups(kN);
  out_of_chunk.calls[1].ranges = {{kN - 10, 20, 1}};
  UpdateJob failed_fence;
  std::vector<float> undo(kN, 0.0f);
  failed_fence.fences = {[] { throw std::runtime_error("the copy into the chunk failed"); }};
  failed_fence.undo = {CopySpan{undo.data(), fenced.param.data(), kN * sizeof(float)}};
  failed_fence.chunk = fenced.chunk();
  failed_fence.calls = two_groups(kN);
  UpdateJob fine;
  fine.chunk = good.chunk();
  fine.calls = two_groups(kN);
  auto t1 = worker.submit(std::move(out_of_chunk));
  auto t2 = worker.submit(std::move(failed_fence));
  auto t3 = worker.submit(std::move(fine));
  t3->wait();
  ASSERT_NE(t1->error(), nullptr);
  EXPECT_FALSE(t1->undo_failed());
  ASSERT_NE(t2->error(), nullptr);
  EXPECT_TRUE(t2->undo_failed());
  try {
    std::rethrow_exception(t2->error());
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "the copy into the chunk failed");
  }
  EXPECT_TRUE(fenced == fenced_before);
  EXPECT_TRUE(std::all_of(undo.begin(), undo.end(), [](float x) { return x == 0.0f; }));
  EXPECT_EQ(t3->error(), nullptr);
  for (const ChunkCall& c : two_groups(kN)) adam_chunk_step(c.hyper, want.chunk(), c.ranges, c.options, {});
  EXPECT_TRUE(good == want);
}

TEST(UpdateWorker, RunsOnStartFirstAndEveryJobBeforeItIsDestroyed) {
  std::atomic<int> started{0};
  std::atomic<int> ran{0};
  std::vector<std::shared_ptr<const UpdateTicket>> tickets;
  auto kept = std::make_shared<int>(5);
  std::weak_ptr<int> watch = kept;
  {
    UpdateWorker worker([&] { started.fetch_add(1); });
    for (int i = 0; i < 20; ++i) {
      UpdateJob job;
      job.fences = {[&, kept] {
        EXPECT_EQ(started.load(), 1);
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        ran.fetch_add(1);
      }};
      tickets.push_back(worker.submit(std::move(job)));
    }
    kept.reset();
  }
  EXPECT_EQ(ran.load(), 20);
  for (const auto& t : tickets) EXPECT_TRUE(t->done());
  // What the jobs' fences held was let go on the worker.
  EXPECT_TRUE(watch.expired());
}

// A job whose fence blocks until `open`, and a counter of fences entered.
UpdateJob blocked_job(ChunkData& d, std::atomic<bool>& open, std::atomic<int>& entered) {
  UpdateJob job;
  job.fences = {[&] {
    entered.fetch_add(1);
    while (!open.load()) std::this_thread::yield();
  }};
  job.chunk = d.chunk();
  job.calls = two_groups(d.param.size());
  return job;
}

ChunkData updated(const ChunkData& d, int times) {
  ChunkData out = d;
  for (int i = 0; i < times; ++i) {
    for (const ChunkCall& c : two_groups(d.param.size())) {
      adam_chunk_step(c.hyper, out.chunk(), c.ranges, c.options, {});
    }
  }
  return out;
}

TEST(UpdateWorker, AWaiterRunsAJobTheWorkerHasNotStarted) {
  constexpr std::size_t kN = 5003;
  ChunkData a(kN, 11), b(kN, 12), c(kN, 13);
  const ChunkData want_a = updated(a, 1), want_b = updated(b, 1);
  std::atomic<bool> open{false};
  std::atomic<int> entered{0};
  UpdateWorker worker;
  auto ta = worker.submit(blocked_job(a, open, entered));
  while (entered.load() < 1) std::this_thread::yield();  // the worker runs a's job
  UpdateJob jb;
  jb.chunk = b.chunk();
  jb.calls = two_groups(kN);
  auto tb = worker.submit(std::move(jb));
  UpdateJob jc;  // (a range past the chunk's end: refused, on the waiter too)
  jc.chunk = c.chunk();
  jc.calls = two_groups(kN);
  jc.calls[0].ranges = {{kN - 3, 9, 1}};
  auto tc = worker.submit(std::move(jc));
  // c's before b's, out of submission order: the worker is held in a's fence.
  EXPECT_TRUE(worker.run_or_wait(*tc));
  ASSERT_TRUE(tc->done());
  EXPECT_NE(tc->error(), nullptr);
  EXPECT_FALSE(tc->undo_failed());
  EXPECT_TRUE(worker.run_or_wait(*tb));
  ASSERT_TRUE(tb->done());
  EXPECT_FALSE(ta->done());
  EXPECT_EQ(tb->error(), nullptr);
  EXPECT_TRUE(b == want_b);
  const UpdateTimes t = tb->times();
  EXPECT_LE(t.fenced_from, t.started);
  EXPECT_LE(t.started, t.ended);
  open.store(true);
  EXPECT_FALSE(worker.run_or_wait(*ta));  // running: waited for
  EXPECT_EQ(ta->error(), nullptr);
  EXPECT_TRUE(a == want_a);
}

TEST(UpdateWorker, AWaiterWaitsBehindAJobOfTheSameChunk) {
  constexpr std::size_t kN = 3001;
  ChunkData a(kN, 21), b(kN, 22);
  const ChunkData want_a = updated(a, 2), want_b = updated(b, 2);
  std::atomic<bool> open{false};
  std::atomic<int> entered{0};
  std::mutex mu;
  std::vector<int> order;
  auto noted = [&](ChunkData& d, int tag) {
    UpdateJob job;
    job.fences = {[&, tag] {
      std::lock_guard<std::mutex> lock(mu);
      order.push_back(tag);
    }};
    job.chunk = d.chunk();
    job.calls = two_groups(kN);
    return job;
  };
  UpdateWorker worker;
  auto t1 = worker.submit(blocked_job(a, open, entered));  // a, running
  while (entered.load() < 1) std::this_thread::yield();
  auto t2 = worker.submit(noted(a, 2));  // a again: behind the one running
  auto t3 = worker.submit(noted(b, 3));
  auto t4 = worker.submit(noted(b, 4));  // b again: behind t3, queued
  std::atomic<int> ran_here{0};
  std::thread w2([&] { ran_here.fetch_add(worker.run_or_wait(*t2) ? 1 : 0); });
  std::thread w4([&] { ran_here.fetch_add(worker.run_or_wait(*t4) ? 1 : 0); });
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  EXPECT_FALSE(t2->done());
  EXPECT_FALSE(t4->done());
  open.store(true);
  w2.join();
  w4.join();
  EXPECT_EQ(ran_here.load(), 0);
  for (const auto& t : {t1, t2, t3, t4}) EXPECT_EQ(t->error(), nullptr);
  {
    std::lock_guard<std::mutex> lock(mu);
    EXPECT_EQ(order, (std::vector<int>{2, 3, 4}));
  }
  EXPECT_TRUE(a == want_a);
  EXPECT_TRUE(b == want_b);
}

}  // namespace
}  // namespace tidal::cpu_adam
