// The activation rematerializer's bookkeeping: which tensors exist, how each
// can be recomputed, which are resident, and which to evict next. It holds
// no memory and runs no ops: the caller (python/csrc/dtr_bindings.cpp for
// libtorch) frees storages when told a tensor is evicted, replays the ops of
// a regeneration plan, and reports back. No libtorch, no Python, so it is
// tested on its own (tests/cpp/runtime/dtr/).
//
// Note [DTR records]
// ~~~~~~~~~~~~~~~~~~
// A tensor record stands for one storage (a view group: every view of a
// storage is evicted and restored with it). Its recipe is a list of ops: the
// op that produced it, then the in-place ops applied to it since (replayed
// in order). An op reads `inputs` and produces `outputs` (fresh storages) or,
// for an in-place op in a recipe, mutates `target`.
//   state     kResident (memory held), kEvicted (memory freed, recipe kept),
//             kDeleted (no user reference is left and no memory is held).
//   alive     some user reference (a Python tensor, a tensor autograd saved)
//             still exists. A dead record is kept as a "fake deletion"
//             while a live op reads it, since its dependants may need it to
//             be recomputed; it is really deleted, cascading to its own
//             inputs, once no live op reads it.
//   locked    never evicted: external tensors (parameters, inputs made
//             outside DTR), outputs of ops that must not be replayed, and
//             tensors whose recipe an in-place update invalidated. A dead but
//             still needed locked tensor keeps its memory (keep_storage).
//   pins      > 0 while the op now running (or a regeneration) uses it.
// An op is live while one of its results (outputs, or target) is not really
// deleted; `users` of a tensor are the live ops that read it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <memory_resource>
#include <unordered_map>
#include <vector>

#include "runtime/dtr/dtr_options.h"
#include "runtime/dtr/scorer.h"
#include "runtime/dtr/small_ids.h"

namespace tidal::dtr {

using TensorId = std::int64_t;
using OpId = std::int64_t;
inline constexpr TensorId kNoTensor = -1;

enum class TensorState : std::uint8_t { kResident, kEvicted, kDeleted };

struct TensorRecord {
  TensorId id = kNoTensor;
  std::size_t bytes = 0;
  bool external = false;  // made outside DTR: never evicted, not counted in tracked bytes
  bool alive = true;
  bool locked = false;
  int pins = 0;
  // Evicted only when no ordinary candidate is left: tensors made by the
  // backward pass (gradients), whose recipes run through the whole backward
  // chain. See Note [Last-resort candidates] in rematerializer.cpp.
  bool last_resort = false;
  TensorState state = TensorState::kResident;
  std::uint64_t last_access = 0;
  SmallIds<2> recipe;  // producer first, then in-place ops on it
  SmallIds<2> users;   // live ops that read this tensor
  int uf = -1;               // union-find node while in an evicted class
};

struct OpRecord {
  OpId id = -1;
  SmallIds<3> inputs;
  SmallIds<1> outputs;  // fresh storages; kNoTensor where one was settled
  TensorId target = kNoTensor;    // in-place op in target's recipe
  double cost = 0.0;              // seconds, measured when it first ran
  bool replayable = true;
  int live_results = 0;
};

struct DtrStats {
  std::uint64_t evictions = 0;
  std::uint64_t recomputes = 0;          // ops replayed
  double recompute_seconds = 0.0;        // measured time of the replays
  std::size_t tracked_bytes = 0;         // resident, non-external
  std::size_t peak_tracked_bytes = 0;
  std::size_t live_tensors = 0;          // records, including fake-deleted and external
  std::size_t live_ops = 0;
  std::size_t fake_deleted = 0;          // dead records kept for their dependants
  std::size_t locked_bytes = 0;          // resident, tracked and never evictable
};

// What an in-place update of a tracked or external tensor requires first.
struct MutationPlan {
  // true: the op joins the target's recipe (no live op has read the target).
  // false: the target and everything computed from it get locked.
  bool chain = false;
  // Evicted tensors that must be regenerated before the update: the target
  // itself, and those whose recipes read the value the update destroys.
  std::vector<TensorId> regenerate;
};

class Rematerializer {
 public:
  explicit Rematerializer(DtrOptions options = {});
  // The maps allocate from this object's pool: a moved-to object keeps its
  // own pool and moves the records into it (a move-constructed one would
  // point into the source's pool), so only move assignment exists.
  Rematerializer(const Rematerializer&) = delete;
  Rematerializer(Rematerializer&&) = delete;
  Rematerializer& operator=(const Rematerializer&) = delete;
  Rematerializer& operator=(Rematerializer&&) = default;

