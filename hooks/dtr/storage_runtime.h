// The libtorch side of the activation rematerializer: the storages. The
// bookkeeping and the choice of evictees live in runtime/dtr (no libtorch);
// this class owns the storages and turns the core's decisions into memory
// being freed and refilled. Two drivers call it: the dispatch-key
// interceptor next to it (hooks/dtr/interceptor.h, Note [DTR on a dispatch
// key]) and, as the fallback where that key is unavailable, tidal.dtr's
// Python TorchDispatchMode (through python/csrc/dtr_bindings.cpp). No Python
// here: GoogleTest drives it (tests/cpp/hooks/dtr/).
//
// Note [DTR at the storage level]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A record stands for one c10::StorageImpl: every view of it (and every
// tensor autograd saved for backward) shares that StorageImpl, so
//   * eviction swaps the storage's DataPtr for an empty one (the memory goes
//     back to the allocator; the StorageImpl and all its tensors stay valid
//     objects with their sizes, strides, offsets and version counters);
//   * rematerialization replays the recipe into fresh tensors and moves the
//     fresh storage's DataPtr into the old StorageImpl: no copy, no version
//     bump, autograd's saved tensors see the data again;
//   * the runtime holds a strong reference to each recorded StorageImpl, so
//     "no user reference left" is use_count() == 1. sweep() finds those:
//     the core decides fake deletion (keep the recipe, drop the memory) or
//     real deletion, and a locked tensor without a recipe keeps its memory
//     while a dependant still needs it.
// Tensors DTR did not produce (parameters, inputs) get "external" records:
// never evicted, not counted in tracked bytes, held while a recipe reads them.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/StorageImpl.h>
#include <c10/util/SmallVector.h>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <span>
#include <string>
#include <string_view>
#include <typeinfo>
#include <memory_resource>
#include <unordered_map>
#include <vector>

#include "runtime/dtr/rematerializer.h"

namespace torch::autograd {
struct Node;
}

