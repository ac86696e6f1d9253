#include "hooks/dtr/interceptor.h"

#include <ATen/ATen.h>
#include <ATen/core/boxing/KernelFunction.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>  // torch::autograd::Node (node.h only from torch 2.12)

#include <algorithm>
#include <atomic>
#include <chrono>
#include <optional>
#include <sstream>
#include <typeinfo>
#include <string_view>

#include "runtime/core/error.h"
#include "runtime/core/uncounted.h"

namespace tidal::hooks::dtr {

namespace d = tidal::dtr;
using Clock = std::chrono::steady_clock;

constexpr c10::DispatchKey kKey = c10::DispatchKey::Fake;

// ---------------------------------------------------------------- what an op is

// Ops whose outputs must never be recomputed: collectives and ops that read
// data out of the tensor world. Their outputs are locked (never evicted).
constexpr std::string_view kNeverReplayNamespaces[] = {"c10d", "_c10d_functional", "c10d_functional",
                                                       "_dtensor"};
constexpr std::string_view kNeverReplayOps[] = {"aten._local_scalar_dense.default", "aten.set_.source_Storage",
                                                "aten.set_.source_Storage_storage_offset",
                                                "aten.set_.source_Tensor"};
// Batch norm in training mode updates running_mean/var in place (native_batch_norm
// does not even declare it) but its outputs do not depend on them: replays get
// scratch copies so the update is not applied twice.
constexpr std::string_view kBatchNormOps[] = {"aten.native_batch_norm.default",
                                              "aten._native_batch_norm_legit.default",
                                              "aten._batch_norm_with_update.default",
                                              "aten.cudnn_batch_norm.default", "aten.miopen_batch_norm.default"};

template <std::size_t N>
bool one_of(std::string_view s, const std::string_view (&list)[N]) {
  return std::find(std::begin(list), std::end(list), s) != std::end(list);
}

struct Session::OpInfo {
  explicit OpInfo(c10::OperatorName n) : op_name(std::move(n)) {}
  c10::OperatorName op_name;
  std::string name;  // as Python prints an OpOverload: aten.mul.Tensor
  std::size_t num_args = 0;
  std::vector<std::size_t> written;  // arguments the op writes
  bool random = false;
  bool replayable = true;
  bool batch_norm = false;
  bool alias_only = false;  // every result aliases an argument: no fresh output
};

const Session::OpInfo& Session::info_of(const c10::OperatorHandle& op) {
  const c10::FunctionSchema* key = &op.schema();
  auto it = infos_.find(key);
  if (it != infos_.end() && it->second->op_name == op.operator_name()) return *it->second;
  auto info = std::make_unique<OpInfo>(op.operator_name());
  const c10::FunctionSchema& schema = op.schema();
  std::string name = info->op_name.name;
  const auto colons = name.find("::");
  const std::string ns = colons == std::string::npos ? name : name.substr(0, colons);
  if (colons != std::string::npos) name.replace(colons, 2, ".");
  info->name = name + "." + (info->op_name.overload_name.empty() ? "default" : info->op_name.overload_name);
  info->num_args = schema.arguments().size();
  // An in-place view op (squeeze_, t_, transpose_, as_strided_) writes the
  // tensor's sizes and strides, not its storage's bytes: no update of the
  // data, nothing to replay (replaying squeeze_ on the squeezed geometry
  // failed). resize_ may reallocate the storage: a real write.
  const bool metadata_only = op.hasTag(at::Tag::inplace_view) && info->name.rfind("aten.resize", 0) != 0;
  for (std::size_t i = 0; i < schema.arguments().size() && !metadata_only; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) info->written.push_back(i);
  }
  info->random = op.hasTag(at::Tag::nondeterministic_seeded);
  info->replayable = !one_of(ns, kNeverReplayNamespaces) && !one_of(info->name, kNeverReplayOps);
  info->batch_norm = one_of(info->name, kBatchNormOps);
  info->alias_only = std::all_of(schema.returns().begin(), schema.returns().end(),
                                 [](const c10::Argument& r) { return r.alias_info() != nullptr; });
  auto& slot = infos_[key];
  if (slot) retired_.push_back(std::move(slot));  // an op gone and another at its address
  slot = std::move(info);
  return *slot;
}