  const DtrOptions& options() const { return options_; }
  void set_eviction_threshold(std::size_t bytes) { options_.eviction_threshold = bytes; }

  // A tensor DTR did not produce (a parameter, an input). Resident, locked.
  TensorId add_external(std::size_t bytes);
  // A resident tensor DTR produced that became an optimizer input (a
  // parameter's .grad): from now on treated like an external one (not
  // tracked, never evicted, its recipe dropped). False when it is not
  // resident. See Note [Gradients are optimizer inputs].
  bool settle(TensorId t);

  // Records an op that read `inputs` and produced fresh storages of
  // `output_bytes`; returns the op and appends the new tensors to *outputs.
  // Non-replayable ops lock their outputs.
  OpId record_op(std::span<const TensorId> inputs, std::span<const std::size_t> output_bytes,
                 double cost_seconds, bool replayable, std::vector<TensorId>* outputs,
                 bool last_resort = false);

  // In-place update of `target` by an op reading `inputs` (target excluded).
  // prepare_mutation() before the op runs (regenerate what it lists), then
  // commit_mutation() with the same plan after it ran.
  MutationPlan prepare_mutation(TensorId target, bool op_replayable) const;
  OpId commit_mutation(TensorId target, std::span<const TensorId> inputs, double cost_seconds,
                       bool replayable, const MutationPlan& plan);
  // The resident tensors whose value is, or was computed from, target's
  // value now (target included): what commit_mutation() would lock. While
  // the op runs they must stay resident (pinned); anything else may be
  // evicted to make room for the op (Note [Evictions while an in-place op
  // runs]). Call after the plan's regenerations.
  std::vector<TensorId> mutation_readers(TensorId target) const;

  // An in-place op resized t's storage to `bytes` (t is resident).
  void resize(TensorId t, std::size_t bytes);

  // Advances the logical clock (one tick per op) and marks a use.
  void tick() { ++clock_; }
  void access(TensorId t);
  void pin(TensorId t);
  void unpin(TensorId t);

  // Ops to replay, in order, so that every target becomes resident. Walks
  // the recipes with an explicit stack (no recursion, any depth).
  // A step's op is replayed; `chained` lists its outputs whose recipe goes
  // on with in-place ops that the plan replays next (only those, and the
  // outputs without such ops, are installed: a chained output whose updates
  // are not replayed would hold a stale value).
  struct PlanStep {
    OpId op = -1;
    std::vector<TensorId> chained;
  };
  std::vector<PlanStep> regeneration_plan(std::span<const TensorId> targets) const;
  // Seconds of measured op time that bringing t back would replay if it
  // were evicted now: its whole plan, evicted and dead inputs included.
  double regeneration_cost(TensorId t) const;
  // The caller replayed step.op in `seconds`. Returns the outputs it must
  // install (now resident again); the others it discards.
  std::vector<TensorId> on_replayed(const PlanStep& step, double seconds);

  // The lowest-scoring eviction candidate, or kNoTensor.
  TensorId choose_evictee();
  // The caller freed t's memory.
  void evict(TensorId t);
  bool over_threshold() const {
    return options_.eviction_threshold > 0 && tracked_bytes_ > options_.eviction_threshold;
  }
  // Resident tracked bytes that are not pinned and not candidates: locked,
  // or (not locked) under evictee_minimum_size. For error messages.
  void unevictable_bytes(std::size_t* locked, std::size_t* small) const;
  std::size_t stats_tracked_bytes() const { return tracked_bytes_; }

