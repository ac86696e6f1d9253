// tidal.dtr's op interception in C++: a boxed fallback on a dispatch key
// below autograd, so every aten op that reaches a kernel passes through
// Session::handle() with no Python on the way. Python keeps the switch
// (tidal.dtr.enable(), the options, the context manager) and makes one call
// to start or end a session.
//
// Note [DTR on a dispatch key]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Where: DispatchKey::Fake, the functionality key just below Python and
// above BackendSelect and the backends. By then autograd has recorded its
// graph, autocast has inserted its casts (as ops of their own) and
// CompositeImplicitAutograd ops have decomposed, so the ops we see are the
// ones that run kernels, exactly what a TorchDispatchMode sees (the Python
// key sits one above). PyTorch declares Fake for a future C++ FakeTensor
// mode; 2.11 to 2.13 register nothing on it. What we rely on, and check:
//   * no other backend fallback on the key (Dispatcher::
//     hasBackendFallbackForDispatchKey before we register ours; afterwards
//     ours is the one there) and no op with a kernel of its own on it
//     (interception_status() scans every registered op when a session
//     starts; such an op would bypass DTR). Either makes enable() use the
//     Python TorchDispatchMode instead, with a warning naming the reason;
//   * a key enters dispatch through the thread-local include set: enable()
//     sets it on the calling thread (DTR is per thread, as the Python mode
//     was), autograd copies thread-local state into its worker threads, and
//     tidal.dtr.outside() excludes the key for tidal's own bookkeeping;
//   * the fallback runs the op with redispatchBoxed() on the keys below
//     Fake, with Fake excluded, so ops a kernel calls internally are not
//     seen (as in the Python mode, where a mode is popped while it runs).
//     Replays redispatch the recorded op on the same keys.
// Also relied on: torch::autograd::get_current_node() names the autograd
// node running a backward op, and AccumulateGrad::variable its parameter
// (Note [Gradients are optimizer inputs]).
// Tests against an upgrade (tests/python/test_dtr_dispatch.py, and without
// Python tests/cpp/hooks/dtr/interceptor_test.cpp): the key is free before
// we register, ours afterwards; the ops DTR sees equal those a logging
// TorchDispatchMode sees for a model step; gradients bitwise equal with
// forced evictions; the interception is per thread; it coexists with
// autocast, a user TorchDispatchMode and torch.func; tidal's errors keep
// their type; gradients are settled as they are made; and the per-op cost
// (benchmarks/dtr.py --only overhead) is measured against plain PyTorch.
//
// Note [What a replay restores]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A replay must compute what the op computed, so it runs the recorded op
// with the recorded arguments on the same keys, and with the thread state
// its kernel reads restored for the call:
//   * the generator state of a random op (nondeterministic_seeded), put back
//     afterwards so the program's random stream is not disturbed;
//   * grad mode. Kernels read it: the oneDNN RNN (aten.mkldnn_rnn_layer)
//     returns its workspace only when grad mode is on, and LSTM's backward
//     reads that workspace. A forward op replayed inside backward (where the
//     autograd engine turns grad mode off) returned three outputs instead of
//     four, and the workspace could not be brought back. Replays run below
//     autograd, so turning grad mode on there records no graph.
// Both interceptions keep the grad mode in the recipe (OpRecipe::grad_mode
// here, the recipe tuple in tidal/dtr.py). Autocast and the dispatch keys are
// not thread state a replay needs: autocast's casts are ops of their own,
// recorded before ours, and the keys are in the recipe.
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <typeinfo>
#include <unordered_map>
#include <vector>

#include "hooks/dtr/storage_runtime.h"

namespace torch::autograd {
struct Node;
}

namespace tidal::hooks::dtr {

// The training engine's view of its chunk-managed parameters (Note [DTR
// with chunk-managed parameters] in tidal/dtr.py): a parameter's data is a
// view of its chunk slot only while attached, so recipes keep (parameter,
// geometry) and replays ask for the view again.
class ParamProvider {
 public:
  virtual ~ParamProvider() = default;
  // The parameter whose attached slot `t` views, or -1. Called for every
  // tensor input and output of every op: must be cheap.
  virtual std::int64_t alias(const at::Tensor& t) = 0;
  // That parameter's data now (attaching it if needed), as this view.
  virtual at::Tensor view(std::int64_t param, at::IntArrayRef sizes, at::IntArrayRef strides,
                          std::int64_t offset) = 0;
  // Detaches what view() attached for one replayed op.
  virtual void end_replay_step() = 0;
  // Bumped whenever the weights change; a recipe from an older epoch must
  // not be replayed.
  virtual std::uint64_t weights_epoch() const = 0;
  virtual std::string param_name(std::int64_t param) const = 0;
  // The engine's side of the arbiter (Note [The arbiter between chunks and
  // activations] in storage_runtime.h), held weakly by the session; empty:
  // the engine moves no chunks for DTR.
  virtual std::weak_ptr<ChunkArbiter> arbiter() const { return {}; }
  // The session that routes ops now and evicts for the engine when chunks
  // need room, or nullptr once it stops (deactivated, this provider removed,
  // or gone). Called with the session locked; must not call back into it.
  virtual void session_changed(ActivationRoom* routing) { (void)routing; }
};

class Session final : public ActivationRoom {
 public:
  explicit Session(tidal::dtr::DtrOptions options);
  ~Session() override;

  // Routes this thread's ops through this session (registering the
  // fallback on first use). Throws tidal::Error naming why when the key
  // is not available (see interception_status()).
  void activate();
  // Stops routing this thread's ops. Other threads' ops were routed only
  // while they ran work of this thread (autograd).
  void deactivate();
  bool active() const;

