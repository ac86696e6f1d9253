#include "runtime/dtr/rematerializer.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <unordered_set>

#include "runtime/core/error.h"

namespace tidal::dtr {

Rematerializer::Rematerializer(DtrOptions options)
    : options_(options), scorer_(make_scorer(options.scorer)), rng_(options.seed) {}

TensorRecord& Rematerializer::t_(TensorId t) {
  auto it = tensors_.find(t);
  TIDAL_INTERNAL_ASSERT(it != tensors_.end(), "unknown DTR tensor ", t);
  return it->second;
}

OpRecord& Rematerializer::o_(OpId o) {
  auto it = ops_.find(o);
  TIDAL_INTERNAL_ASSERT(it != ops_.end(), "unknown DTR op ", o);
  return it->second;
}

const TensorRecord& Rematerializer::tensor(TensorId t) const {
  return const_cast<Rematerializer*>(this)->t_(t);
}

const OpRecord& Rematerializer::op(OpId o) const { return const_cast<Rematerializer*>(this)->o_(o); }

// Results already really deleted are skipped: an op stays live while any
// one of its results does, so a multi-output op can outlive some outputs.
void Rematerializer::for_each_result(const OpRecord& o, auto&& fn) const {
  for (TensorId out : o.outputs) {
    if (tensors_.count(out) != 0) fn(out);
  }
  if (o.target != kNoTensor && tensors_.count(o.target) != 0) fn(o.target);
}

void Rematerializer::add_resident_bytes(const TensorRecord& r) {
  if (r.external) return;
  resident_pos_[r.id] = resident_.size();
  resident_.push_back(r.id);
  tracked_bytes_ += r.bytes;
  peak_tracked_bytes_ = std::max(peak_tracked_bytes_, tracked_bytes_);
}

namespace {

void remove_resident(std::vector<TensorId>& resident, std::pmr::unordered_map<TensorId, std::size_t>& pos,
                     TensorId t) {
  auto it = pos.find(t);
  TIDAL_INTERNAL_ASSERT(it != pos.end(), "tensor ", t, " is not in the resident list");
  const std::size_t i = it->second;
  pos.erase(it);
  if (i + 1 != resident.size()) {
    resident[i] = resident.back();
    pos[resident[i]] = i;
  }
  resident.pop_back();
}

void add_user_once(TensorRecord& r, OpId op) {
  if (std::find(r.users.begin(), r.users.end(), op) == r.users.end()) r.users.push_back(op);
}

}  // namespace

// Note [Gradients are optimizer inputs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A parameter's gradient is made in backward and lives in .grad until the
// optimizer reads it. Tracked like an activation, the gradients of a GPT are
// about 60% of the step's peak, so a budget of half the peak can only be kept
// by evicting gradients, and bringing one back replays the backward chain
// down to it and the forward pass under that (plans of 400 ops on the
// GPT-2-small shape: most of the recompute time at 50%). DTR is for
// activations: a parameter's gradient is settled as soon as the backward op
// that makes it has run (like a parameter: not tracked, never evicted). The
// storage runtime knows it, for both interceptions, from the autograd node
// running the op: an edge to that parameter's AccumulateGrad and an output
// of its shape (StorageRuntime::record in hooks/dtr/storage_runtime.cpp; the
// Python interception tracked gradients, and an optimizer's in-place update
// of a parameter then locked them, until it moved there). That includes the head's half of a tied embedding's
// gradient, which waits in autograd's input buffer for the other half until
// the end of backward. Under the training engine gradients land in their
// chunks at once and do not stay.
bool Rematerializer::settle(TensorId t) {
  TensorRecord& r = t_(t);
  if (r.external) return true;
  if (r.state != TensorState::kResident) return false;
  remove_resident(resident_, resident_pos_, t);
  tracked_bytes_ -= r.bytes;
  r.external = true;
  r.locked = true;
  r.last_resort = false;
  // Never evicted from now on, so its recipe is never replayed: the ops that
  // made it let go of it, and are released (with the records only they read,
  // a backward pass's worth) once nothing else needs them. Kept, they held
  // every tensor of the step that an in-place update had locked for as long
  // as the gradient lived.
  const auto recipe = std::move(r.recipe);
  r.recipe.clear();
  std::vector<TensorId> freed_inputs;
  for (OpId p : recipe) {
    OpRecord& o = o_(p);
    // The slot stays: drivers find an output by its position.
    for (TensorId& out : o.outputs) {
      if (out == t) out = kNoTensor;
    }
    if (o.target == t) o.target = kNoTensor;
    if (--o.live_results > 0) continue;
    for (TensorId in : o.inputs) {
      auto& users = t_(in).users;
      users.erase(std::remove(users.begin(), users.end(), p), users.end());
      freed_inputs.push_back(in);
    }
    ops_.erase(p);
    released_ops_.push_back(p);
  }
  for (TensorId in : freed_inputs) try_release(in);
  return true;
}

TensorId Rematerializer::add_external(std::size_t bytes) {
  const TensorId id = next_tensor_++;
  TensorRecord r;
  r.id = id;
  r.bytes = bytes;
  r.external = true;
  r.locked = true;
  r.last_access = clock_;
  tensors_.emplace(id, std::move(r));
  return id;
}

OpId Rematerializer::record_op(std::span<const TensorId> inputs, std::span<const std::size_t> output_bytes,
                               double cost_seconds, bool replayable, std::vector<TensorId>* outputs,
                               bool last_resort) {
  TIDAL_INTERNAL_ASSERT(!output_bytes.empty(), "an op without fresh outputs has nothing to record");
  const OpId id = next_op_++;
  OpRecord o;
  o.id = id;
  o.inputs.assign(inputs.begin(), inputs.end());
  o.cost = cost_seconds;
  o.replayable = replayable;
  for (TensorId in : o.inputs) add_user_once(t_(in), id);
  for (std::size_t bytes : output_bytes) {
    const TensorId t = next_tensor_++;
    TensorRecord r;
    r.id = t;
    r.bytes = bytes;
    r.locked = !replayable;
    r.last_resort = last_resort;
    r.last_access = clock_;
    r.recipe.push_back(id);
    auto& stored = tensors_.emplace(t, std::move(r)).first->second;
    add_resident_bytes(stored);
    o.outputs.push_back(t);
    if (outputs != nullptr) outputs->push_back(t);
  }
  o.live_results = static_cast<int>(o.outputs.size());
  ops_.emplace(id, std::move(o));
  return id;
}

MutationPlan Rematerializer::prepare_mutation(TensorId target, bool op_replayable) const {
  const TensorRecord& r = tensor(target);
  MutationPlan plan;
  plan.chain = !r.external && !r.locked && op_replayable && r.users.empty() &&
               r.state == TensorState::kResident;
  if (plan.chain) return plan;
  // The op writes into the target, so its memory must be there: a target
  // that is not also an input (batch norm's running statistics, which
  // native_batch_norm updates without declaring it) was not brought back
  // with the op's inputs.
  if (r.state == TensorState::kEvicted) plan.regenerate.push_back(target);
  // Every evicted tensor whose recipe reads the old value, directly or
  // through dead (fake-deleted) intermediates, must come back now.
  for_each_reader(target, [&](TensorId y, const TensorRecord& ry) {
    if (ry.state == TensorState::kEvicted) plan.regenerate.push_back(y);
  });
  return plan;
}

template <class F>
void Rematerializer::for_each_reader(TensorId target, F&& visit) const {
  std::unordered_set<TensorId> seen{target};
  std::vector<TensorId> work{target};
  while (!work.empty()) {
    const TensorId x = work.back();
    work.pop_back();
    for (OpId c : tensor(x).users) {
      for_each_result(op(c), [&](TensorId y) {
        if (!seen.insert(y).second) return;
        const TensorRecord& ry = tensor(y);
        if (ry.state == TensorState::kDeleted) {
          work.push_back(y);
        } else {
          visit(y, ry);
        }
      });
    }
  }
}

// Note [Evictions while an in-place op runs]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Between prepare_mutation() and commit_mutation() nothing that reads the
// target's old value may be evicted: commit locks those tensors, and one
// evicted in between could never be replayed (its recipe reads a value the
// op destroyed). Evictions used to be held for the whole op for this reason,
// so an in-place op that ran out of memory (batch norm in training updates
// its running statistics in place: every BatchNorm of a ResNet) could free
// nothing and failed, though megabytes of unrelated activations were
// evictable: ResNet-50 under the engine trained a batch of 16 and failed at
// 14. Now the interception holds evictions only while it prepares and
// regenerates; while the op itself runs, it pins what mutation_readers()
// lists (the target and the resident results reached through its users,
// through dead intermediates, as commit_mutation walks) and lets the
// allocator's retry evict anything else.
std::vector<TensorId> Rematerializer::mutation_readers(TensorId target) const {
  std::vector<TensorId> out;
  if (tensor(target).state == TensorState::kResident) out.push_back(target);
  for_each_reader(target, [&](TensorId y, const TensorRecord& ry) {
    if (ry.state == TensorState::kResident) out.push_back(y);
  });
  return out;
}

OpId Rematerializer::commit_mutation(TensorId target, std::span<const TensorId> inputs, double cost_seconds,
                                     bool replayable, const MutationPlan& plan) {
  TensorRecord& r = t_(target);
  if (plan.chain) {
    TIDAL_INTERNAL_ASSERT(replayable && r.users.empty() && !r.locked, "chain plan of tensor ", target,
                          " no longer holds");
    const OpId id = next_op_++;
    OpRecord o;
    o.id = id;
    o.inputs.assign(inputs.begin(), inputs.end());
    o.target = target;
    o.cost = cost_seconds;
    o.live_results = 1;
    for (TensorId in : o.inputs) {
      TIDAL_INTERNAL_ASSERT(in != target, "an in-place op's target is not one of its inputs");
      add_user_once(t_(in), id);
    }
    r.recipe.push_back(id);
    ops_.emplace(id, std::move(o));
    return id;
  }
  // The old value is gone: nothing computed from it can be replayed again.
  r.locked = true;
  std::unordered_set<TensorId> seen{target};
  std::vector<TensorId> work{target};
  while (!work.empty()) {
    const TensorId x = work.back();
    work.pop_back();
    for (OpId c : t_(x).users) {
      OpRecord& oc = o_(c);
      oc.replayable = false;
      for_each_result(oc, [&](TensorId y) {
        if (!seen.insert(y).second) return;
        TensorRecord& ry = t_(y);
        TIDAL_INTERNAL_ASSERT(ry.state != TensorState::kEvicted, "tensor ", y,
                              " should have been regenerated before an in-place update of ", target);
        if (ry.state == TensorState::kResident) {
          ry.locked = true;
        } else {
          work.push_back(y);
        }
      });
    }
  }
  return -1;
}

void Rematerializer::resize(TensorId t, std::size_t bytes) {
  TensorRecord& r = t_(t);
  TIDAL_INTERNAL_ASSERT(r.state == TensorState::kResident, "resize of tensor ", t, ", which is not resident");
  if (!r.external) {
    tracked_bytes_ = tracked_bytes_ - r.bytes + bytes;
    peak_tracked_bytes_ = std::max(peak_tracked_bytes_, tracked_bytes_);
  }
  r.bytes = bytes;
}

void Rematerializer::access(TensorId t) { t_(t).last_access = clock_; }

void Rematerializer::pin(TensorId t) { ++t_(t).pins; }

void Rematerializer::unpin(TensorId t) {
  TensorRecord& r = t_(t);
  TIDAL_INTERNAL_ASSERT(r.pins > 0, "unpin of unpinned tensor ", t);
  if (--r.pins == 0 && !r.alive) try_release(t);
}

std::vector<Rematerializer::PlanStep> Rematerializer::regeneration_plan(
    std::span<const TensorId> targets) const {
  return plan_for(targets, kNoTensor);
}

double Rematerializer::regeneration_cost(TensorId t) const {
  const TensorId targets[] = {t};
  double cost = 0.0;
  for (const PlanStep& step : plan_for(targets, t)) cost += op(step.op).cost;
  return cost;
}

std::vector<Rematerializer::PlanStep> Rematerializer::plan_for(std::span<const TensorId> targets,
                                                               TensorId assume_evicted) const {
  std::vector<PlanStep> plan;
  std::unordered_map<OpId, std::size_t> step_of;  // producer op -> index in plan
  std::unordered_set<TensorId> done;              // resident once the plan so far ran
  struct Frame {
    TensorId t;
    bool expanded;
  };
  std::vector<Frame> stack;
  for (TensorId t : targets) stack.push_back({t, false});
  auto ready = [&](TensorId t) {
    return (t != assume_evicted && tensor(t).state == TensorState::kResident) || done.count(t) != 0;
  };
  while (!stack.empty()) {
    const TensorId t = stack.back().t;
    if (ready(t)) {
      stack.pop_back();
      continue;
    }
    const TensorRecord& r = tensor(t);
    TIDAL_INTERNAL_ASSERT(!r.recipe.empty(), "tensor ", t, " is not resident and has no recipe");
    if (!stack.back().expanded) {
      stack.back().expanded = true;
      for (OpId o : r.recipe) {
        const OpRecord& rec = op(o);
        TIDAL_INTERNAL_ASSERT(rec.replayable, "tensor ", t, " needs op ", o, " which must not be replayed");
        for (TensorId in : rec.inputs) {
          if (!ready(in)) stack.push_back({in, false});
        }
      }
      continue;
    }
    stack.pop_back();
    const OpId producer = r.recipe.front();
    const bool chained = r.recipe.size() > 1;
    auto it = step_of.find(producer);
    if (it == step_of.end()) {
      step_of.emplace(producer, plan.size());
      plan.push_back({producer, {}});
      for (TensorId out : op(producer).outputs) {
        if (contains(out) && tensor(out).recipe.size() == 1) done.insert(out);
      }
      it = step_of.find(producer);
    }
    if (chained) {
      plan[it->second].chained.push_back(t);
      for (std::size_t i = 1; i < r.recipe.size(); ++i) plan.push_back({r.recipe[i], {}});
    }
    done.insert(t);
  }
  return plan;
}

std::vector<TensorId> Rematerializer::on_replayed(const PlanStep& step, double seconds) {
  OpRecord& o = o_(step.op);
  ++recomputes_;
  recompute_seconds_ += seconds;
  std::vector<TensorId> installed;
  for (TensorId out : o.outputs) {
    auto it = tensors_.find(out);
    if (it == tensors_.end()) continue;  // really deleted: the caller discards it
    TensorRecord& r = it->second;
    if (r.state == TensorState::kResident) continue;
    const bool wanted = r.recipe.size() == 1 ||
                        std::find(step.chained.begin(), step.chained.end(), out) != step.chained.end();
    if (!wanted) continue;
    if (r.uf >= 0) {
      double cost = 0.0;
      for (OpId p : r.recipe) cost += o_(p).cost;
      uf_cost_[uf_find(r.uf)] -= cost;
      r.uf = -1;
    }
    r.state = TensorState::kResident;
    r.last_access = clock_;
    add_resident_bytes(r);
    installed.push_back(out);
  }
  return installed;
}

bool Rematerializer::is_candidate(const TensorRecord& r) const {
  return !r.external && !r.locked && r.alive && r.pins == 0 && r.state == TensorState::kResident &&
         r.bytes > 0 && r.bytes >= options_.evictee_minimum_size && !r.recipe.empty();
}

int Rematerializer::uf_find(int node) const {
  int root = node;
  while (uf_parent_[root] != root) root = uf_parent_[root];
  while (uf_parent_[node] != root) {
    const int next = uf_parent_[node];
    uf_parent_[node] = root;
    node = next;
  }
  return root;
}

double Rematerializer::last_resort_score(TensorId t, const TensorRecord& r) const {
  ScoreInput in;
  in.bytes = r.bytes;
  in.staleness = clock_ - std::min(clock_, r.last_access) + 1;
  in.cost = regeneration_cost(t);
  return scorer_->score(in);
}

double Rematerializer::score(const TensorRecord& r) const {
  ScoreInput in;
  in.bytes = r.bytes;
  in.staleness = clock_ - std::min(clock_, r.last_access) + 1;
  for (OpId p : r.recipe) in.cost += op(p).cost;
  if (scorer_->needs_neighbourhood()) {
    int roots[16];
    int nroots = 0;
    double extra = 0.0;
    auto add = [&](TensorId n) {
      const TensorRecord& rn = tensor(n);
      if (rn.uf < 0 || rn.state == TensorState::kResident) return;
      const int root = uf_find(rn.uf);
      for (int i = 0; i < nroots; ++i) {
        if (roots[i] == root) return;
      }
      if (nroots < 16) roots[nroots++] = root;
      extra += uf_cost_[root];
    };
    for (OpId p : r.recipe) {
      for (TensorId n : op(p).inputs) add(n);
    }
    for (OpId u : r.users) for_each_result(op(u), add);
    in.neighbourhood_cost = extra;
  }
  return scorer_->score(in);
}

// Note [Last-resort candidates]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A gradient made during backward reads tensors of the backward pass that
// die an op later; once evicted, bringing it back replays the backward chain
// down to it and the forward chain under that (quadratic recompute, deep
// plans). DTR's score does not see that well (the dead chain is one cheap
// class per neighbour), so such tensors form a second tier: evicted only when
// no ordinary candidate is left, which keeps budgets that only fit with them
// evicted possible. Within that tier a candidate's cost is what bringing it
// back would replay (regeneration_cost: the whole plan, dead chain included),
// so the gradient of a tied weight that needs the forward pass again (a GPT's
// embedding/head gradient, held from the head's backward to the
// embedding's) goes after gradients that come back with a few ops. The walk
// is O(plan) per candidate; it runs only when no ordinary candidate is left.
TensorId Rematerializer::choose_evictee() {
  TensorId best = kNoTensor;
  double best_score = std::numeric_limits<double>::infinity();
  bool best_last_resort = true;
  auto consider = [&](TensorId t) {
    const TensorRecord& r = tensor(t);
    if (!is_candidate(r)) return;
    if (r.last_resort && !best_last_resort) return;
    const double s = r.last_resort ? last_resort_score(t, r) : score(r);
    if (s < best_score || (best_last_resort && !r.last_resort)) {
      best_score = s;
      best = t;
      best_last_resort = r.last_resort;
    }
  };
  const std::size_t n = resident_.size();
  if (options_.enable_sqrt_sampling && n > 4) {
    const auto k = static_cast<std::size_t>(std::ceil(std::sqrt(static_cast<double>(n))));
    std::uniform_int_distribution<std::size_t> pick(0, n - 1);
    for (std::size_t i = 0; i < k; ++i) consider(resident_[pick(rng_)]);
    if (best != kNoTensor && !best_last_resort) return best;
    // No candidate among the samples: fall back to a full scan so eviction
    // still makes progress when candidates are rare.
  }
  for (TensorId t : resident_) consider(t);
  return best;
}

void Rematerializer::uf_join_evicted(TensorRecord& r) {
  const int node = static_cast<int>(uf_parent_.size());
  uf_parent_.push_back(node);
  double cost = 0.0;
  for (OpId p : r.recipe) cost += o_(p).cost;
  uf_cost_.push_back(cost);
  r.uf = node;
  auto join = [&](TensorId n) {
    const TensorRecord& rn = tensor(n);
    if (rn.uf < 0 || rn.state == TensorState::kResident) return;
    const int a = uf_find(rn.uf);
    const int b = uf_find(node);
    if (a == b) return;
    uf_parent_[a] = b;
    uf_cost_[b] += uf_cost_[a];
  };
  for (OpId p : r.recipe) {
    for (TensorId n : o_(p).inputs) join(n);
  }
  for (OpId u : r.users) for_each_result(o_(u), join);
}

void Rematerializer::evict(TensorId t) {
  TensorRecord& r = t_(t);
  TIDAL_INTERNAL_ASSERT(is_candidate(r), "tensor ", t, " is not an eviction candidate");
  remove_resident(resident_, resident_pos_, t);
  tracked_bytes_ -= r.bytes;
  r.state = TensorState::kEvicted;
  uf_join_evicted(r);
  ++evictions_;
}

void Rematerializer::unevictable_bytes(std::size_t* locked, std::size_t* small) const {
  *locked = 0;
  *small = 0;
  for (TensorId t : resident_) {
    const TensorRecord& r = tensor(t);
    if (r.pins > 0) continue;
    if (r.locked) {
      *locked += r.bytes;
    } else if (r.bytes < options_.evictee_minimum_size) {
      *small += r.bytes;
    }
  }
}

bool Rematerializer::on_storage_dead(TensorId t) {
  TensorRecord& r = t_(t);
  r.alive = false;
  if (r.state == TensorState::kResident) {
    if ((r.locked || r.external) && !r.users.empty()) return true;  // no recipe: keep the memory
    if (!r.external) {
      remove_resident(resident_, resident_pos_, t);
      tracked_bytes_ -= r.bytes;
    }
    r.state = TensorState::kDeleted;
    if (!r.users.empty() && !r.locked) uf_join_evicted(r);
  } else if (r.state == TensorState::kEvicted) {
    r.state = TensorState::kDeleted;
  }
  try_release(t);
  return false;
}

void Rematerializer::try_release(TensorId first) {
  std::vector<TensorId>& work = release_work_;  // (try_release never calls itself)
  work.clear();
  work.push_back(first);
  while (!work.empty()) {
    const TensorId id = work.back();
    work.pop_back();
    auto it = tensors_.find(id);
    if (it == tensors_.end()) continue;
    TensorRecord& r = it->second;
    if (r.alive || !r.users.empty() || r.pins > 0) continue;
    if (r.state == TensorState::kResident && !r.external) {
      remove_resident(resident_, resident_pos_, id);
      tracked_bytes_ -= r.bytes;
    }
    const auto recipe = std::move(r.recipe);
    tensors_.erase(it);
    released_tensors_.push_back(id);
    for (OpId p : recipe) {
      auto oit = ops_.find(p);
      TIDAL_INTERNAL_ASSERT(oit != ops_.end(), "recipe op ", p, " of tensor ", id, " is gone");
      if (--oit->second.live_results > 0) continue;
      for (TensorId in : oit->second.inputs) {
        auto iit = tensors_.find(in);
        if (iit == tensors_.end()) continue;
        auto& users = iit->second.users;
        users.erase(std::remove(users.begin(), users.end(), p), users.end());
        work.push_back(in);
      }
      ops_.erase(oit);
      released_ops_.push_back(p);
    }
  }
  if (tensors_.empty()) {
    // Union-find nodes are reclaimed when nothing is tracked (between steps).
    uf_parent_.clear();
    uf_cost_.clear();
  }
}

void Rematerializer::take_released_tensors(std::vector<TensorId>* out) {
  out->clear();
  out->swap(released_tensors_);
}

void Rematerializer::take_released_ops(std::vector<OpId>* out) {
  out->clear();
  out->swap(released_ops_);
}

DtrStats Rematerializer::stats() const {
  DtrStats s;
  s.evictions = evictions_;
  s.recomputes = recomputes_;
  s.recompute_seconds = recompute_seconds_;
  s.tracked_bytes = tracked_bytes_;
  s.peak_tracked_bytes = peak_tracked_bytes_;
  s.live_tensors = tensors_.size();
  s.live_ops = ops_.size();
  for (const auto& [id, r] : tensors_) {
    if (!r.alive) ++s.fake_deleted;
    if (!r.external && r.locked && r.state == TensorState::kResident) s.locked_bytes += r.bytes;
  }
  return s;
}

void Rematerializer::validate() const {
  std::size_t tracked = 0;
  std::size_t resident_count = 0;
  for (const auto& [id, r] : tensors_) {
    TIDAL_INTERNAL_ASSERT(r.id == id, "record key ", id, " holds tensor ", r.id);
    TIDAL_INTERNAL_ASSERT(r.pins >= 0, "tensor ", id, " has negative pins");
    if (r.state == TensorState::kResident && !r.external) {
      tracked += r.bytes;
      ++resident_count;
      TIDAL_INTERNAL_ASSERT(resident_pos_.count(id) == 1, "resident tensor ", id, " not listed");
    } else {
      TIDAL_INTERNAL_ASSERT(resident_pos_.count(id) == 0, "non-resident tensor ", id, " listed");
    }
    if (r.state != TensorState::kResident) {
      TIDAL_INTERNAL_ASSERT(!r.locked || r.external, "locked tensor ", id, " is not resident");
      TIDAL_INTERNAL_ASSERT(!r.recipe.empty(), "non-resident tensor ", id, " has no recipe");
    }
    if (r.state == TensorState::kDeleted) {
      TIDAL_INTERNAL_ASSERT(!r.alive, "deleted tensor ", id, " is alive");
    }
    if (!r.alive) {
      TIDAL_INTERNAL_ASSERT(!r.users.empty() || r.pins > 0, "dead tensor ", id, " kept without users");
    }
    for (OpId u : r.users) {
      auto it = ops_.find(u);
      TIDAL_INTERNAL_ASSERT(it != ops_.end(), "tensor ", id, " lists dead user op ", u);
      const auto& ins = it->second.inputs;
      TIDAL_INTERNAL_ASSERT(std::find(ins.begin(), ins.end(), id) != ins.end(), "op ", u,
                            " does not read tensor ", id);
    }
    for (OpId p : r.recipe) TIDAL_INTERNAL_ASSERT(ops_.count(p) == 1, "recipe op ", p, " is gone");
  }
  TIDAL_INTERNAL_ASSERT(tracked == tracked_bytes_, "tracked bytes ", tracked_bytes_, " but records sum to ",
                        tracked);
  TIDAL_INTERNAL_ASSERT(resident_count == resident_.size(), "resident list has ", resident_.size(),
                        " entries for ", resident_count, " resident tensors");
  for (const auto& [id, o] : ops_) {
    int live = 0;
    for_each_result(o, [&](TensorId y) { live += tensors_.count(y) != 0 ? 1 : 0; });
    TIDAL_INTERNAL_ASSERT(live == o.live_results, "op ", id, " counts ", o.live_results,
                          " live results, found ", live);
    TIDAL_INTERNAL_ASSERT(live > 0, "op ", id, " is kept with no live result");
    for (TensorId in : o.inputs) {
      auto it = tensors_.find(in);
      TIDAL_INTERNAL_ASSERT(it != tensors_.end(), "live op ", id, " reads released tensor ", in);
      const auto& users = it->second.users;
      TIDAL_INTERNAL_ASSERT(std::find(users.begin(), users.end(), id) != users.end(), "tensor ", in,
                            " does not list its reader op ", id);
    }
  }
}

}  // namespace tidal::dtr