// ------------------------------------------------------------------ recipes

namespace {

struct RngSaved {
  at::Generator gen;
  at::Tensor state;
};

// (Generator states are host-side bookkeeping: Note [tidal's own host
// allocations] in runtime/core/uncounted.h.)
at::Tensor get_state(at::Generator& gen) {
  UncountedScope host_side;
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator& gen, const at::Tensor& state) {
  UncountedScope host_side;
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

// The generator a random op draws from: its generator argument, else the
// default generator of its first tensor's device (or of its device
// argument, for factories), as torch picks it.
RngSaved rng_of(const torch::jit::Stack& stack, std::size_t first, std::span<const at::Tensor> inputs) {
  for (std::size_t i = first; i < stack.size(); ++i) {
    if (stack[i].isGenerator()) {
      at::Generator gen = stack[i].toGenerator();
      return RngSaved{gen, get_state(gen)};
    }
  }
  std::optional<c10::Device> device;
  for (const at::Tensor& t : inputs) {
    if (t.device().type() != c10::DeviceType::Meta) {
      device = t.device();
      break;
    }
  }
  if (!device) {
    for (std::size_t i = first; i < stack.size() && !device; ++i) {
      if (stack[i].isDevice()) device = stack[i].toDevice();
    }
  }
  at::Generator gen = at::globalContext().defaultGenerator(device.value_or(c10::Device(c10::kCPU)));
  return RngSaved{gen, get_state(gen)};
}

void flatten_tensors(const c10::IValue& v, std::vector<at::Tensor>* out) {
  if (v.isTensor()) {
    out->push_back(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) out->push_back(t);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) {
      if (e.isTensor()) out->push_back(e.toTensor());
    }
  }
}

// An absent Tensor? reaches a boxed kernel as None or, from autograd's
// backward formulas, as an undefined tensor (batch norm's backward without
// running statistics).
bool is_defined_tensor(const c10::IValue& v) { return v.isTensor() && v.toTensor().defined(); }

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

}  // namespace

// A recorded op: the operator, the keys below ours it ran on, and its
// arguments with every tensor taken out (the runtime rebuilds slot inputs
// from their storages; parameters come from their provider).
struct Session::OpRecipe final : Recipe {
  explicit OpRecipe(c10::OperatorHandle h) : op(std::move(h)) {}
  struct ListShape {
    std::uint32_t arg = 0;
    bool optional = false;  // Tensor?[]
    std::uint32_t length = 0;
  };
  struct ParamGeom {
    std::int32_t provider = -1;
    std::int64_t param = -1;
    std::vector<int64_t> sizes, strides;
    int64_t offset = 0;
    std::uint64_t epoch = 0;
  };
  c10::OperatorHandle op;
  c10::DispatchKeySet ks;
  std::vector<c10::IValue> args;  // tensors replaced by None
  c10::SmallVector<InputRef, 4> refs;  // where each tensor goes (param: index into params)
  std::vector<ListShape> lists;
  std::vector<ParamGeom> params;
  std::vector<std::pair<std::uint32_t, at::Tensor>> scratch;  // batch norm's running stats
  std::optional<RngSaved> rng;
  // Grad mode when the op ran: kernels read it (Note [What a replay restores]
  // in interceptor.h).
  bool grad_mode = true;
  const std::string* name = nullptr;  // the OpInfo's, which the session keeps
};

Session::Session(d::DtrOptions options) : runtime_(options) {
  runtime_.set_arbiter(&arbiters_);
  runtime_.set_on_evict([this](TensorId id) {
    const auto* r = dynamic_cast<const OpRecipe*>(runtime_.producer_recipe(id));
    auto& c = counters_[r == nullptr ? std::string("(no recipe)") : *r->name];
    ++c.evicted;
    c.evicted_bytes += runtime_.bytes_of(id);
  });
}

std::unordered_map<std::string, Session::OpCounters> Session::op_counters() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return counters_;
}

