// tidal._C.dtr: the libtorch side of the activation rematerializer. The
// bookkeeping and the choice of evictees live in runtime/dtr (no libtorch);
// this file owns the storages and turns the core's decisions into memory
// being freed and refilled. python/tidal/dtr.py intercepts ops with a
// TorchDispatchMode and calls Runtime once or twice per op.
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
//   * the Runtime holds a strong reference to each recorded StorageImpl, so
//     "no user reference left" is use_count() == 1. sweep() finds those:
//     the core decides fake deletion (keep the recipe, drop the memory) or
//     real deletion, and a locked tensor without a recipe keeps its memory
//     while a dependant still needs it.
// Tensors DTR did not produce (parameters, inputs) get "external" records:
// never evicted, not counted in tracked bytes, held while a recipe reads them.
#include <ATen/ATen.h>
#include <c10/core/StorageImpl.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "python/csrc/bindings.h"
#include "runtime/core/error.h"
#include "runtime/core/units.h"
#include "runtime/dtr/rematerializer.h"

namespace tidal::python {
namespace {

namespace d = tidal::dtr;
using StoragePtr = c10::intrusive_ptr<c10::StorageImpl>;

// How to rebuild one input of a recipe as a view of its record's storage.
struct InputMeta {
  d::TensorId id = d::kNoTensor;
  std::vector<int64_t> sizes;
  std::vector<int64_t> strides;
  int64_t offset = 0;
  at::ScalarType dtype = at::kFloat;
};

struct Replay {
  std::vector<InputMeta> inputs;     // flat inputs, in the order the recipe's slots use
  std::vector<std::size_t> fresh_at; // position in the flat outputs of each core output
  py::object recipe;                 // Python: (func, args template, kwargs template, rng, ...)
};

class Runtime {
 public:
  explicit Runtime(d::DtrOptions options) : core_(options) {}

  ~Runtime() { clear(); }

  void set_eviction_threshold(std::size_t bytes) { core_.set_eviction_threshold(bytes); }

  // Registers unknown inputs as external, pins and touches every input.
  // Returns (ids, ids that are not resident). -1 for tensors without storage.
  py::tuple begin_op(const std::vector<at::Tensor>& inputs) {
    sweep();
    core_.tick();
    std::vector<d::TensorId> ids;
    std::vector<d::TensorId> missing;
    ids.reserve(inputs.size());
    for (const at::Tensor& t : inputs) {
      const d::TensorId id = id_of(t, /*register_external=*/true);
      ids.push_back(id);
      if (id == d::kNoTensor) continue;
      core_.access(id);
      core_.pin(id);
      op_pins_.push_back(id);
      if (core_.tensor(id).state != d::TensorState::kResident &&
          std::find(missing.begin(), missing.end(), id) == missing.end()) {
        missing.push_back(id);
      }
    }
    return py::make_tuple(py::cast(ids), py::cast(missing));
  }

  // Ops to replay so that `targets` are resident: [(op, recipe, chained)].
  // A tensor a step brings back stays pinned only until the last step of
  // the plan that reads it, so a deep regeneration holds O(width) memory.
  py::list plan(const std::vector<d::TensorId>& targets) {
    py::list out;
    plan_uses_.clear();
    // Targets stay pinned until end_plan(): the caller is about to use them.
    for (d::TensorId t : targets) ++plan_uses_[t];
    for (auto& step : core_.regeneration_plan(targets)) {
      std::vector<d::TensorId> ins = core_.op(step.op).inputs;
      std::sort(ins.begin(), ins.end());
      ins.erase(std::unique(ins.begin(), ins.end()), ins.end());
      for (d::TensorId in : ins) ++plan_uses_[in];
      out.append(py::make_tuple(step.op, replays_.at(step.op).recipe, py::cast(step.chained)));
    }
    // Inputs that are resident already must stay so until their last reader
    // ran: evictions between steps must not take them.
    for (const auto& [id, uses] : plan_uses_) {
      if (core_.tensor(id).state == d::TensorState::kResident) {
        core_.pin(id);
        plan_pins_.push_back(id);
      }
    }
    return out;
  }