namespace tidal::hooks::dtr {

using tidal::dtr::OpId;
using tidal::dtr::TensorId;

// What replaying an op runs. The runtime only keeps it (and drops it when
// the op's record is released); its driver knows its type.
struct Recipe {
  virtual ~Recipe() = default;
};
using RecipePtr = std::shared_ptr<const Recipe>;

// The core's counters (evictions, recomputes and recompute seconds summed
// over every clear()), and the storage runtime's own.
struct RuntimeStats : tidal::dtr::DtrStats {
  std::size_t max_op_working_set = 0;
  std::size_t held_storages = 0;
  std::size_t recipes = 0;
  std::uint64_t chunk_evictions = 0;  // evictions the arbiter gave to a chunk instead
  std::size_t chunk_bytes_freed = 0;
};

// One record, for tests and debugging.
struct RecordView {
  TensorId id = tidal::dtr::kNoTensor;
  std::size_t bytes = 0;
  std::string state;  // "resident", "evicted", "deleted"
  bool alive = false;
  bool locked = false;
  bool external = false;
  int pins = 0;
  std::size_t recipe_length = 0;
  long use_count = 0;
};

// Note [What DTR tracks]
// ~~~~~~~~~~~~~~~~~~~~~~
// DTR is for activations: what autograd keeps from the forward pass for
// backward, and what backward makes on the way. An op's fresh outputs are
// recorded (tracked, counted against eviction_threshold, evictable) when the
// op runs with grad mode on or inside a backward pass (the autograd engine
// runs backward with grad mode off). Outputs of ops run under no_grad (or
// inference mode) outside backward are not recorded: torch.optim's steps
// (a step runs under no_grad unless the optimizer is differentiable),
// gradient clipping, EMA and metric updates, evaluation. They are what a
// program keeps across steps (an optimizer's exp_avg, a momentum buffer) or
// uses once; autograd saves none of them. Recorded, an optimizer's state was
// locked the first time its step updated it in place after reading it, and
// counted against the threshold from then on: with the two-line switch left
// on for the whole loop, a model whose optimizer state exceeded the
// threshold failed at its first opt.step() ("nothing more can be evicted"),
// and one just under it left DTR too little room and thrashed. An output
// not recorded becomes external when an op reads it (as a parameter: never
// evicted, not counted, held while a recipe reads it).
// Ops under no_grad still pass through DTR: their evicted inputs are brought
// back (an evaluation that reads an evicted activation), and an in-place
// update of a tracked or external tensor first regenerates, then locks, what
// was computed from the old value (Note [DTR records]), so no recipe ever
// replays a value that is gone.
// The cost: what a forward pass under no_grad makes is not evicted, so such
// an inference is not bounded by eviction_threshold. Its activations die at
// the next op, except those a model keeps (skip connections); with grad mode
// on and no tensor requiring grad, DTR tracks them and autograd saves nothing.
bool records_outputs_now();

// Note [DTR gives up rather than thrash]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// When eviction_threshold leaves less room than the ops need at once, DTR
// evicts what the next op reads, replays it, evicts it again: a chain of N
// layers costs O(N^2) replays in backward, and a run the issue measured took
// 510 s for three LSTM steps (0.8 s without DTR) with 793,442 recomputes. DTR
// counts, per training step (from the end of one backward pass to the end of
// the next), the ops it intercepted and the ops it replayed; a regeneration
// that would take the replays above max_recompute_ratio (default 10) times
// the step's ops (this step's so far, or the previous step's if larger: the
// first ops of a step may bring back tensors of the last one) is not run:
// tidal.OutOfMemoryError names the replays, the ops and the threshold, and
// suggests a larger threshold. A regeneration replays each recorded op at
// most once, so what exceeds several times the step's ops is the same
// tensors replayed over and over. 0 turns the bound off (the op-table tests,
// which evict everything after every op on purpose).

// Note [The arbiter between chunks and activations]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Under the training engine chunks and activations share the device budget
// less the margin; DTR's threshold is what the chunks held on the device
// leave (DeviceRoom::dtr_threshold). When DTR has to evict, the arbiter
// compares per byte, for each eviction: the activation DTR would evict
// costs its regeneration (Rematerializer::regeneration_cost, measured op
// times) over its bytes; moving a chunk off the device costs its copy out
// now and back later, 2 / link bandwidth per byte. The cheaper one goes: a
// chunk leaves (the scheduler picks which, by its trace), which raises DTR's
// threshold by what it freed, or the activation is evicted. Chunks in use
// by the running module (COMPUTE) cannot leave, and the running op's tensors
// are pinned, so its working set stays reserved.
// No process global ties a runtime to an engine: a session learns the
// arbiters of the engines that registered with it (ParamProvider::arbiter()
// in interceptor.h) and sets its runtime's arbiter (set_arbiter(), an
// ArbiterSet over them); the engine learns the session routing ops from
// ParamProvider::session_changed().
class ChunkArbiter {
 public:
  virtual ~ChunkArbiter() = default;
  // Seconds per byte of moving a chunk off the device now and back later;
  // infinity when none can go or the link is not measured.
  virtual double chunk_seconds_per_byte() const = 0;
  // Moves chunk memory off the device, raising DTR's threshold; the bytes
  // freed (0: none could go).
  virtual std::size_t evict_chunk() = 0;
};
// What an engine asks of the DTR session routing ops (either interception:
// the C++ Session, or the runtime of the Python mode): room made by
// evicting activations, and the threshold the arbiter sets. The engine is
// told which one routes ops now (ParamProvider::session_changed).
class ActivationRoom {
 public:
  virtual ~ActivationRoom() = default;
  virtual void set_eviction_threshold(std::size_t bytes) = 0;
  // Evicts the best candidate now; false when nothing can be evicted.
  virtual bool evict_one() = 0;
  virtual std::size_t tracked_bytes() = 0;
  virtual double best_eviction_seconds_per_byte() = 0;
  // A chunk left the device for this session's allocation, by the arbiter's choice.
  virtual void count_chunk_eviction(std::size_t bytes) = 0;
};

// The arbiters of every engine registered with one session, held weakly (an
// engine may go first): the cheapest chunk is the one priced, and moved.
// Not thread-safe: used under its session's lock.
class ArbiterSet final : public ChunkArbiter {
 public:
  // `owner` names the entry for remove() (the engine's parameter provider).
  void add(const void* owner, std::weak_ptr<ChunkArbiter> arbiter);
  void remove(const void* owner);
  // The lowest price of the live arbiters; remembers whose it was.
  double chunk_seconds_per_byte() const override;
  // Moves a chunk of the arbiter the last price came from (priced again
  // first when none is remembered).
  std::size_t evict_chunk() override;