Session::PlanCounters Session::plan_counters() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return plans_;
}

Session::~Session() {
  if (active()) deactivate();
}

std::int64_t Session::param_of(const at::Tensor& t) {
  for (std::size_t p = 0; p < providers_.size(); ++p) {
    if (!providers_[p]) continue;
    const std::int64_t r = providers_[p]->alias(t);
    if (r >= 0) return (static_cast<std::int64_t>(p) << 48) | r;
  }
  return -1;
}

void Session::collect_inputs(const OpInfo& info, const torch::jit::Stack& stack, std::size_t first) {
  refs_.clear();
  inputs_.clear();
  param_inputs_.clear();
  auto add = [&](std::uint32_t arg, std::int32_t element, const at::Tensor& t) {
    // An undefined tensor (an absent Tensor? that autograd passes as one) or
    // a Python number the op received as a tensor (y * 3): a constant of the
    // recipe, not an input (the Python mode sees None and the number).
    if (!t.defined() || t.unsafeGetTensorImpl()->is_wrapped_number()) return;
    InputRef ref{arg, element, -1, -1};
    if (!providers_.empty()) ref.param = param_of(t);
    if (ref.param >= 0) {
      param_inputs_.push_back(t);
    } else {
      ref.slot = static_cast<std::int32_t>(inputs_.size());
      inputs_.push_back(t);
    }
    refs_.push_back(ref);
  };
  for (std::size_t i = 0; i < info.num_args; ++i) {
    const c10::IValue& v = stack[first + i];
    const auto arg = static_cast<std::uint32_t>(i);
    if (v.isTensor()) {
      add(arg, -1, v.toTensor());
    } else if (v.isTensorList()) {
      std::int32_t k = 0;
      for (const at::Tensor& t : v.toTensorList()) add(arg, k++, t);
    } else if (v.isList()) {
      std::int32_t k = 0;
      for (const c10::IValue& e : v.toListRef()) {
        if (e.isTensor()) add(arg, k, e.toTensor());
        ++k;
      }
    }
  }
}

std::shared_ptr<Session::OpRecipe> Session::make_recipe(const c10::OperatorHandle& op, c10::DispatchKeySet below,
                                                        const OpInfo& info, torch::jit::Stack&& args,
                                                        bool scratch) const {
  auto r = std::make_shared<OpRecipe>(op);
  r->ks = below;
  r->name = &info.name;
  r->args = std::move(args);
  r->refs.assign(refs_.begin(), refs_.end());
  if (scratch) {  // batch norm's running stats: replays write into copies
    for (std::uint32_t i : {3u, 4u}) {
      if (is_defined_tensor(r->args[i])) {
        r->scratch.emplace_back(i, r->args[i].toTensor());
        r->args[i] = c10::IValue();
      }
    }
  }
  std::size_t p = 0;
  for (InputRef& ref : r->refs) {
    c10::IValue& a = r->args[ref.arg];
    if (ref.element < 0) {
      a = c10::IValue();
    } else if (!a.isNone()) {
      OpRecipe::ListShape shape{ref.arg, !a.isTensorList(), static_cast<std::uint32_t>(a.toListRef().size())};
      r->lists.push_back(shape);
      a = c10::IValue();
    }
    if (ref.param >= 0) {
      const at::Tensor& t = param_inputs_[p];
      const auto provider = static_cast<std::int32_t>(ref.param >> 48);
      OpRecipe::ParamGeom g{provider, ref.param & ((std::int64_t{1} << 48) - 1), t.sizes().vec(),
                            t.strides().vec(), t.storage_offset(), providers_[provider]->weights_epoch()};
      r->params.push_back(std::move(g));
      ref.param = static_cast<std::int64_t>(p++);
    }
  }
  return r;
}

// --------------------------------------------------------------- interception

void Session::handle(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const OpInfo& info = info_of(op);
  last_op_ = &info.name;
  // The per-op vectors keep their capacity, never a tensor: a reference
  // left there would keep a dead tensor alive (no fake deletion).
  auto drop_references = [this]() {
    inputs_.clear();
    param_inputs_.clear();
    outputs_.clear();
  };
  try {
    run_handle(op, info, below, stack);
  } catch (...) {
    drop_references();
    runtime_.abandon_op();
    if (rethrow_) rethrow_(std::current_exception());
    throw;
  }
  drop_references();
  if (after_op_) after_op_();
}