  // The last user reference to t's storage is gone. Returns true when the
  // caller must keep the memory (t is locked, resident and still needed).
  bool on_storage_dead(TensorId t);

  // Tensors and ops really deleted since the last call: the caller drops
  // its storage handles and recipes for them. The list is swapped into
  // *out (emptied first), so both vectors keep their capacity: no
  // allocation per op.
  void take_released_tensors(std::vector<TensorId>* out);
  void take_released_ops(std::vector<OpId>* out);
  bool has_released() const { return !released_tensors_.empty() || !released_ops_.empty(); }

  bool contains(TensorId t) const { return tensors_.count(t) != 0; }
  const TensorRecord& tensor(TensorId t) const;
  const OpRecord& op(OpId o) const;
  DtrStats stats() const;
  void reset_peak() { peak_tracked_bytes_ = tracked_bytes_; }
  std::uint64_t clock() const { return clock_; }

  // Checks every invariant of Note [DTR records]; throws InternalError.
  void validate() const;

 private:
  // Calls visit(y, record) for every tensor computed from `target`'s value,
  // directly or through dead (fake-deleted) intermediates, which are walked
  // through and not visited: what prepare_mutation() and mutation_readers()
  // look at, and commit_mutation() locks.
  template <class F>
  void for_each_reader(TensorId target, F&& visit) const;

  TensorRecord& t_(TensorId t);
  OpRecord& o_(OpId o);
  bool is_candidate(const TensorRecord& r) const;
  double score(const TensorRecord& r) const;
  double last_resort_score(TensorId t, const TensorRecord& r) const;
  std::vector<PlanStep> plan_for(std::span<const TensorId> targets, TensorId assume_evicted) const;
  int uf_find(int node) const;
  void uf_join_evicted(TensorRecord& r);
  void add_resident_bytes(const TensorRecord& r);
  void try_release(TensorId t);
  void for_each_result(const OpRecord& o, auto&& fn) const;

  DtrOptions options_;
  std::unique_ptr<Scorer> scorer_;
  // The records' map nodes come from a pool: every op adds and, when its
  // results die, removes a few, and malloc's slow paths cost more per op
  // than the rest of the bookkeeping (declared first: destroyed last).
  struct Pool {  // each object's own: move assignment leaves it in place
    Pool() = default;
    Pool(const Pool&) = delete;
    Pool& operator=(Pool&&) noexcept { return *this; }
    std::pmr::unsynchronized_pool_resource resource;
  };
  Pool pool_;
  std::pmr::unordered_map<TensorId, TensorRecord> tensors_{&pool_.resource};
  std::pmr::unordered_map<OpId, OpRecord> ops_{&pool_.resource};
  std::vector<TensorId> resident_;                         // non-external resident tensors
  std::pmr::unordered_map<TensorId, std::size_t> resident_pos_{&pool_.resource};  // index into resident_
  // Union-find over evicted classes: parent and summed cost per node. Nodes
  // are reclaimed when no tensor record is left (see uf_join_evicted).
  mutable std::vector<int> uf_parent_;
  std::vector<double> uf_cost_;
  std::vector<TensorId> released_tensors_;
  std::vector<OpId> released_ops_;
  std::vector<TensorId> release_work_;  // try_release()'s worklist, kept for its capacity
  std::mt19937_64 rng_;
  TensorId next_tensor_ = 0;
  OpId next_op_ = 0;
  std::uint64_t clock_ = 1;
  std::size_t tracked_bytes_ = 0;
  std::size_t peak_tracked_bytes_ = 0;
  std::uint64_t evictions_ = 0;
  std::uint64_t recomputes_ = 0;
  double recompute_seconds_ = 0.0;
};

}  // namespace tidal::dtr
