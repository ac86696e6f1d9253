#include "hooks/dtr/storage_runtime.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>  // torch::autograd::Node (node.h only from torch 2.12)

#include <algorithm>
#include <atomic>
#include <limits>
#include <sstream>
#include <typeinfo>
#include <utility>

#include "runtime/core/error.h"
#include "runtime/core/units.h"

namespace tidal::hooks::dtr {

namespace d = tidal::dtr;

bool records_outputs_now() {
  return c10::GradMode::is_enabled() || torch::autograd::get_current_graph_task_id() != -1;
}

void ArbiterSet::add(const void* owner, std::weak_ptr<ChunkArbiter> arbiter) {
  remove(owner);  // (and forgets the last price)
  items_.emplace_back(owner, std::move(arbiter));
}

void ArbiterSet::remove(const void* owner) {
  std::erase_if(items_, [owner](const auto& item) { return item.first == owner; });
  priced_.reset();
}

double ArbiterSet::chunk_seconds_per_byte() const {
  double best = std::numeric_limits<double>::infinity();
  priced_.reset();
  for (const auto& [owner, weak] : items_) {
    const std::shared_ptr<ChunkArbiter> a = weak.lock();
    if (a == nullptr) continue;
    const double price = a->chunk_seconds_per_byte();
    if (price < best) {
      best = price;
      priced_ = a;
    }
  }
  return best;
}

std::size_t ArbiterSet::evict_chunk() {
  if (priced_.expired()) chunk_seconds_per_byte();
  const std::shared_ptr<ChunkArbiter> a = priced_.lock();
  priced_.reset();
  return a == nullptr ? 0 : a->evict_chunk();
}

void StorageRuntime::begin_op(std::span<const at::Tensor> inputs, std::vector<TensorId>* ids,
                              std::vector<TensorId>* missing) {
  sweep();
  core_.tick();
  tracked_at_begin_ = core_.stats_tracked_bytes();
  // A backward pass ended: a new training step begins (Note [DTR gives up
  // rather than thrash]).
  const bool backward = torch::autograd::get_current_graph_task_id() != -1;
  if (in_backward_ && !backward) {
    previous_step_ops_ = step_ops_;
    step_ops_ = 0;
    step_recomputes_ = 0;
  }
  in_backward_ = backward;
  ++step_ops_;
  ids->clear();
  missing->clear();
  ids->reserve(inputs.size());
  for (const at::Tensor& t : inputs) {
    const TensorId id = id_of(t, /*register_external=*/true);
    ids->push_back(id);
    if (id == d::kNoTensor) continue;
    core_.access(id);
    core_.pin(id);
    op_pins_.push_back(id);
    if (core_.tensor(id).state != d::TensorState::kResident &&
        std::find(missing->begin(), missing->end(), id) == missing->end()) {
      missing->push_back(id);
    }
  }
}

void StorageRuntime::check_recompute_bound(std::size_t plan_steps) const {
  const double ratio = core_.options().max_recompute_ratio;
  if (ratio <= 0) return;
  const std::uint64_t ops = std::max(step_ops_, previous_step_ops_);
  const std::uint64_t replays = step_recomputes_ + plan_steps;
  if (static_cast<double>(replays) <= ratio * static_cast<double>(ops)) return;
  const std::size_t threshold = core_.options().eviction_threshold;
  std::ostringstream why;
  why << "tidal.dtr gave up: bringing back the inputs of the next op would replay " << plan_steps
      << " ops, after " << step_recomputes_ << " replayed already in this training step: " << replays
      << " recomputes, more than max_recompute_ratio=" << ratio << " x " << ops
      << " ops (the step's own ops so far, or the previous step's if more). ";
  if (threshold > 0) {
    why << "eviction_threshold=" << format_bytes(threshold)
        << " leaves too little room for what the ops need at once (the largest working set of one op so far "
           "was "
        << format_bytes(max_working_set_)
        << "), and DTR recomputes the same tensors over and over. Tip: raise eviction_threshold, to at least "
        << format_bytes(std::max(2 * threshold, threshold + max_working_set_)) << " for a start";
  } else {
    why << "eviction_threshold=0 (evictions only when an allocation fails): the memory left is too small for "
           "what the ops need at once, and DTR recomputes the same tensors over and over. Tip: free memory or "
           "lower the batch size";
  }
  why << "; or raise tidal.dtr.max_recompute_ratio (0: no bound) if this much recomputation is intended.";
  TIDAL_THROW(OutOfMemoryError, why.str());
}

std::vector<StorageRuntime::PlanItem> StorageRuntime::plan(std::span<const TensorId> targets, bool bounded) {
  auto steps = core_.regeneration_plan(targets);
  if (bounded) check_recompute_bound(steps.size());  // before any state changes
  std::vector<PlanItem> out;
  plan_uses_.clear();
  // Targets stay pinned until end_plan(): the caller is about to use them.
  for (TensorId t : targets) ++plan_uses_[t];
  for (auto& step : steps) {
    for (TensorId in : distinct_inputs(step.op)) ++plan_uses_[in];
    out.push_back(PlanItem{step.op, replays_.at(step.op).recipe.get(), std::move(step.chained)});
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

std::vector<TensorId> StorageRuntime::distinct_inputs(OpId op) const {
  const auto& inputs = core_.op(op).inputs;
  std::vector<TensorId> ins(inputs.begin(), inputs.end());
  std::sort(ins.begin(), ins.end());
  ins.erase(std::unique(ins.begin(), ins.end()), ins.end());
  return ins;
}

std::vector<at::Tensor> StorageRuntime::replay_inputs(OpId op) const {
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
    if (m.conj) t._set_conj(true);
    if (m.neg) t._set_neg(true);
    out.push_back(std::move(t));
  }
  return out;
}

void StorageRuntime::replayed(const PlanItem& item, std::span<const at::Tensor> outputs, double seconds) {
  const Replay& r = replays_.at(item.op);
  ++step_recomputes_;
  d::Rematerializer::PlanStep step{item.op, item.chained};
  const auto& core_outputs = core_.op(item.op).outputs;
  for (TensorId id : core_.on_replayed(step, seconds)) {
    const auto k = static_cast<std::size_t>(std::find(core_outputs.begin(), core_outputs.end(), id) -
                                            core_outputs.begin());
    TIDAL_INTERNAL_ASSERT(k < r.fresh_at.size() && r.fresh_at[k] < outputs.size(), "replay of op ", item.op,
                          " returned ", outputs.size(), " outputs, output ", k, " missing");
    TIDAL_INTERNAL_ASSERT(outputs[r.fresh_at[k]].defined() && outputs[r.fresh_at[k]].has_storage(), "replay of op ",
                          item.op, " returned no tensor at output ", r.fresh_at[k],
                          ", which it returned when recorded (Note [What a replay restores])");
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
  for (TensorId in : distinct_inputs(item.op)) {
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

void StorageRuntime::end_plan() {
  for (TensorId id : plan_pins_) core_.unpin(id);
  plan_pins_.clear();
  plan_uses_.clear();
  sweep();
}

OpId StorageRuntime::record(std::span<const at::Tensor> inputs, std::span<const TensorId> ids,
                            std::span<const at::Tensor> outputs, double seconds, bool replayable,
                            RecipePtr recipe, bool last_resort) {
  // Before the outputs are registered: a gradient is a fresh output.
  if (last_resort) parameter_gradients(outputs, &gradients_);
  c10::SmallVector<std::size_t, 2> fresh_at;
  std::vector<std::size_t>& bytes = out_bytes_;
  bytes.clear();
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    const at::Tensor& t = outputs[i];
    if (!t.defined() || !t.has_storage()) continue;
    c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
    if (by_storage_.count(impl) != 0) continue;  // a view of a known storage
    bool seen = false;
    for (std::size_t j : fresh_at) seen = seen || outputs[j].storage().unsafeGetStorageImpl() == impl;
    if (seen) continue;
    fresh_at.push_back(i);
    bytes.push_back(impl->nbytes());
  }
  if (fresh_at.empty()) {
    gradients_.clear();
    return -1;
  }
  bool can_replay = replayable;
  std::vector<TensorId>& core_inputs = core_inputs_;
  core_inputs.clear();
  for (TensorId id : ids) {
    can_replay = can_replay && id != d::kNoTensor;
    if (id != d::kNoTensor) core_inputs.push_back(id);
  }
  std::vector<TensorId>& out_ids = out_ids_;
  out_ids.clear();
  const OpId op = core_.record_op(core_inputs, bytes, seconds, can_replay, &out_ids, last_resort);
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
  if (last_resort) {
    for (const at::Tensor& g : gradients_) settle(g);
    gradients_.clear();  // no reference kept: the gradient's owner decides when it dies
  }
  return op;
}

// The fresh outputs of the backward op running now that are gradients of
// parameters (Note [Gradients are optimizer inputs] in
// runtime/dtr/rematerializer.cpp):
// the autograd node running the op has an edge to a parameter's
// AccumulateGrad, directly or through view nodes (nn.Linear's weight.t(), a
// reshape), and the output has that parameter's dtype and number of
// elements. A temporary of that size inside such a node would be settled
// too (never evicted, no longer tracked): that costs memory accounting, not
// exactness.
bool StorageRuntime::is_view_node(const torch::autograd::Node& n) {
  const std::type_info* type = &typeid(n);
  auto it = view_nodes_.find(type);
  if (it != view_nodes_.end()) return it->second;
  const std::string name = n.name();
  bool view = false;
  for (const char* v : {"TBackward", "ViewBackward", "UnsafeViewBackward", "TransposeBackward", "PermuteBackward",
                        "ExpandBackward", "SqueezeBackward", "UnsqueezeBackward", "AliasBackward", "ReshapeAlias"}) {
    view = view || name.rfind(v, 0) == 0;
  }
  view_nodes_.emplace(type, view);
  return view;
}

void StorageRuntime::parameter_gradients(std::span<const at::Tensor> outputs, std::vector<at::Tensor>* out) {
  out->clear();
  const auto node = torch::autograd::get_current_node();
  if (!node) return;
  for (const auto& edge : node->next_edges()) {
    const torch::autograd::Node* n = edge.function.get();
    // (typeid, not dynamic_cast: torch derives nothing from AccumulateGrad,
    // and this runs on every edge of every backward op.)
    auto is_accumulate = [](const torch::autograd::Node* node) {
      return typeid(*node) == typeid(torch::autograd::AccumulateGrad);
    };
    for (int hop = 0; n != nullptr && hop < 4 && !is_accumulate(n); ++hop) {
      n = is_view_node(*n) && n->next_edges().size() == 1 ? n->next_edges()[0].function.get() : nullptr;
    }
    if (n == nullptr || !is_accumulate(n)) continue;
    const auto* acc = static_cast<const torch::autograd::AccumulateGrad*>(n);
    const at::Tensor& param = acc->variable;
    for (const at::Tensor& o : outputs) {
      if (o.defined() && o.has_storage() && lookup(o) == d::kNoTensor &&
          o.scalar_type() == param.scalar_type() && o.numel() == param.numel()) {
        out->push_back(o);
      }
    }
  }
}


bool StorageRuntime::has_fresh(std::span<const at::Tensor> outputs) const {
  for (const at::Tensor& t : outputs) {
    if (t.defined() && t.has_storage() && by_storage_.count(t.storage().unsafeGetStorageImpl()) == 0) return true;
  }
  return false;
}

void StorageRuntime::commit_mutation(TensorId target, bool chain, std::span<const at::Tensor> inputs,
                                     std::span<const TensorId> ids, double seconds, RecipePtr recipe) {
  // A kernel that resized its target's storage (addbmm_ on a self that
  // broadcasts resizes it to the result, below the dispatcher) left a value
  // that the target's recipe, replayed, would not fit: lock it, at its new
  // size. (A chain plan means no op has read the target, so nothing else
  // needs locking.)
  auto it = storage_.find(target);
  if (it != storage_.end() && it->second->nbytes() != core_.tensor(target).bytes) {
    core_.resize(target, it->second->nbytes());
    chain = false;
  }
  d::MutationPlan plan;
  plan.chain = chain;
  std::vector<TensorId> core_inputs;
  for (TensorId id : ids) {
    if (id != d::kNoTensor && id != target) core_inputs.push_back(id);
  }
  const OpId op = core_.commit_mutation(target, core_inputs, seconds, chain, plan);
  if (op >= 0) {
    Replay r;
    r.inputs = metas(inputs, ids);
    r.recipe = std::move(recipe);
    replays_.emplace(op, std::move(r));
  }
}

// Note [One budget error per overrun]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// After each op, tracked bytes must fit within eviction_threshold plus the
// op's working set; where evicting every candidate cannot make them fit,
// the op raises tidal.OutOfMemoryError. Only an op that added tracked bytes
// raises it. An op that added none did not cause the overrun, and raising
// there repeated the first error under another op's name: when an error
// unwinds through torch.autograd.profiler.record_function (every torch.optim
// step is wrapped in one), its exit is an op (profiler::_record_function_
// exit), and the traceback ended in a second copy of the error. The error
// names what cannot be evicted (the op's working set, locked tensors, tensors
// under evictee_minimum_size) and the threshold that would hold them.
void StorageRuntime::end_op(std::string_view op_name) {
  // Evict before unpinning: the op's inputs and outputs are its working
  // set, and the next op is likely to read its outputs.
  drain_released();
  evict_to_threshold();
  const std::size_t working_set = pinned_bytes();
  max_working_set_ = std::max(max_working_set_, working_set);
  const std::size_t threshold = core_.options().eviction_threshold;
  const std::size_t tracked = core_.stats_tracked_bytes();  // stats() scans every record
  // See Note [One budget error per overrun].
  const bool overrun = threshold > 0 && tracked > threshold + working_set && tracked > tracked_at_begin_;
  std::size_t locked = 0, small = 0;
  if (overrun) core_.unevictable_bytes(&locked, &small);  // before the op's pins go
  for (TensorId id : op_pins_) core_.unpin(id);
  op_pins_.clear();
  drain_released();
  if (overrun) {
    TIDAL_THROW(OutOfMemoryError, "DTR cannot keep tracked memory within eviction_threshold=",
                format_bytes(threshold), " after ", op_name, ": ", format_bytes(tracked),
                " stay tracked and nothing more can be evicted. Of these, ", format_bytes(working_set),
                " are this op's working set (its inputs and outputs, kept while it runs), ",
                format_bytes(locked),
                " are locked (made by ops DTR does not replay, or computed from a tensor an in-place update "
                "changed after it was read) and ",
                format_bytes(small), " are tensors under evictee_minimum_size=",
                format_bytes(core_.options().evictee_minimum_size),
                ", which are never evicted. Tip: an eviction_threshold of at least ",
                format_bytes(tracked - working_set),
                " fits what cannot be evicted now; or lower evictee_minimum_size. What ops under torch.no_grad() "
                "make (an optimizer's state) is not tracked.");
  }
}

void StorageRuntime::abandon_op() {
  hold_evictions_ = false;
  for (TensorId id : op_pins_) {
    if (core_.contains(id)) core_.unpin(id);
  }
  op_pins_.clear();
  drain_released();
}

void StorageRuntime::run_mutation(std::span<const TensorId> targets) {
  for (TensorId target : targets) {
    for (TensorId id : core_.mutation_readers(target)) {
      core_.pin(id);
      op_pins_.push_back(id);  // end_op() and abandon_op() unpin them
    }
  }
  hold_evictions_ = false;
}

bool StorageRuntime::evict_one() {
  if (hold_evictions_) return false;  // an in-place update is being prepared
  const TensorId e = core_.choose_evictee();
  if (e == d::kNoTensor) return false;
  evict(e);
  return true;
}

double StorageRuntime::best_eviction_seconds_per_byte() {
  if (hold_evictions_) return std::numeric_limits<double>::infinity();
  const TensorId e = core_.choose_evictee();
  if (e == d::kNoTensor) return std::numeric_limits<double>::infinity();
  return core_.regeneration_cost(e) / static_cast<double>(std::max<std::size_t>(bytes_of(e), 1));
}

std::vector<TensorId> StorageRuntime::evicted_alive() {
  sweep();
  std::vector<TensorId> out;
  for (const auto& [id, ptr] : storage_) {
    const auto& rec = core_.tensor(id);
    if (rec.alive && rec.state == d::TensorState::kEvicted) out.push_back(id);
  }
  std::sort(out.begin(), out.end());
  return out;
}

void StorageRuntime::clear() {
  storage_.clear();
  by_storage_.clear();
  replays_.clear();
  op_pins_.clear();
  plan_pins_.clear();
  plan_uses_.clear();
  const auto opts = core_.options();
  const auto s = core_.stats();
  base_evictions_ += s.evictions;
  base_recomputes_ += s.recomputes;
  base_recompute_seconds_ += s.recompute_seconds;
  core_ = d::Rematerializer(opts);
}

RuntimeStats StorageRuntime::stats() {
  sweep();
  RuntimeStats out;
  static_cast<d::DtrStats&>(out) = core_.stats();
  out.evictions += base_evictions_;
  out.recomputes += base_recomputes_;
  out.recompute_seconds += base_recompute_seconds_;
  out.max_op_working_set = max_working_set_;
  out.held_storages = storage_.size();
  out.recipes = replays_.size();
  out.chunk_evictions = chunk_evictions_;
  out.chunk_bytes_freed = chunk_bytes_freed_;
  return out;
}

void StorageRuntime::validate() const {
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

TensorId StorageRuntime::lookup(const at::Tensor& t) const {
  if (!t.defined() || !t.has_storage()) return d::kNoTensor;
  auto it = by_storage_.find(t.storage().unsafeGetStorageImpl());
  return it == by_storage_.end() ? d::kNoTensor : it->second;
}

bool StorageRuntime::settle(const at::Tensor& t) {
  const TensorId id = lookup(t);
  return id == d::kNoTensor || core_.settle(id);
}

std::string StorageRuntime::state_of(TensorId id) const {
  if (!core_.contains(id)) return "released";
  switch (core_.tensor(id).state) {
    case d::TensorState::kResident: return "resident";
    case d::TensorState::kEvicted: return "evicted";
    case d::TensorState::kDeleted: return "deleted";
  }
  return "?";
}

std::vector<RecordView> StorageRuntime::records() const {
  std::vector<RecordView> out;
  for (const auto& [id, ptr] : storage_) {
    const auto& r = core_.tensor(id);
    out.push_back(RecordView{id, r.bytes, state_of(id), r.alive, r.locked, r.external, r.pins, r.recipe.size(),
                             static_cast<long>(ptr.use_count())});
  }
  std::sort(out.begin(), out.end(), [](const RecordView& a, const RecordView& b) { return a.id < b.id; });
  return out;
}

void StorageRuntime::evict_tensor(const at::Tensor& t) {
  const TensorId id = lookup(t);
  TIDAL_CHECK(id != d::kNoTensor, "tensor is not tracked by DTR");
  evict(id);
}

std::size_t StorageRuntime::evict_all() {
  std::size_t n = 0;
  while (evict_one()) ++n;
  return n;
}

TensorId StorageRuntime::id_of(const at::Tensor& t, bool register_external) {
  if (!t.defined() || !t.has_storage()) return d::kNoTensor;
  c10::StorageImpl* impl = t.storage().unsafeGetStorageImpl();
  auto it = by_storage_.find(impl);
  if (it != by_storage_.end()) return it->second;
  if (!register_external) return d::kNoTensor;
  const TensorId id = core_.add_external(impl->nbytes());
  register_storage(id, StoragePtr::reclaim_copy(impl));
  return id;
}

StorageRuntime::InputMetas StorageRuntime::metas(std::span<const at::Tensor> inputs,
                                                 std::span<const TensorId> ids) {
  InputMetas out;
  out.reserve(inputs.size());
  for (std::size_t i = 0; i < inputs.size(); ++i) {
    const at::Tensor& t = inputs[i];
    InputMeta m;
    m.id = ids[i];
    m.sizes.assign(t.sizes().begin(), t.sizes().end());
    m.strides.assign(t.strides().begin(), t.strides().end());
    m.offset = t.storage_offset();
    m.dtype = t.scalar_type();
    m.conj = t.is_conj();
    m.neg = t.is_neg();
    out.push_back(std::move(m));
  }
  return out;
}

void StorageRuntime::register_storage(TensorId id, StoragePtr ptr) {
  by_storage_[ptr.get()] = id;
  storage_[id] = std::move(ptr);
}

void StorageRuntime::forget_storage(TensorId id) {
  auto it = storage_.find(id);
  if (it == storage_.end()) return;
  by_storage_.erase(it->second.get());
  storage_.erase(it);  // may free the memory
}

// Gives the fresh tensor's memory to the record's storage (or adopts the
// fresh storage when the old one is gone: a fake-deleted record).
void StorageRuntime::install(TensorId id, const at::Tensor& fresh) {
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

const Recipe* StorageRuntime::producer_recipe(TensorId id) const {
  if (!core_.contains(id) || core_.tensor(id).recipe.empty()) return nullptr;
  auto it = replays_.find(core_.tensor(id).recipe.front());
  return it == replays_.end() ? nullptr : it->second.recipe.get();
}

void StorageRuntime::evict(TensorId id) {
  if (on_evict_) on_evict_(id);
  c10::StorageImpl* impl = storage_.at(id).get();
  core_.evict(id);
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, impl->device()));
  impl->set_nbytes(0);
}

// Evicts while the unpinned part of tracked memory is above the threshold:
// pinned tensors (the working set of the op now running or being replayed)
// may add to it, evicting others would not make them fit.
// Note [The arbiter between chunks and activations]: with an arbiter, each
// eviction goes to whichever costs less per byte.
void StorageRuntime::evict_to_threshold() {
  if (hold_evictions_ || !core_.over_threshold()) return;
  const std::size_t pinned = pinned_bytes();
  ChunkArbiter* arbiter = arbiter_;
  // The threshold is read again each round: a chunk leaving raises it.
  while (core_.options().eviction_threshold > 0 &&
         core_.stats_tracked_bytes() > core_.options().eviction_threshold + pinned) {
    const TensorId e = core_.choose_evictee();
    // The chunk's price first: with no link known it is infinite, and the
    // activation's (a regeneration plan) is not worth computing.
    const double chunk = arbiter != nullptr ? arbiter->chunk_seconds_per_byte()
                                            : std::numeric_limits<double>::infinity();
    if (chunk < std::numeric_limits<double>::infinity()) {
      const double activation = e == d::kNoTensor ? std::numeric_limits<double>::infinity()
                                                  : core_.regeneration_cost(e) /
                                                        static_cast<double>(std::max<std::size_t>(bytes_of(e), 1));
      if (chunk < activation) {
        const std::size_t freed = arbiter->evict_chunk();
        if (freed > 0) {
          ++chunk_evictions_;
          chunk_bytes_freed_ += freed;
          continue;
        }
      }
    }
    if (e == d::kNoTensor) break;
    evict(e);
  }
}

std::size_t StorageRuntime::pinned_bytes() const {
  // A handful of pins per op: a linear check beats a hash set's allocation.
  pinned_seen_.clear();
  std::size_t total = 0;
  for (const auto* list : {&op_pins_, &plan_pins_}) {
    for (TensorId id : *list) {
      const auto& rec = core_.tensor(id);
      if (rec.external || rec.state != d::TensorState::kResident) continue;
      if (std::find(pinned_seen_.begin(), pinned_seen_.end(), id) != pinned_seen_.end()) continue;
      pinned_seen_.push_back(id);
      total += rec.bytes;
    }
  }
  return total;
}

void StorageRuntime::drop_if_unreferenced(TensorId id) {
  auto it = storage_.find(id);
  if (it == storage_.end() || !core_.contains(id)) return;
  if (it->second.use_count() == 1 && core_.tensor(id).pins == 0 && !core_.on_storage_dead(id)) {
    forget_storage(id);
  }
}

// Finds storages no user references any more (only our handle is left).
void StorageRuntime::sweep() {
  drain_released();
  dead_.clear();
  for (const auto& [id, ptr] : storage_) {
    // Also re-offers dead records we hold (regenerated temporaries, locked
    // tensors kept for a dependant): the core decides again.
    if (ptr.use_count() == 1 && core_.tensor(id).pins == 0) dead_.push_back(id);
  }
  for (TensorId id : dead_) {
    if (!core_.contains(id)) continue;
    if (!core_.on_storage_dead(id)) forget_storage(id);
  }
  drain_released();
}

void StorageRuntime::drain_released() {
  if (!core_.has_released()) return;
  core_.take_released_tensors(&released_tensors_);
  for (TensorId id : released_tensors_) forget_storage(id);
  core_.take_released_ops(&released_ops_);
  for (OpId op : released_ops_) replays_.erase(op);
}

}  // namespace tidal::hooks::dtr