void Session::run_handle(const c10::OperatorHandle& op, const OpInfo& info, c10::DispatchKeySet below,
                         torch::jit::Stack* stack) {
  const std::size_t first = stack->size() - info.num_args;
  // Running stats are written, not read: not inputs of the recipe.
  const bool scratch = info.batch_norm && info.num_args > 5 && (*stack)[first + 5].isBool() &&
                       (*stack)[first + 5].toBool() && is_defined_tensor((*stack)[first + 3]);
  torch::jit::Stack args(stack->begin() + static_cast<std::ptrdiff_t>(first), stack->end());
  std::vector<at::Tensor> scratch_tensors;
  if (scratch) {
    for (std::size_t i : {std::size_t{3}, std::size_t{4}}) {
      if (is_defined_tensor(args[i])) scratch_tensors.push_back(args[i].toTensor());
    }
    // Leave them out of the inputs.
    torch::jit::Stack view = args;
    view[3] = c10::IValue();
    view[4] = c10::IValue();
    collect_inputs(info, view, 0);
  } else {
    collect_inputs(info, args, 0);
  }
  runtime_.begin_op(inputs_, &ids_, &missing_);
  if (!missing_.empty()) {
    const std::vector<TensorId> missing = missing_;
    regenerate(missing);
  }

  // In-place updates (Note [DTR records]).
  struct Mutation {
    TensorId id;
    d::MutationPlan plan;
  };
  std::vector<Mutation> mutations;
  bool declared = false;
  bool held = false;  // evictions held while the update is prepared
  if (!info.written.empty() || scratch) {
    std::vector<at::Tensor> written;
    for (std::size_t i : info.written) flatten_tensors(args[i], &written);
    declared = !written.empty();
    written.insert(written.end(), scratch_tensors.begin(), scratch_tensors.end());
    if (!written.empty()) {
      runtime_.set_hold_evictions(true);  // released by run_mutation, then by end_op after commit_mutation
      held = true;
      std::vector<TensorId> wids;
      for (const at::Tensor& w : written) {
        TensorId wid = d::kNoTensor;
        for (std::size_t i = 0; i < inputs_.size() && wid == d::kNoTensor; ++i) {
          if (inputs_[i].unsafeGetTensorImpl() == w.unsafeGetTensorImpl()) wid = ids_[i];
        }
        if (wid == d::kNoTensor) wid = runtime_.lookup(w);
        if (wid != d::kNoTensor && std::find(wids.begin(), wids.end(), wid) == wids.end()) wids.push_back(wid);
      }
      const bool chain_ok = info.replayable && info.alias_only && wids.size() == 1 && !scratch;
      std::vector<TensorId> regen;
      for (TensorId wid : wids) {
        auto plan = runtime_.prepare_mutation(wid, chain_ok);
        regen.insert(regen.end(), plan.regenerate.begin(), plan.regenerate.end());
        mutations.push_back(Mutation{wid, std::move(plan)});
      }
      if (!regen.empty()) regenerate(regen);
    }
  }

  std::optional<RngSaved> rng;
  if (info.random) rng = rng_of(*stack, first, inputs_);
  if (held) {
    std::vector<TensorId> targets;
    for (const Mutation& m : mutations) targets.push_back(m.id);
    runtime_.run_mutation(targets);  // Note [Evictions while an in-place op runs]
  }
  const auto t0 = Clock::now();
  for (;;) {
    try {
      op.redispatchBoxed(below, stack);
      break;
    } catch (const std::exception& e) {
      // The allocator ran out (CUDA): free the best candidate and retry.
      if (!is_oom(e) || !runtime_.evict_one()) throw;
      if (rng) set_state(rng->gen, rng->state);  // the retry draws what a replay will draw
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(std::min(first, stack->size())), stack->end());
      stack->insert(stack->end(), args.begin(), args.end());
    }
  }
  const double seconds = seconds_since(t0);
  if (held) runtime_.set_hold_evictions(true);  // until the commits below

  outputs_.clear();
  for (std::size_t i = first; i < stack->size(); ++i) flatten_tensors((*stack)[i], &outputs_);
  if (!providers_.empty() && !outputs_.empty()) {
    std::erase_if(outputs_, [&](const at::Tensor& o) { return param_of(o) >= 0; });  // views of parameters
  }
  const bool replayable = info.replayable && !declared;
  std::shared_ptr<const OpRecipe> recipe;
  auto recipe_for = [&]() {
    // The op ran: its arguments are not needed again.
    if (!recipe) {
      auto r = make_recipe(op, below, info, std::move(args), scratch);
      r->rng = rng;
      r->grad_mode = c10::GradMode::is_enabled();
      recipe = std::move(r);
    }
    return recipe;
  };
  // Outputs of ops under no_grad outside backward are not DTR's (Note [What
  // DTR tracks] in storage_runtime.h).
  if (!outputs_.empty() && records_outputs_now()) {
    // Fresh outputs of an op that updates its arguments are not replayed
    // (the update would be applied twice), except batch norm's (scratch).
    const bool last_resort = torch::autograd::get_current_graph_task_id() != -1;
    if (runtime_.has_fresh(outputs_)) {
      runtime_.record(inputs_, ids_, outputs_, seconds, replayable, replayable ? recipe_for() : nullptr,
                      last_resort);
    }
  }
  for (const Mutation& m : mutations) {
    runtime_.commit_mutation(m.id, m.plan.chain, inputs_, ids_, seconds, m.plan.chain ? recipe_for() : nullptr);
  }
  runtime_.set_hold_evictions(false);
  runtime_.end_op(info.name);
}