  // The recipe's flat inputs, rebuilt as views of their (resident) storages.
  std::vector<at::Tensor> replay_inputs(d::OpId op) {
    const Replay& r = replays_.at(op);
    std::vector<at::Tensor> out;
    out.reserve(r.inputs.size());
    for (const InputMeta& m : r.inputs) {
      auto it = storage_.find(m.id);
      TIDAL_INTERNAL_ASSERT(it != storage_.end() && core_.tensor(m.id).state == d::TensorState::kResident,
                            "input ", m.id, " of op ", op, " is not resident for replay");
      c10::Storage storage(it->second);
      at::Tensor t = at::empty({0}, at::TensorOptions().dtype(m.dtype).device(storage.device()));
      t.set_(storage, m.offset, m.sizes, m.strides);
      out.push_back(std::move(t));
    }
    return out;
  }

  // step.op was replayed into `outputs` (its flat outputs) in `seconds`.
  void replayed(d::OpId op, const std::vector<d::TensorId>& chained, const std::vector<at::Tensor>& outputs,
                double seconds) {
    const Replay& r = replays_.at(op);
    d::Rematerializer::PlanStep step{op, chained};
    const auto& core_outputs = core_.op(op).outputs;
    for (d::TensorId id : core_.on_replayed(step, seconds)) {
      const auto k = static_cast<std::size_t>(
          std::find(core_outputs.begin(), core_outputs.end(), id) - core_outputs.begin());
      TIDAL_INTERNAL_ASSERT(k < r.fresh_at.size() && r.fresh_at[k] < outputs.size(), "replay of op ", op,
                            " returned ", outputs.size(), " outputs, output ", k, " missing");
      install(id, outputs[r.fresh_at[k]]);
      auto it = plan_uses_.find(id);
      if (it != plan_uses_.end() && it->second > 0) {
        core_.pin(id);
        plan_pins_.push_back(id);
      }
    }
    // A replay's working set: what the op being prepared pins, what the plan
    // still needs, and this step's results.
    max_working_set_ = std::max(max_working_set_, pinned_bytes());
    // Inputs that no later step reads are released (and dropped at once if
    // they were regenerated only for this plan).
    std::vector<d::TensorId> ins = core_.op(op).inputs;
    std::sort(ins.begin(), ins.end());
    ins.erase(std::unique(ins.begin(), ins.end()), ins.end());
    for (d::TensorId in : ins) {
      auto it = plan_uses_.find(in);
      if (it == plan_uses_.end() || --it->second > 0) continue;
      auto pit = std::find(plan_pins_.begin(), plan_pins_.end(), in);
      if (pit == plan_pins_.end()) continue;
      plan_pins_.erase(pit);
      core_.unpin(in);
      drop_if_unreferenced(in);
    }
    drain_released();
    evict_to_threshold();
  }

  void end_plan() {
    for (d::TensorId id : plan_pins_) core_.unpin(id);
    plan_pins_.clear();
    plan_uses_.clear();
    sweep();
  }

