#include "cpu_adam/update_worker.h"

#include <chrono>
#include <utility>

namespace tidal::cpu_adam {

namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

}  // namespace

bool UpdateTicket::done() const {
  std::lock_guard<std::mutex> lock(mu_);
  return done_;
}

void UpdateTicket::wait() const {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [this] { return done_; });
}

UpdateTimes UpdateTicket::times() const {
  std::lock_guard<std::mutex> lock(mu_);
  return times_;
}

std::exception_ptr UpdateTicket::error() const {
  std::lock_guard<std::mutex> lock(mu_);
  return error_;
}

bool UpdateTicket::undo_failed() const {
  std::lock_guard<std::mutex> lock(mu_);
  return undo_failed_;
}

void UpdateTicket::finish(const UpdateTimes& times, std::exception_ptr error, bool undo_failed) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    times_ = times;
    error_ = std::move(error);
    undo_failed_ = undo_failed;
    done_ = true;
  }
  cv_.notify_all();
}

UpdateWorker::UpdateWorker(std::function<void()> on_start)
    : thread_([this, on_start = std::move(on_start)] { loop(on_start); }) {}

UpdateWorker::~UpdateWorker() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

std::shared_ptr<const UpdateTicket> UpdateWorker::submit(UpdateJob job) {
  auto ticket = std::make_shared<UpdateTicket>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    queue_.emplace_back(std::move(job), ticket);
  }
  cv_.notify_one();
  return ticket;
}

bool UpdateWorker::run_or_wait(const UpdateTicket& ticket) {
  Item item;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = queue_.begin();
    while (it != queue_.end() && it->second.get() != &ticket) ++it;
    // (Not in the queue: running or done.)
    if (it != queue_.end()) {
      const float* chunk = it->first.chunk.param;
      bool clear = running_ != chunk;
      for (auto before = queue_.begin(); clear && before != it; ++before) {
        clear = before->first.chunk.param != chunk;
      }
      if (clear) {
        item = std::move(*it);
        queue_.erase(it);
      }
    }
  }
  if (item.second == nullptr) {
    ticket.wait();
    return false;
  }
  run(item);
  return true;
}

void UpdateWorker::run(Item& item) {
  UpdateJob& job = item.first;
  UpdateTimes t;
  t.fenced_from = now_seconds();
  std::exception_ptr error;
  bool before_update = true;
  try {
    for (const auto& fence : job.fences) fence();
    t.started = now_seconds();
    if (!job.folds.empty()) {
      std::span<GradStats> stats;
      if (job.fold_stats != nullptr) {
        job.fold_stats->assign(job.folds.size(), GradStats{});
        stats = *job.fold_stats;
      }
      fold_gradients(job.fold_dtype, job.folds, job.exec, stats);
    }
    if (!job.undo.empty()) copy_spans(job.undo, job.exec);
    before_update = false;
    for (const ChunkCall& call : job.calls) {
      adam_chunk_step(call.hyper, job.chunk, call.ranges, call.options, job.exec);
    }
  } catch (...) {
    error = std::current_exception();
    if (t.started == 0.0) t.started = now_seconds();
  }
  t.ended = now_seconds();
  job = UpdateJob{};  // (its fences' captures go before the ticket says done)
  const bool undo_failed = error != nullptr && before_update;
  item.second->finish(t, std::move(error), undo_failed);
}

void UpdateWorker::loop(const std::function<void()>& on_start) {
  if (on_start) on_start();
  for (;;) {
    Item item;
    {
      std::unique_lock<std::mutex> lock(mu_);
      running_ = nullptr;
      cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, every job run
      item = std::move(queue_.front());
      queue_.pop_front();
      running_ = item.first.chunk.param;
    }
    run(item);
  }
}

}  // namespace tidal::cpu_adam