// ------------------------------------------------------------------ replays

void Session::regenerate(std::span<const TensorId> targets, bool bounded) {
  auto plan = runtime_.plan(targets, bounded);
  ++plans_.plans;
  plans_.ops += plan.size();
  plans_.longest = std::max(plans_.longest, plan.size());
  try {
    for (const auto& item : plan) {
      TIDAL_INTERNAL_ASSERT(item.recipe != nullptr, "op ", item.op, " has no recipe to replay");
      const auto& r = dynamic_cast<const OpRecipe&>(*item.recipe);
      std::vector<at::Tensor> tensors = runtime_.replay_inputs(item.op);
      auto fill = [&]() {
        torch::jit::Stack st = r.args;
        std::vector<std::vector<c10::IValue>> lists(r.lists.size());
        for (std::size_t k = 0; k < r.lists.size(); ++k) lists[k].resize(r.lists[k].length);
        for (const InputRef& ref : r.refs) {
          at::Tensor t;
          if (ref.slot >= 0) {
            t = tensors[static_cast<std::size_t>(ref.slot)];
          } else {
            const OpRecipe::ParamGeom& g = r.params[static_cast<std::size_t>(ref.param)];
            const auto& provider = providers_.at(static_cast<std::size_t>(g.provider));
            TIDAL_INTERNAL_ASSERT(provider != nullptr, "a recipe reads a parameter of a provider that is gone");
            ParamProvider& p = *provider;
            if (g.epoch != p.weights_epoch()) {
              TIDAL_THROW(InternalError, "tidal.dtr: a recipe read parameter '", p.param_name(g.param),
                          "' before the weights changed (epoch ", g.epoch, ", now ", p.weights_epoch(),
                          "); replaying it would compute a different value");
            }
            t = p.view(g.param, g.sizes, g.strides, g.offset);
          }
          if (ref.element < 0) {
            st[ref.arg] = std::move(t);
          } else {
            for (std::size_t k = 0; k < r.lists.size(); ++k) {
              if (r.lists[k].arg == ref.arg) lists[k][static_cast<std::size_t>(ref.element)] = std::move(t);
            }
          }
        }
        for (std::size_t k = 0; k < r.lists.size(); ++k) {
          if (r.lists[k].optional) {
            c10::List<std::optional<at::Tensor>> l;
            for (auto& v : lists[k]) l.push_back(v.isTensor() ? std::optional<at::Tensor>(v.toTensor()) : std::nullopt);
            st[r.lists[k].arg] = std::move(l);
          } else {
            c10::List<at::Tensor> l;
            for (auto& v : lists[k]) l.push_back(v.toTensor());
            st[r.lists[k].arg] = std::move(l);
          }
        }
        for (const auto& [i, t] : r.scratch) st[i] = t.clone();
        return st;
      };
      std::optional<at::Tensor> old_state;
      std::optional<at::Generator> gen;
      if (r.rng) {
        gen = r.rng->gen;
        old_state = get_state(*gen);
        set_state(*gen, r.rng->state);
      }
      auto restore = [&]() {
        if (gen) set_state(*gen, *old_state);
        for (auto& p : providers_) {
          if (p) p->end_replay_step();
        }
      };
      torch::jit::Stack st;
      Clock::time_point t0;
      try {
        st = fill();
        t0 = Clock::now();
        // The kernel sees the grad mode it saw when the op ran (Note [What a
        // replay restores]); replays below autograd record no graph either way.
        c10::AutoGradMode grad_mode(r.grad_mode);
        for (;;) {
          try {
            r.op.redispatchBoxed(r.ks, &st);
            break;
          } catch (const std::exception& e) {
            if (!is_oom(e) || !runtime_.evict_one()) throw;  // never takes what the plan pinned
            if (gen) set_state(*gen, r.rng->state);
            st = fill();
          }
        }
      } catch (...) {
        restore();
        throw;
      }
      const double seconds = seconds_since(t0);
      restore();
      auto& c = counters_[*r.name];
      ++c.replays;
      c.replay_seconds += seconds;
      tensors.clear();  // inputs no later step needs can be dropped at once
      std::vector<at::Tensor> outputs;
      for (const c10::IValue& v : st) flatten_tensors(v, &outputs);
      st.clear();
      runtime_.replayed(item, outputs, seconds);
    }
  } catch (...) {
    runtime_.end_plan();
    throw;
  }
  runtime_.end_plan();
}