  // Records an op that ran on `inputs` (ids from begin_op) and returned
  // `outputs`; outputs whose storage is new are its fresh results.
  int64_t record(const std::vector<at::Tensor>& inputs, const std::vector<d::TensorId>& ids,
                 const std::vector<at::Tensor>& outputs, double seconds, bool replayable, py::object recipe,
                 bool last_resort) {
    std::vector<std::size_t> fresh_at;
    std::vector<std::size_t> bytes;
    std::unordered_set<c10::StorageImpl*> seen;
    for (std::size_t i = 0; i < outputs.size(); ++i) {
      const at::Tensor& t = outputs[i];
      if (!t.defined() || !t.has_storage()) continue;
      c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
      if (by_storage_.count(impl) != 0 || !seen.insert(impl).second) continue;  // a view of a known storage
      fresh_at.push_back(i);
      bytes.push_back(impl->nbytes());
    }
    if (fresh_at.empty()) return -1;
    bool can_replay = replayable;
    for (d::TensorId id : ids) can_replay = can_replay && id != d::kNoTensor;
    std::vector<d::TensorId> core_inputs;
    for (d::TensorId id : ids) {
      if (id != d::kNoTensor) core_inputs.push_back(id);
    }
    std::vector<d::TensorId> out_ids;
    const d::OpId op = core_.record_op(core_inputs, bytes, seconds, can_replay, &out_ids, last_resort);
    for (std::size_t k = 0; k < out_ids.size(); ++k) {
      const at::Tensor& t = outputs[fresh_at[k]];
      register_storage(out_ids[k], StoragePtr::reclaim_copy(t.storage().unsafeGetStorageImpl()));
      op_pins_.push_back(out_ids[k]);
      core_.pin(out_ids[k]);
    }
    Replay r;
    r.fresh_at = std::move(fresh_at);
    if (can_replay) {
      r.inputs = metas(inputs, ids);
      r.recipe = std::move(recipe);
    }
    replays_.emplace(op, std::move(r));
    return op;
  }

  py::tuple prepare_mutation(d::TensorId target, bool replayable) {
    auto plan = core_.prepare_mutation(target, replayable);
    return py::make_tuple(plan.chain, py::cast(plan.regenerate));
  }

  // An in-place op updated `target`. With chain, it joins target's recipe.
  void commit_mutation(d::TensorId target, bool chain, const std::vector<at::Tensor>& inputs,
                       const std::vector<d::TensorId>& ids, double seconds, py::object recipe) {
    d::MutationPlan plan;
    plan.chain = chain;
    std::vector<d::TensorId> core_inputs;
    for (d::TensorId id : ids) {
      if (id != d::kNoTensor && id != target) core_inputs.push_back(id);
    }
    const d::OpId op = core_.commit_mutation(target, core_inputs, seconds, chain, plan);
    if (op >= 0) {
      Replay r;
      r.inputs = metas(inputs, ids);
      r.recipe = std::move(recipe);
      replays_.emplace(op, std::move(r));
    }
  }

  // Unpins the op's tensors, evicts down to the threshold, and checks that
  // tracked bytes stay within threshold + this op's working set.
  void end_op(const std::string& op_name) {
    // Evict before unpinning: the op's inputs and outputs are its working
    // set, and the next op is likely to read its outputs.
    drain_released();
    evict_to_threshold();
    const std::size_t working_set = pinned_bytes();
    max_working_set_ = std::max(max_working_set_, working_set);
    const std::size_t threshold = core_.options().eviction_threshold;
    const std::size_t tracked = core_.stats_tracked_bytes();  // stats() scans every record
    for (d::TensorId id : op_pins_) core_.unpin(id);
    op_pins_.clear();
    drain_released();
    if (threshold > 0 && tracked > threshold + working_set) {
      const auto s = core_.stats();
      TIDAL_THROW(OutOfMemoryError, "DTR cannot keep tracked memory within eviction_threshold=",
                  format_bytes(threshold), " after ", op_name, " (working set ", format_bytes(working_set),
                  "): ", format_bytes(tracked), " stay tracked and nothing more can be evicted (",
                  format_bytes(s.locked_bytes), " locked: no recipe or updated in place; tensors under evictee_minimum_size=",
                  format_bytes(core_.options().evictee_minimum_size),
                  " are never evicted). Tip: raise eviction_threshold or lower evictee_minimum_size.");
    }
  }

  // While an in-place update is being prepared, the tensors its preparation
  // found resident or brought back must stay so until commit_mutation().
  void set_hold_evictions(bool hold) { hold_evictions_ = hold; }

  // Frees one candidate; false when none is left (used when an allocation fails).
  bool evict_one() {
    if (hold_evictions_) return false;  // an in-place update is being prepared
    const d::TensorId e = core_.choose_evictee();
    if (e == d::kNoTensor) return false;
    evict(e);
    return true;
  }