 private:
  std::vector<std::pair<const void*, std::weak_ptr<ChunkArbiter>>> items_;
  mutable std::weak_ptr<ChunkArbiter> priced_;
};

class StorageRuntime {
 public:
  explicit StorageRuntime(tidal::dtr::DtrOptions options) : core_(options) {}
  ~StorageRuntime() { clear(); }
  StorageRuntime(const StorageRuntime&) = delete;
  StorageRuntime& operator=(const StorageRuntime&) = delete;

  const tidal::dtr::DtrOptions& options() const { return core_.options(); }
  void set_eviction_threshold(std::size_t bytes) { core_.set_eviction_threshold(bytes); }
  // The arbiter asked at each eviction (Note [The arbiter between chunks and
  // activations]); nullptr: activations only. Not owned.
  void set_arbiter(ChunkArbiter* arbiter) { arbiter_ = arbiter; }

  // Registers unknown inputs as external, pins and touches every input.
  // *ids gets one id per input (kNoTensor for tensors without storage),
  // *missing the ids that are not resident.
  void begin_op(std::span<const at::Tensor> inputs, std::vector<TensorId>* ids, std::vector<TensorId>* missing);

  // Ops to replay, in order, so that `targets` are resident. A tensor a step
  // brings back stays pinned only until the last step of the plan that
  // reads it, so a deep regeneration holds O(width) memory. `bounded`: the
  // plan counts against max_recompute_ratio, and one that would exceed it
  // throws tidal::OutOfMemoryError instead (Note [DTR gives up rather than
  // thrash]); bringing tensors back when DTR is turned off is not bounded.
  struct PlanItem {
    OpId op = -1;
    const Recipe* recipe = nullptr;
    std::vector<TensorId> chained;
  };
  std::vector<PlanItem> plan(std::span<const TensorId> targets, bool bounded = true);
  // The recipe's flat inputs, rebuilt as views of their (resident) storages.
  std::vector<at::Tensor> replay_inputs(OpId op) const;
  // item.op was replayed into `outputs` (its flat outputs) in `seconds`.
  void replayed(const PlanItem& item, std::span<const at::Tensor> outputs, double seconds);
  void end_plan();

  // Records an op that ran on `inputs` (ids from begin_op) and returned
  // `outputs`; outputs whose storage is new are its fresh results. The
  // recipe is kept only when the op can be replayed. Returns the op or -1.
  // `last_resort`: the op runs in a backward pass (Note [Last-resort
  // candidates]); its fresh outputs that are parameters' gradients are
  // settled at once (Note [Gradients are optimizer inputs]), for both
  // interceptions.
  OpId record(std::span<const at::Tensor> inputs, std::span<const TensorId> ids,
              std::span<const at::Tensor> outputs, double seconds, bool replayable, RecipePtr recipe,
              bool last_resort);

  // Whether any of `outputs` has a storage no record holds (record() would
  // record something).
  bool has_fresh(std::span<const at::Tensor> outputs) const;