void Session::regenerate_evicted() {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  std::lock_guard<std::recursive_mutex> lock(mu_);
  const std::size_t threshold = runtime_.options().eviction_threshold;
  runtime_.set_eviction_threshold(0);  // bringing tensors back must not evict others
  try {
    auto todo = runtime_.evicted_alive();
    if (!todo.empty()) regenerate(todo, /*bounded=*/false);
  } catch (...) {
    runtime_.set_eviction_threshold(threshold);
    if (rethrow_) rethrow_(std::current_exception());
    throw;
  }
  auto left = runtime_.evicted_alive();
  if (!left.empty()) {
    std::ostringstream ids;
    for (TensorId id : left) ids << id << ' ';
    TIDAL_THROW(InternalError, "tidal.dtr.disable(): tensors ", ids.str(), "are still evicted");
  }
}

void Session::set_eviction_threshold(std::size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  runtime_.set_eviction_threshold(bytes);
}

bool Session::evict_one() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return runtime_.evict_one();
}

double Session::best_eviction_seconds_per_byte() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return runtime_.best_eviction_seconds_per_byte();
}

void Session::count_chunk_eviction(std::size_t bytes) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  runtime_.count_chunk_eviction(bytes);
}

std::size_t Session::tracked_bytes() {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  return runtime_.tracked_bytes();
}

void Session::add_provider(std::shared_ptr<ParamProvider> provider) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  TIDAL_CHECK(providers_.size() < 0x7fff, "too many parameter providers");
  if (provider == nullptr ||
      std::find(providers_.begin(), providers_.end(), provider) != providers_.end()) {
    return;
  }
  arbiters_.add(provider.get(), provider->arbiter());
  if (active()) provider->session_changed(this);
  providers_.push_back(std::move(provider));
}