  // Brings back every evicted tensor still reachable (tidal.dtr.disable()).
  void regenerate_evicted();
  // ActivationRoom, under the session's lock.
  void set_eviction_threshold(std::size_t bytes) override;
  bool evict_one() override;
  std::size_t tracked_bytes() override;
  double best_eviction_seconds_per_byte() override;
  void count_chunk_eviction(std::size_t bytes) override;
  // A provider's arbiter joins the session's (ArbiterSet), and the provider
  // hears of the session while it routes ops (session_changed()).
  void add_provider(std::shared_ptr<ParamProvider> provider);
  void remove_provider(ParamProvider* provider);
  // Called after every intercepted op with the session locked (tests).
  void set_after_op(std::function<void()> fn);
  // Called with the exception of an intercepted op, before it propagates
  // into torch: the Python layer turns tidal's errors into its own
  // exception types there (torch would make them RuntimeErrors).
  void set_rethrow(std::function<void(std::exception_ptr)> fn);
  // Whether an op's exception is an allocation failure (then DTR evicts
  // and retries). By default c10::OutOfMemoryError; the Python layer adds
  // torch.OutOfMemoryError raised by Python kernels, whose error state it
  // clears when it says yes.
  void set_is_oom(std::function<bool(const std::exception&)> fn);

  // Where the recomputation comes from, per op name: tensors it produced
  // that were evicted, times it was replayed; and the regenerations (plans)
  // with their total and longest length in ops.
  struct OpCounters {
    std::uint64_t evicted = 0;
    std::size_t evicted_bytes = 0;
    std::uint64_t replays = 0;
    double replay_seconds = 0.0;
  };
  struct PlanCounters {
    std::uint64_t plans = 0;
    std::uint64_t ops = 0;
    std::size_t longest = 0;
  };
  std::unordered_map<std::string, OpCounters> op_counters();
  PlanCounters plan_counters();

  // The last op intercepted, as Python names it (aten.mul.Tensor); tests.
  std::string last_op() const { return last_op_ == nullptr ? std::string() : *last_op_; }

  // Under the session's lock.
  template <typename Fn>
  auto with_runtime(Fn&& fn) {
    std::lock_guard<std::recursive_mutex> lock(mu_);
    return fn(runtime_);
  }

  // The boxed fallback's body: `below` is the keys below Fake.
  void handle(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack);

 private:
  struct OpInfo;
  struct OpRecipe;
  const OpInfo& info_of(const c10::OperatorHandle& op);
  // bounded: see StorageRuntime::plan.
  void regenerate(std::span<const TensorId> targets, bool bounded = true);
  std::int64_t param_of(const at::Tensor& t);
  void collect_inputs(const OpInfo& info, const torch::jit::Stack& stack, std::size_t first);
  // The recipe of the op that just ran on `args` (batch norm's running
  // stats, with scratch, taken out as copies to write into).
  std::shared_ptr<OpRecipe> make_recipe(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                                        const OpInfo& info, torch::jit::Stack&& args, bool scratch) const;
  void run_handle(const c10::OperatorHandle& op, const OpInfo& info, c10::DispatchKeySet below,
                  torch::jit::Stack* stack);
  // Tells every provider which session routes ops now (this or nullptr).
  void notify_providers(ActivationRoom* routing);

  // Recursive: a provider's callback (Python) may set the threshold or read
  // the counters while an op holds the session.
  std::recursive_mutex mu_;
  // Op facts per schema; recipes point at their names, so infos_ outlives
  // runtime_ (declared first) and a replaced entry is kept (retired_).
  std::unordered_map<const c10::FunctionSchema*, std::unique_ptr<OpInfo>> infos_;
  std::vector<std::unique_ptr<OpInfo>> retired_;
  ArbiterSet arbiters_;  // the providers' arbiters; runtime_ points at it
  StorageRuntime runtime_;
  std::vector<std::shared_ptr<ParamProvider>> providers_;
  std::function<void()> after_op_;
  std::function<void(std::exception_ptr)> rethrow_;
  std::function<bool(const std::exception&)> is_oom_;
  bool is_oom(const std::exception& e) const;
  // Per-op scratch, reused (the session is locked while an op runs).
  struct InputRef {
    std::uint32_t arg = 0;
    std::int32_t element = -1;  // index in a tensor list, -1 for a tensor argument
    std::int32_t slot = -1;     // index in inputs_, or -1 for a parameter
    std::int64_t param = -1;
  };
  std::vector<InputRef> refs_;
  std::vector<at::Tensor> inputs_;
  std::vector<at::Tensor> param_inputs_;
  std::vector<TensorId> ids_;
  std::vector<TensorId> missing_;
  std::vector<at::Tensor> outputs_;
  bool activated_here_ = false;
  const std::string* last_op_ = nullptr;  // owned by infos_
  std::unordered_map<std::string, OpCounters> counters_;
  PlanCounters plans_;
};

// Whether the fallback can own DispatchKey::Fake in this process: "" when
// it can, else why not (another fallback there, ops with kernels on it).
std::string interception_status();

// Excludes the key on this thread while alive (tidal.dtr.outside()).
class OutsideGuard {
 public:
  OutsideGuard();
  ~OutsideGuard();
  OutsideGuard(const OutsideGuard&) = delete;
  OutsideGuard& operator=(const OutsideGuard&) = delete;

 private:
  bool was_excluded_;
};

}  // namespace tidal::hooks::dtr