  tidal::dtr::MutationPlan prepare_mutation(TensorId target, bool replayable) const {
    return core_.prepare_mutation(target, replayable);
  }
  // An in-place op updated `target`. With chain, it joins target's recipe.
  void commit_mutation(TensorId target, bool chain, std::span<const at::Tensor> inputs,
                       std::span<const TensorId> ids, double seconds, RecipePtr recipe);

  // Unpins the op's tensors, evicts down to the threshold, and checks that
  // tracked bytes stay within threshold + this op's working set (throws
  // tidal::OutOfMemoryError naming the op otherwise, when the op added
  // tracked bytes: Note [One budget error per overrun]).
  void end_op(std::string_view op_name);
  // Drops the op's pins after an error (no checks, no evictions).
  void abandon_op();

  // While an in-place update is being prepared, the tensors its preparation
  // found resident or brought back must stay so until commit_mutation().
  void set_hold_evictions(bool hold) { hold_evictions_ = hold; }
  // The in-place op is about to run: its preparation is done. Pins what
  // reads the targets' old values (Rematerializer::mutation_readers) until
  // end_op() and lets evictions go on for anything else (Note [Evictions
  // while an in-place op runs] in runtime/dtr/rematerializer.cpp).
  void run_mutation(std::span<const TensorId> targets);
  // Frees one candidate; false when none is left (an allocation failed).
  bool evict_one();
  // The regeneration cost per byte of the tensor evict_one() would evict, or
  // infinity when there is none (Note [The arbiter between chunks and
  // activations]).
  double best_eviction_seconds_per_byte();
  // A chunk left the device for an allocation of this session's (the
  // engine's room maker, by the arbiter's choice): counted as evict_to_threshold counts its own.
  void count_chunk_eviction(std::size_t bytes) {
    ++chunk_evictions_;
    chunk_bytes_freed_ += bytes;
  }

  // Evicted tensors a user can still reach.
  std::vector<TensorId> evicted_alive();
  // Drops every record (counters carry over). Tensors still evicted stay
  // without data: bring them back first.
  void clear();

  RuntimeStats stats();
  void reset_peak() {
    core_.reset_peak();
    max_working_set_ = 0;
  }
  std::size_t tracked_bytes() const { return core_.stats_tracked_bytes(); }
  // Checks every invariant (the core's and the storage maps'); throws InternalError.
  void validate() const;

  // t became an optimizer input (Note [Gradients are optimizer inputs]):
  // its record, if any, is no longer tracked or evicted. False when it is
  // evicted (it stays an activation).
  bool settle(const at::Tensor& t);

  // The record of t's storage, or kNoTensor.
  TensorId lookup(const at::Tensor& t) const;
  std::string state_of(TensorId id) const;
  std::size_t bytes_of(TensorId id) const { return core_.contains(id) ? core_.tensor(id).bytes : 0; }
  std::vector<RecordView> records() const;
  // Test hook: evict this tensor's record now (it must be a candidate).
  void evict_tensor(const at::Tensor& t);
  // Test hook: evicts every candidate now (the op-table tests force
  // evictions after every op with it); returns how many.
  std::size_t evict_all();
  // The recipe of the op that produced `id` (nullptr: none kept).
  const Recipe* producer_recipe(TensorId id) const;
  // Called with each tensor about to be evicted (counters).
  void set_on_evict(std::function<void(TensorId)> fn) { on_evict_ = std::move(fn); }