void Session::remove_provider(ParamProvider* provider) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  arbiters_.remove(provider);
  // Recipes name providers by position: keep the slot, so later ones keep theirs.
  for (auto& p : providers_) {
    if (p.get() == provider) {
      if (active()) p->session_changed(nullptr);
      p.reset();
    }
  }
  while (!providers_.empty() && !providers_.back()) providers_.pop_back();
}

void Session::notify_providers(ActivationRoom* routing) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  for (const auto& p : providers_) {
    if (p) p->session_changed(routing);
  }
}

void Session::set_after_op(std::function<void()> fn) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  after_op_ = std::move(fn);
}

bool Session::is_oom(const std::exception& e) const {
  if (is_oom_) return is_oom_(e);
  return dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr;
}

void Session::set_is_oom(std::function<bool(const std::exception&)> fn) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  is_oom_ = std::move(fn);
}

void Session::set_rethrow(std::function<void(std::exception_ptr)> fn) {
  std::lock_guard<std::recursive_mutex> lock(mu_);
  rethrow_ = std::move(fn);
}

// ------------------------------------------------------- the key and the fallback

namespace {

// The one process-wide pointer of DTR: the dispatcher calls a plain
// function, which finds the session routing ops here. Engines do not read
// it: a session tells them (ParamProvider::session_changed).
std::atomic<Session*> g_session{nullptr};
std::mutex g_register_mu;
std::optional<c10::RegistrationHandleRAII> g_fallback;  // kept for the process

void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
  c10::impl::ExcludeDispatchKeyGuard guard(kKey);
  const c10::DispatchKeySet below = ks & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, kKey);
  Session* s = g_session.load(std::memory_order_acquire);
  if (s == nullptr) {
    op.redispatchBoxed(below, stack);
    return;
  }
  s->handle(op, below, stack);
}

}  // namespace

std::string interception_status() {
  std::lock_guard<std::mutex> lock(g_register_mu);
  auto& dispatcher = c10::Dispatcher::singleton();
  if (!g_fallback && dispatcher.hasBackendFallbackForDispatchKey(kKey)) {
    return "this PyTorch registers a fallback of its own on DispatchKey::Fake";
  }
  const auto ops = dispatcher.getAllOpNamesForDispatchKey(kKey);
  if (!ops.empty()) {
    std::ostringstream why;
    why << ops.size() << " ops have kernels of their own on DispatchKey::Fake (first: " << ops.front().name
        << ")";
    return why.str();
  }
  return "";
}

void Session::activate() {
  // The scan of every op for kernels on the key runs once per process (about
  // 50 us; the engine starts a session at every step).
  static std::atomic<bool> verified{false};
  if (!verified.load()) {
    const std::string why = interception_status();
    TIDAL_CHECK(why.empty(), "tidal.dtr cannot intercept ops in C++: ", why);
    verified.store(true);
  }
  {
    std::lock_guard<std::mutex> lock(g_register_mu);
    if (!g_fallback) {
      g_fallback.emplace(c10::Dispatcher::singleton().registerFallback(
          kKey, c10::KernelFunction::makeFromBoxedFunction<&fallback>(), "tidal.dtr (hooks/dtr/interceptor.cpp)"));
    }
  }
  Session* expected = nullptr;
  TIDAL_CHECK(g_session.compare_exchange_strong(expected, this) || expected == this,
              "another tidal.dtr session is active in this process; disable it first");
  c10::impl::tls_set_dispatch_key_included(kKey, true);
  activated_here_ = true;
  notify_providers(this);
}

void Session::deactivate() {
  if (activated_here_) c10::impl::tls_set_dispatch_key_included(kKey, false);
  activated_here_ = false;
  Session* expected = this;
  if (g_session.compare_exchange_strong(expected, nullptr)) notify_providers(nullptr);
}

bool Session::active() const { return g_session.load(std::memory_order_acquire) == this; }

OutsideGuard::OutsideGuard() : was_excluded_(c10::impl::tls_is_dispatch_key_excluded(kKey)) {
  c10::impl::tls_set_dispatch_key_excluded(kKey, true);
}

OutsideGuard::~OutsideGuard() { c10::impl::tls_set_dispatch_key_excluded(kKey, was_excluded_); }

}  // namespace tidal::hooks::dtr