  // Evicted tensors a user can still reach (dead storages are swept first:
  // no op may have run since their last reference went).
  std::vector<d::TensorId> evicted_alive() {
    sweep();
    std::vector<d::TensorId> out;
    for (const auto& [id, ptr] : storage_) {
      const auto& rec = core_.tensor(id);
      if (rec.alive && rec.state == d::TensorState::kEvicted) out.push_back(id);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // Drops every record. Tensors still evicted stay without data: bring
  // them back first (tidal.dtr.disable() does).
  void clear() {
    storage_.clear();
    by_storage_.clear();
    replays_.clear();
    op_pins_.clear();
    plan_pins_.clear();
    const auto opts = core_.options();
    const auto s = core_.stats();
    base_evictions_ += s.evictions;
    base_recomputes_ += s.recomputes;
    base_recompute_seconds_ += s.recompute_seconds;
    core_ = d::Rematerializer(opts);
  }

  py::dict stats() {
    sweep();
    const auto s = core_.stats();
    py::dict out;
    out["evictions"] = base_evictions_ + s.evictions;
    out["recomputes"] = base_recomputes_ + s.recomputes;
    out["recompute_seconds"] = base_recompute_seconds_ + s.recompute_seconds;
    out["tracked_bytes"] = s.tracked_bytes;
    out["peak_tracked_bytes"] = s.peak_tracked_bytes;
    out["max_op_working_set"] = max_working_set_;
    out["live_tensors"] = s.live_tensors;
    out["live_ops"] = s.live_ops;
    out["fake_deleted"] = s.fake_deleted;
    out["locked_bytes"] = s.locked_bytes;
    out["held_storages"] = storage_.size();
    out["recipes"] = replays_.size();
    return out;
  }

  void reset_peak() {
    core_.reset_peak();
    max_working_set_ = 0;
  }

  void validate() {
    core_.validate();
    for (const auto& [id, ptr] : storage_) {
      TIDAL_INTERNAL_ASSERT(core_.contains(id), "storage held for released tensor ", id);
      const auto& rec = core_.tensor(id);
      if (rec.state == d::TensorState::kResident) {
        TIDAL_INTERNAL_ASSERT(ptr->nbytes() == rec.bytes, "resident tensor ", id, " holds ", ptr->nbytes(),
                              " bytes, recorded ", rec.bytes);
      } else {
        TIDAL_INTERNAL_ASSERT(ptr->nbytes() == 0, "evicted tensor ", id, " still holds memory");
      }
      auto it = by_storage_.find(ptr.get());
      TIDAL_INTERNAL_ASSERT(it != by_storage_.end() && it->second == id, "storage map out of sync for ", id);
    }
    TIDAL_INTERNAL_ASSERT(by_storage_.size() == storage_.size(), "storage maps differ in size");
  }

  // The record of t's storage, or -1.
  d::TensorId lookup(const at::Tensor& t) { return id_of(t, false); }

  std::string state_of(d::TensorId id) const {
    if (!core_.contains(id)) return "released";
    switch (core_.tensor(id).state) {
      case d::TensorState::kResident: return "resident";
      case d::TensorState::kEvicted: return "evicted";
      case d::TensorState::kDeleted: return "deleted";
    }
    return "?";
  }

  // Every record, for tests and debugging: (id, bytes, state, alive, locked, external, pins, recipe length).
  py::list records() const {
    py::list out;
    for (const auto& [id, ptr] : storage_) {
      const auto& r = core_.tensor(id);
      out.append(py::make_tuple(id, r.bytes, state_of(id), r.alive, r.locked, r.external, r.pins,
                                r.recipe.size(), ptr.use_count()));
    }
    return out;
  }

  // Test hook: evict this tensor's record now (it must be a candidate).
  void evict_tensor(const at::Tensor& t) {
    const d::TensorId id = id_of(t, false);
    TIDAL_CHECK(id != d::kNoTensor, "tensor is not tracked by DTR");
    evict(id);
  }

 private:
  d::TensorId id_of(const at::Tensor& t, bool register_external) {
    if (!t.defined() || !t.has_storage()) return d::kNoTensor;
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    auto it = by_storage_.find(impl);
    if (it != by_storage_.end()) return it->second;
    if (!register_external) return d::kNoTensor;
    const d::TensorId id = core_.add_external(impl->nbytes());
    register_storage(id, StoragePtr::reclaim_copy(impl));
    return id;
  }

  std::vector<InputMeta> metas(const std::vector<at::Tensor>& inputs, const std::vector<d::TensorId>& ids) {
    std::vector<InputMeta> out;
    out.reserve(inputs.size());
    for (std::size_t i = 0; i < inputs.size(); ++i) {
      const at::Tensor& t = inputs[i];
      InputMeta m;
      m.id = ids[i];
      m.sizes = t.sizes().vec();
      m.strides = t.strides().vec();
      m.offset = t.storage_offset();
      m.dtype = t.scalar_type();
      out.push_back(std::move(m));
    }
    return out;
  }

  void register_storage(d::TensorId id, StoragePtr ptr) {
    by_storage_[ptr.get()] = id;
    storage_[id] = std::move(ptr);
  }

  void forget_storage(d::TensorId id) {
    auto it = storage_.find(id);
    if (it == storage_.end()) return;
    by_storage_.erase(it->second.get());
    storage_.erase(it);  // may free the memory
  }

  // Gives the fresh tensor's memory to the record's storage (or adopts the
  // fresh storage when the old one is gone: a fake-deleted record).
  void install(d::TensorId id, const at::Tensor& fresh) {
    c10::StorageImpl* src = fresh.storage().unsafeGetStorageImpl();
    auto it = storage_.find(id);
    if (it == storage_.end()) {
      register_storage(id, StoragePtr::reclaim_copy(src));
      return;
    }
    c10::StorageImpl* dst = it->second.get();
    const std::size_t want = core_.tensor(id).bytes;
    TIDAL_INTERNAL_ASSERT(src->nbytes() == want, "replay produced ", src->nbytes(), " bytes for tensor ", id,
                          ", recorded ", want);
    at::DataPtr data = src->set_data_ptr(at::DataPtr(nullptr, src->device()));
    src->set_nbytes(0);
    dst->set_data_ptr_noswap(std::move(data));
    dst->set_nbytes(want);
  }

  void evict(d::TensorId id) {
    c10::StorageImpl* impl = storage_.at(id).get();
    core_.evict(id);
    impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
    impl->set_nbytes(0);
  }

  // Evicts while the unpinned part of tracked memory is above the threshold:
  // pinned tensors (the working set of the op now running or being
  // replayed) may add to it, evicting others would not make them fit.
  void evict_to_threshold() {
    const std::size_t threshold = core_.options().eviction_threshold;
    if (hold_evictions_ || !core_.over_threshold()) return;
    const std::size_t pinned = pinned_bytes();
    while (core_.stats_tracked_bytes() > threshold + pinned) {
      const d::TensorId e = core_.choose_evictee();
      if (e == d::kNoTensor) break;
      evict(e);
    }
  }

  std::size_t pinned_bytes() const {
    std::unordered_set<d::TensorId> counted;
    std::size_t total = 0;
    for (const auto* list : {&op_pins_, &plan_pins_}) {
      for (d::TensorId id : *list) {
        const auto& rec = core_.tensor(id);
        if (!rec.external && rec.state == d::TensorState::kResident && counted.insert(id).second) {
          total += rec.bytes;
        }
      }
    }
    return total;
  }

  void drop_if_unreferenced(d::TensorId id) {
    auto it = storage_.find(id);
    if (it == storage_.end() || !core_.contains(id)) return;
    if (it->second.use_count() == 1 && core_.tensor(id).pins == 0 && !core_.on_storage_dead(id)) {
      forget_storage(id);
    }
  }

  // Finds storages no user references any more (only our handle is left).
  void sweep() {
    drain_released();
    dead_.clear();
    for (const auto& [id, ptr] : storage_) {
      // Also re-offers dead records we hold (regenerated temporaries, locked
      // tensors kept for a dependant): the core decides again.
      if (ptr.use_count() == 1 && core_.tensor(id).pins == 0) dead_.push_back(id);
    }
    for (d::TensorId id : dead_) {
      if (!core_.contains(id)) continue;
      if (!core_.on_storage_dead(id)) forget_storage(id);
    }
    drain_released();
  }

  void drain_released() {
    for (d::TensorId id : core_.take_released_tensors()) forget_storage(id);
    for (d::OpId op : core_.take_released_ops()) replays_.erase(op);
  }

  d::Rematerializer core_;
  std::unordered_map<d::TensorId, StoragePtr> storage_;
  std::unordered_map<c10::StorageImpl*, d::TensorId> by_storage_;
  std::unordered_map<d::OpId, Replay> replays_;
  std::vector<d::TensorId> op_pins_;
  std::vector<d::TensorId> plan_pins_;
  std::unordered_map<d::TensorId, int> plan_uses_;  // remaining plan steps reading a tensor
  std::vector<d::TensorId> dead_;
  std::size_t max_working_set_ = 0;
  bool hold_evictions_ = false;  // see set_hold_evictions()
  std::uint64_t base_evictions_ = 0;
  std::uint64_t base_recomputes_ = 0;
  double base_recompute_seconds_ = 0.0;
};

}  // namespace

void bind_dtr(py::module_& parent) {
  py::module_ m = parent.def_submodule("dtr", R"doc(
The libtorch side of DTR (dynamic tensor rematerialization). Users call
tidal.dtr (python/tidal/dtr.py); this module is its engine.)doc");
  m.def("parse_scorer", [](const std::string& name) { return std::string(d::scorer_name(d::parse_scorer(name))); },
        "Checks a scorer name ('dtr_eq', 'local', 'lru', 'size'); returns it.");
  py::class_<Runtime>(m, "Runtime", "Records, evicts and rematerializes storages for one DTR session.")
      .def(py::init([](std::size_t threshold, std::size_t minimum, bool sqrt_sampling, const std::string& scorer,
                       std::uint64_t seed) {
             d::DtrOptions o;
             o.eviction_threshold = threshold;
             o.evictee_minimum_size = minimum;
             o.enable_sqrt_sampling = sqrt_sampling;
             o.scorer = d::parse_scorer(scorer);
             o.seed = seed;
             return std::make_unique<Runtime>(o);
           }),
           py::arg("eviction_threshold"), py::arg("evictee_minimum_size"), py::arg("enable_sqrt_sampling"),
           py::arg("scorer") = "dtr_eq", py::arg("seed") = 0x5eed)
      .def("set_eviction_threshold", &Runtime::set_eviction_threshold)
      .def("begin_op", &Runtime::begin_op)
      .def("plan", &Runtime::plan)
      .def("replay_inputs", &Runtime::replay_inputs)
      .def("replayed", &Runtime::replayed)
      .def("end_plan", &Runtime::end_plan)
      .def("record", &Runtime::record)
      .def("prepare_mutation", &Runtime::prepare_mutation)
      .def("commit_mutation", &Runtime::commit_mutation)
      .def("end_op", &Runtime::end_op)
      .def("evict_one", &Runtime::evict_one)
      .def("set_hold_evictions", &Runtime::set_hold_evictions)
      .def("evicted_alive", &Runtime::evicted_alive)
      .def("clear", &Runtime::clear)
      .def("stats", &Runtime::stats)
      .def("reset_peak", &Runtime::reset_peak)
      .def("validate", &Runtime::validate)
      .def("lookup", &Runtime::lookup)
      .def("state_of", &Runtime::state_of)
      .def("records", &Runtime::records)
      .def("evict_tensor", &Runtime::evict_tensor);
}

}  // namespace tidal::python