 private:
  using StoragePtr = c10::intrusive_ptr<c10::StorageImpl>;
  // How to rebuild one input of a recipe as a view of its record's storage.
  struct InputMeta {
    TensorId id = tidal::dtr::kNoTensor;
    c10::SmallVector<int64_t, 5> sizes;  // no allocation up to 5 dimensions
    c10::SmallVector<int64_t, 5> strides;
    int64_t offset = 0;
    at::ScalarType dtype = at::kFloat;
    // Lazy conjugation and negation are bits of the view, not of the
    // storage: a kernel that handles them itself (polar's backward reads a
    // conjugated view) must get them back in a replay.
    bool conj = false;
    bool neg = false;
  };
  // Most ops read one to three tensors: inline, no allocation per op.
  using InputMetas = c10::SmallVector<InputMeta, 3>;
  struct Replay {
    InputMetas inputs;                   // flat inputs, in the order the recipe's slots use
    c10::SmallVector<std::size_t, 2> fresh_at;  // position in the flat outputs of each core output
    RecipePtr recipe;
  };

  TensorId id_of(const at::Tensor& t, bool register_external);
  // Into *out: those of `outputs` that the backward op running now makes as
  // parameters' gradients (none outside backward).
  void parameter_gradients(std::span<const at::Tensor> outputs, std::vector<at::Tensor>* out);
  bool is_view_node(const torch::autograd::Node& n);
  static InputMetas metas(std::span<const at::Tensor> inputs, std::span<const TensorId> ids);
  std::vector<TensorId> distinct_inputs(OpId op) const;  // op's inputs, each once
  void register_storage(TensorId id, StoragePtr ptr);
  void forget_storage(TensorId id);
  void install(TensorId id, const at::Tensor& fresh);
  void evict(TensorId id);
  void evict_to_threshold();
  std::size_t pinned_bytes() const;
  void drop_if_unreferenced(TensorId id);
  void sweep();
  void drain_released();

  tidal::dtr::Rematerializer core_;
  // Map nodes from a pool, as the core's (declared first: destroyed last).
  std::pmr::unsynchronized_pool_resource pool_;
  std::pmr::unordered_map<TensorId, StoragePtr> storage_{&pool_};
  std::pmr::unordered_map<c10::StorageImpl*, TensorId> by_storage_{&pool_};
  std::pmr::unordered_map<OpId, Replay> replays_{&pool_};
  std::vector<TensorId> op_pins_;
  std::vector<TensorId> plan_pins_;
  std::unordered_map<TensorId, int> plan_uses_;  // remaining plan steps reading a tensor
  std::vector<TensorId> dead_;
  // Per-op scratch, kept for its capacity: record()'s and drain_released()'s.
  std::vector<std::size_t> out_bytes_;
  std::vector<TensorId> core_inputs_;
  std::vector<TensorId> out_ids_;
  std::vector<TensorId> released_tensors_;
  std::vector<OpId> released_ops_;
  mutable std::vector<TensorId> pinned_seen_;  // pinned_bytes()' scratch
  std::vector<at::Tensor> gradients_;          // record()'s scratch, empty between ops
  // Autograd node types that are views, by type_info address (a type seen
  // through two addresses is only classified twice): hashing a type_index
  // hashes its name, on every edge of every backward op.
  std::unordered_map<const std::type_info*, bool> view_nodes_;
  std::size_t max_working_set_ = 0;
  std::size_t tracked_at_begin_ = 0;  // tracked bytes when the running op began
  // Note [DTR gives up rather than thrash]: ops begun and ops replayed since
  // the last backward pass ended (a training step), and the ops of the step
  // before.
  std::uint64_t step_ops_ = 0;
  std::uint64_t step_recomputes_ = 0;
  std::uint64_t previous_step_ops_ = 0;
  bool in_backward_ = false;
  void check_recompute_bound(std::size_t plan_steps) const;
  bool hold_evictions_ = false;
  ChunkArbiter* arbiter_ = nullptr;
  std::function<void(TensorId)> on_evict_;
  std::uint64_t chunk_evictions_ = 0;
  std::size_t chunk_bytes_freed_ = 0;
  std::uint64_t base_evictions_ = 0;
  std::uint64_t base_recomputes_ = 0;
  double base_recompute_seconds_ = 0.0;
};

}  // namespace tidal::hooks::dtr
