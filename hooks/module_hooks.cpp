#include "hooks/module_hooks.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <iterator>
#include <utility>

#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/graph_task.h>

#include "runtime/core/error.h"

namespace tidal::hooks {
namespace {

constexpr ChunkKind kSlot = ChunkKind::kParam16;

const void* storage_data(const at::Tensor& t) {
  return t.storage().data_ptr().get();
}

// In-place writes through the parameter (or views of it) count; set_data keeps it.
std::uint32_t version_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->version_counter().current_version();
}

// dst = src: a memcpy for contiguous CPU tensors of one dtype and size (a
// gradient landing in its slot on the simulated device, where copy_'s
// dispatch would cost more than the copy of a small tensor), else torch's
// copy_ into dst's data, which autograd does not see (dst may be a parameter).
void copy_gradient(const at::Tensor& dst, const at::Tensor& src) {
  if (dst.is_cpu() && src.is_cpu() && dst.scalar_type() == src.scalar_type() &&
      dst.numel() == src.numel() && dst.is_contiguous() && src.is_contiguous()) {
    if (src.numel() > 0) std::memcpy(dst.data_ptr(), src.const_data_ptr(), src.nbytes());
    return;
  }
  dst.variable_data().copy_(src);
}

}  // namespace

ModuleHooks::ModuleHooks(ChunkScheduler* scheduler, ParamBinding* binding, MemoryTracer* tracer)
    : scheduler_(scheduler), binding_(binding), tracer_(tracer),
      chunks_in_use_(scheduler != nullptr ? &scheduler->store() : nullptr),
      room_(scheduler, tracer), backward_end_(tracer), gradient_sums_(scheduler, binding) {
  TIDAL_INTERNAL_ASSERT(scheduler_ != nullptr && binding_ != nullptr && tracer_ != nullptr,
                        "ModuleHooks needs a scheduler, a binding and a tracer");
}

std::weak_ptr<DeviceRoom> ModuleHooks::room_handle() {
  const std::shared_ptr<ModuleHooks> self = weak_from_this().lock();
  if (self == nullptr) return {};
  return std::shared_ptr<DeviceRoom>(self, &room_);
}

std::size_t ModuleHooks::add_param(at::Tensor param, TensorId id, std::vector<std::int64_t> shape) {
  TIDAL_CHECK(param.defined(), "ModuleHooks.add_param: the parameter is undefined");
  TIDAL_CHECK_INDEX(id < scheduler_->store().num_tensors(), "ModuleHooks.add_param: tensor id ", id,
                    " is not registered (", scheduler_->store().num_tensors(), " tensors)");
  Param p;
  p.param = std::move(param);
  p.id = id;
  p.shape = std::move(shape);
  p.chunk = scheduler_->store().placement(id).chunk;
  writes_.add(p.param);
  grad_norms_.add_param();
  params_.push_back(std::move(p));
  return params_.size() - 1;
}

std::size_t ModuleHooks::add_module(std::vector<std::size_t> params) {
  for (std::size_t p : params) check_param(p);
  modules_.push_back(std::move(params));
  return modules_.size() - 1;
}

void ModuleHooks::add_to_module(std::size_t module, std::size_t param) {
  check_module(module);
  check_param(param);
  std::vector<std::size_t>& list = modules_[module];
  if (std::find(list.begin(), list.end(), param) == list.end()) list.push_back(param);
}

void ModuleHooks::set_chunks(ChunkScheduler* scheduler, ParamBinding* binding,
                             const std::vector<TensorId>& ids) {
  TIDAL_CHECK(ids.size() == params_.size(), "ModuleHooks.set_chunks: ", ids.size(), " ids for ",
              params_.size(), " parameters");
  TIDAL_INTERNAL_ASSERT(attached_by_data_.empty(),
                        "ModuleHooks.set_chunks while parameters are attached");
  for (std::size_t i = 0; i < ids.size(); ++i) {
    TIDAL_CHECK_INDEX(ids[i] < scheduler->store().num_tensors(), "ModuleHooks.set_chunks: tensor id ",
                      ids[i], " is not registered");
  }
  scheduler_ = scheduler;
  binding_ = binding;
  room_.set_scheduler(scheduler);
  gradient_sums_.set_chunks(scheduler, binding);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    params_[i].id = ids[i];
    params_[i].chunk = scheduler_->store().placement(ids[i]).chunk;
  }
  chunks_in_use_.reset(&scheduler_->store());
}

void ModuleHooks::check_param(std::size_t param) const {
  TIDAL_CHECK_INDEX(param < params_.size(), "ModuleHooks: parameter index ", param, " of ",
                    params_.size());
}

void ModuleHooks::check_module(std::size_t module) const {
  TIDAL_CHECK_INDEX(module < modules_.size(), "ModuleHooks: module index ", module, " of ",
                    modules_.size());
}

std::vector<TensorId> ModuleHooks::ids_of(const std::vector<std::size_t>& params) const {
  for (std::size_t i : params) check_param(i);
  std::vector<TensorId> ids;
  ids.reserve(params.size());
  for (std::size_t i : params) ids.push_back(params_[i].id);
  return ids;
}

// ---- the hooks -------------------------------------------------------------

void ModuleHooks::forward_pre(std::size_t module, bool trace_point) {
  check_module(module);
  room_.enter_hook();
  if (trace_point) tracer_->point(PointKind::kForward, static_cast<std::int64_t>(module));
  const std::vector<std::size_t>& params = modules_[module];
  scratch_.clear();
  for (std::size_t i : params) {
    ++params_[i].uses;
    if (!params_[i].attached) scratch_.push_back(i);
  }
  try {
    if (!scratch_.empty()) {
      make_room_for(scratch_);
      attach_now(scratch_, /*for_backward=*/false, /*replay=*/false, AccessMode::kRead);
    }
  } catch (...) {
    for (std::size_t i : params) --params_[i].uses;
    throw;
  }
  running_.push_back(module);
}

void ModuleHooks::forward_post(std::size_t module, bool grad_enabled) {
  check_module(module);
  // Innermost last; a module left by an exception is found further down.
  const auto it = std::find(running_.rbegin(), running_.rend(), module);
  if (it != running_.rend()) running_.erase(std::next(it).base());
  scratch_.clear();
  for (std::size_t i : modules_[module]) {
    Param& p = params_[i];
    if (--p.uses == 0 && p.attached) scratch_.push_back(i);
  }
  end_transient(module);
  if (torch::autograd::get_current_graph_task_id() != -1 && !PackedRecomputeScope::active()) {
    // Note [A recompute inside backward]: a forward run by backward is an
    // activation checkpoint's recompute. Non-reentrant checkpointing keeps
    // what it recomputes for the segment's backward itself (its own saved-
    // tensor hooks, not the engine's: Note [Parameters keep their
    // TensorImpl]), views of the parameters' slots among them, so the slots
    // must stay where they are until that backward has used them: the
    // parameters stay attached until their gradient lands (land_gradient) or
    // the backward ends, as backward_pre's do. Detached here, their chunks
    // could move and the views read moved memory: wrong gradients, silently.
    // (tidal's own recompute keeps such views as (parameter, geometry) through
    // the engine's pair and rebuilds them when backward reads them: inside a
    // PackedRecomputeScope the parameters go as after any forward.)
    for (std::size_t i : scratch_) {
      if (std::find(backward_attached_.begin(), backward_attached_.end(), i) == backward_attached_.end()) {
        backward_attached_.push_back(i);
      }
    }
    return;
  }
  detach_now(scratch_, grad_enabled ? TensorState::kHoldAfterFwd : TensorState::kHold);
}

// The transient uses of `module` (Note [External parameters]) end: those
// at zero uses join scratch_ to be detached.
void ModuleHooks::end_transient(std::size_t module) {
  if (transient_.empty()) return;
  std::size_t kept = 0;
  for (const auto& [m, i] : transient_) {
    if (m != module) {
      transient_[kept++] = {m, i};
      continue;
    }
    Param& p = params_[i];
    if (--p.uses == 0 && p.attached &&
        std::find(scratch_.begin(), scratch_.end(), i) == scratch_.end()) {
      scratch_.push_back(i);
    }
  }
  transient_.resize(kept);
}

// Note [The end of a backward] in hooks/backward_end.h.
void ModuleHooks::queue_backward_end() {
  if (!backward_end_.due()) return;
  backward_end_.queue(room_handle(), [this] { end_backward(); });
}

void ModuleHooks::backward_pre(std::size_t module) {
  check_module(module);
  room_.enter_hook();
  queue_backward_end();
  tracer_->point(PointKind::kBackward, static_cast<std::int64_t>(module));
  scratch_.clear();
  for (std::size_t i : modules_[module]) {
    if (!params_[i].attached) scratch_.push_back(i);
  }
  if (!scratch_.empty()) {
    make_room_for(scratch_);
    attach_now(scratch_, /*for_backward=*/true, /*replay=*/false, AccessMode::kRead);
  }
}

void ModuleHooks::land_gradient(std::size_t param, const at::Tensor& grad) {
  check_param(param);
  if (!gradient_sums_.accumulating()) {
    land_gradient_now(param, grad);
    return;
  }
  // Note [The weights' image instead of the restore] in gradient_sums.h: the
  // writes this landing makes to its chunk are counted apart from any other.
  // A write the forward made to the parameter, still attached to be read,
  // counts now, before (detach_now would count it in the landing).
  Param& p = params_[param];
  if (p.attached && p.read_only && version_of(p.param) != p.read_version) slot_written(p);
  const std::uint64_t began = gradient_sums_.landing_began(p.id);
  try {
    land_gradient_now(param, grad);
  } catch (...) {
    gradient_sums_.landing_ended(p.id, began, false);
    throw;
  }
  gradient_sums_.landing_ended(p.id, began, true);
}

void ModuleHooks::land_gradient_now(std::size_t param, const at::Tensor& grad) {
  room_.enter_hook();
  queue_backward_end();
  tracer_->point(PointKind::kGrad, static_cast<std::int64_t>(param));
  c10::NoGradGuard no_grad;
  TIDAL_CHECK(grad.layout() == at::kStrided, "land_gradient: parameter ", param,
              " got a gradient of layout ", grad.layout(),
              "; tidal's chunk slots hold dense (strided) gradients");
  Param& p = params_[param];
  // Note [Writes to a parameter]: a write the slot held and nobody carried is
  // overwritten now. engine.backward() carries them first; here it can only
  // be named.
  writes_.landing(param, p.param, p.attached && !p.served);
  // (A landed parameter that is attached is served: its slot holds the
  // gradient, Note [Weights while gradients wait].)
  if (p.attached && !p.landed) {
    slot_written(p);  // (before the copy: Note [Chunks on NVMe: clean chunks])
    copy_gradient(p.param, grad);
    if (!gradient_sums_.accumulating()) grad_norms_.measure(param, grad);
    p.landed = true;
    scratch_.assign(1, param);
    detach_now(scratch_, TensorState::kHoldAfterBwd);
    return;
  }
  if (p.attached) {
    scratch_.assign(1, param);
    detach_now(scratch_, TensorState::kHold);
  }
  at::Tensor slot = binding_->access(p.id, kSlot, MemorySpace::kDevice, p.shape);
  try {
    if (p.landed) {
      // A second gradient before the step: the sum, as torch's .grad.
      slot.add_(grad.to(slot.device(), slot.scalar_type()));
      if (!gradient_sums_.accumulating()) grad_norms_.measure(param, slot);
    } else {
      copy_gradient(slot, grad);
      if (!gradient_sums_.accumulating()) grad_norms_.measure(param, grad);
    }
  } catch (...) {
    scheduler_->release(TensorRef{kSlot, p.id},
                        p.landed ? TensorState::kHoldAfterBwd : TensorState::kHold);
    throw;
  }
  p.landed = true;
  scheduler_->release(TensorRef{kSlot, p.id}, TensorState::kHoldAfterBwd);
  room_.chunks_moved();
}

void ModuleHooks::read_param(std::size_t param, bool learn) {
  check_param(param);
  Param& p = params_[param];
  if (p.attached) return;
  std::vector<std::size_t> one{param};
  if (running_.empty()) {
    // Outside any hooked forward: end_backward() detaches it.
    make_room_for(one);
    attach_now(one, /*for_backward=*/true, /*replay=*/false);
    return;
  }
  const std::size_t module = running_.back();
  std::vector<std::size_t>& list = modules_[module];
  // One use for the running module, ended by its forward_post: a parameter
  // already on its list got that use from its forward_pre.
  bool counted = false;
  if (std::find(list.begin(), list.end(), param) == list.end()) {
    if (learn) {
      list.push_back(param);
    } else {
      transient_.emplace_back(module, param);
    }
    ++p.uses;
    counted = true;
  }
  try {
    make_room_for(one);
    attach_now(one, /*for_backward=*/false, /*replay=*/false);
  } catch (...) {
    if (counted) {
      --p.uses;
      if (!learn) transient_.pop_back();
    }
    throw;
  }
}

// ---- pieces ----------------------------------------------------------------

void ModuleHooks::attach(const std::vector<std::size_t>& params, bool for_backward, bool replay) {
  std::vector<std::size_t> need;
  for (std::size_t i : params) {
    check_param(i);
    if (!params_[i].attached && std::find(need.begin(), need.end(), i) == need.end()) {
      need.push_back(i);
    }
  }
  if (need.empty()) return;
  make_room_for(need);
  attach_now(need, for_backward, replay);
}

void ModuleHooks::detach(const std::vector<std::size_t>& params, TensorState state) {
  for (std::size_t i : params) check_param(i);
  std::vector<std::size_t> attached;
  for (std::size_t i : params) {
    if (params_[i].attached && std::find(attached.begin(), attached.end(), i) == attached.end()) {
      attached.push_back(i);
    }
  }
  detach_now(attached, state);
}

void ModuleHooks::end_backward() {
  backward_end_.ended();
  std::vector<std::size_t> rest;
  rest.swap(backward_attached_);
  detach(rest, TensorState::kHold);
}

std::vector<std::string> ModuleHooks::release_all() noexcept {
  std::vector<std::string> failed;
  backward_attached_.clear();
  backward_end_.ended();
  running_.clear();
  transient_.clear();
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    p.uses = 0;
    if (!p.attached) continue;
    try {
      const TensorRef ref{kSlot, p.id};
      slot_written(p);  // (after an error nothing says it was only read)
      if (!p.served && scheduler_->store().state(ref) == TensorState::kCompute) {
        scheduler_->release(ref, TensorState::kHold);
      }
    } catch (const std::exception& e) {
      try {
        failed.push_back(scheduler_->store().tensor_name(p.id) + ": " + e.what());
      } catch (...) {
      }
    }
    try {
      detaching(i);
      p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
    } catch (...) {
    }
    p.attached = false;
    p.served = false;
  }
  attached_by_data_.clear();
  chunks_in_use_.clear();
  return failed;
}

// ---- gradient accumulation -------------------------------------------------

std::vector<bool> ModuleHooks::first_sums(const std::vector<std::size_t>& params, const char* caller) const {
  std::vector<bool> first;
  first.reserve(params.size());
  for (std::size_t i : params) {
    check_param(i);
    TIDAL_CHECK(!params_[i].attached, "ModuleHooks.", caller, ": parameter ", i,
                " is attached; fold after backward");
    first.push_back(!params_[i].summed);
  }
  return first;
}

void ModuleHooks::folded(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) {
    params_[i].landed = false;
    params_[i].summed = true;
  }
}

void ModuleHooks::fold_gradients(const std::vector<std::size_t>& params, MemorySpace space,
                                 int num_threads, const cpu_adam::BlockRunner* runner) {
  gradient_sums_.fold(ids_of(params), first_sums(params, "fold_gradients"), space, num_threads, runner,
                      every_landed_of_chunk(params));
  folded(params);
}

bool ModuleHooks::every_landed_of_chunk(const std::vector<std::size_t>& params) const {
  if (params.empty()) return false;
  const ChunkIndex chunk = params_[params[0]].chunk;
  for (std::size_t i : params) {
    if (params_[i].chunk != chunk) return false;
  }
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].chunk == chunk && params_[i].landed &&
        std::find(params.begin(), params.end(), i) == params.end()) {
      return false;
    }
  }
  return true;
}

StartedFold ModuleHooks::start_fold(const std::vector<std::size_t>& params, bool measure) {
  StartedFold fold = gradient_sums_.start_fold(ids_of(params), first_sums(params, "start_fold"),
                                               every_landed_of_chunk(params), measure);
  fold.params = params;
  return fold;
}

void ModuleHooks::end_fold(StartedFold& fold, bool done) {
  gradient_sums_.end_fold(fold, done);
  if (done) folded(fold.params);
}

void ModuleHooks::measure_sums(const std::vector<std::size_t>& params) {
  gradient_sums_.measure(ids_of(params), params, grad_norms_);
}

void ModuleHooks::measured_in_fold(const StartedFold& fold) {
  TIDAL_INTERNAL_ASSERT(fold.ended && fold.folded && fold.stats != nullptr &&
                            fold.stats->size() == fold.params.size(),
                        "ModuleHooks::measured_in_fold: a fold that did not measure its ", fold.params.size(),
                        " sums (ended ", fold.ended, ", folded ", fold.folded, ")");
  for (std::size_t k = 0; k < fold.params.size(); ++k) grad_norms_.record(fold.params[k], (*fold.stats)[k]);
}

void ModuleHooks::drop_sums(const std::vector<std::size_t>& params) {
  // (Not those handed over: their slots are an update's until free_sums.)
  std::vector<std::size_t> summed;
  summed.reserve(params.size());
  for (std::size_t i : params) {
    if (params_.at(i).summed) summed.push_back(i);
  }
  gradient_sums_.drop(ids_of(summed));
  for (std::size_t i : summed) params_[i].summed = false;
}

void ModuleHooks::hand_over_sums(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) check_param(i);
  for (std::size_t i : params) params_[i].summed = false;
}

void ModuleHooks::free_sums(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) {
    TIDAL_CHECK(!params_.at(i).summed, "free_sums: parameter ", i,
                " has a sum again (folded since it was handed over)");
  }
  gradient_sums_.drop(ids_of(params));
}

std::vector<std::size_t> ModuleHooks::summed_params() const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].summed) out.push_back(i);
  }
  return out;
}

// ---- queries ---------------------------------------------------------------

std::vector<std::size_t> ModuleHooks::landed_params() const {
  std::vector<std::size_t> out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].landed) out.push_back(i);
  }
  return out;
}

void ModuleHooks::clear_landed(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) check_param(i);
  for (std::size_t i : params) params_[i].landed = false;
  gradient_sums_.forget_landings(ids_of(params));
}

std::int64_t ModuleHooks::attached_at(const void* data) const {
  const auto it = attached_by_data_.find(data);
  return it == attached_by_data_.end() ? -1 : static_cast<std::int64_t>(it->second);
}

std::vector<std::size_t> ModuleHooks::take_first_use() {
  std::vector<std::size_t> out;
  out.swap(first_use_);
  return out;
}

// ---- attaching and detaching -------------------------------------------------

// The chunk room for the parameters in use plus `params` at once (Note [The
// warm-up budget]; make_room under DTR: Note [DTR under the training engine]).
void ModuleHooks::make_room_for(const std::vector<std::size_t>& params) {
  if (!room_.follows_need()) return;
  std::size_t need = chunks_in_use_.bytes();
  std::vector<ChunkIndex> added;
  for (std::size_t i : params) {
    if (params_[i].landed) continue;  // served from its master, not its chunk
    const ChunkIndex c = params_[i].chunk;
    if (!chunks_in_use_.in_use(c) && std::find(added.begin(), added.end(), c) == added.end()) {
      added.push_back(c);
      need += chunks_in_use_.chunk_bytes(c);
    }
  }
  room_.make_room(need);
}

// Note [Weights while gradients wait]: a temporary device tensor holding
// `p`'s weight, made from its fp32 master.
at::Tensor ModuleHooks::weight_from_master(const Param& p) {
  const ChunkStore& store = scheduler_->store();
  const TensorRef ref{ChunkKind::kParam32, p.id};
  TIDAL_CHECK(holds_data(store.state(ref)), "tidal: parameter '", store.tensor_name(p.id),
              "' is used while its 16-bit slot holds its gradient (between backward and the step), "
              "and its fp32 master is not in this process (data parallel: another rank owns its "
              "chunk); call engine.step() or engine.zero_grad() before using the model again");
  const MemorySpace space = store.chunk(store.chunk_of(ref)).space();
  void* data = scheduler_->access(ref, space, AccessMode::kRead);  // (copied, never written)
  at::Tensor weight;
  try {
    c10::NoGradGuard no_grad;
    const at::Tensor master = slot_view(data, p.shape, at::kFloat, binding_->torch_device(space));
    weight = master.to(binding_->torch_device(MemorySpace::kDevice), binding_->dtype(kSlot),
                       /*non_blocking=*/false, /*copy=*/true);
  } catch (...) {
    scheduler_->release(ref, TensorState::kHold);
    throw;
  }
  scheduler_->release(ref, TensorState::kHold);
  return weight;
}

void ModuleHooks::attach_now(const std::vector<std::size_t>& params, bool for_backward,
                             bool replay, AccessMode mode) {
  // All or nothing: the slots accessed so far go back to HOLD when an access
  // throws.
  std::size_t done = 0;
  try {
    for (; done < params.size(); ++done) {
      Param& p = params_[params[done]];
      if (p.landed) {
        p.param.set_data(weight_from_master(p));
        p.served = true;
        continue;
      }
      at::Tensor slot = binding_->access(p.id, kSlot, MemorySpace::kDevice, p.shape, mode);
      p.param.set_data(slot);
    }
  } catch (...) {
    for (std::size_t k = 0; k < done; ++k) {
      Param& p = params_[params[k]];
      if (p.served) {
        p.served = false;
      } else {
        scheduler_->release(TensorRef{kSlot, p.id}, TensorState::kHold);
      }
      p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
    }
    throw;
  }
  for (std::size_t i : params) {
    Param& p = params_[i];
    writes_.attached(i, p.param);
    p.read_only = mode == AccessMode::kRead && !p.served;
    p.read_version = version_of(p.param);
    p.slot_data = storage_data(p.param);
    p.attached = true;
    attached_by_data_[p.slot_data] = i;
    if (!p.served) chunks_in_use_.add(p.chunk);
    if (for_backward) backward_attached_.push_back(i);
    if (track_first_use_ && !replay && !p.first_used) {
      p.first_used = true;
      first_use_.push_back(i);
    }
  }
  room_.chunks_moved();
}

void ModuleHooks::detach_now(const std::vector<std::size_t>& params, TensorState state) {
  for (std::size_t i : params) {
    Param& p = params_[i];
    if (!p.attached) continue;
    // Note [Chunks on NVMe: clean chunks]: a write while attached to be read
    // (an in-place op in the forward) is one, before the chunk may move.
    if (p.read_only && version_of(p.param) != p.read_version) slot_written(p);
    p.read_only = false;
    if (!p.served) scheduler_->release(TensorRef{kSlot, p.id}, state);
    attached_by_data_.erase(p.slot_data);
    detaching(i);
    p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
    p.attached = false;
    if (p.served) {
      p.served = false;
    } else {
      chunks_in_use_.remove(p.chunk);
    }
  }
  room_.chunks_moved();
}

namespace {
thread_local int t_packed_recompute = 0;
}  // namespace

PackedRecomputeScope::PackedRecomputeScope() { ++t_packed_recompute; }
PackedRecomputeScope::~PackedRecomputeScope() { --t_packed_recompute; }
bool PackedRecomputeScope::active() { return t_packed_recompute > 0; }
void PackedRecomputeScope::enter() { ++t_packed_recompute; }
void PackedRecomputeScope::exit() {
  TIDAL_INTERNAL_ASSERT(t_packed_recompute > 0, "PackedRecomputeScope::exit without enter");
  --t_packed_recompute;
}

// ---- writes to the parameters ------------------------------------------------

// Note [Writes to a parameter]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Scripts write parameters outside forward: EMA weights, weight clipping,
// re-initialising a head, loading weights by hand, pruning masks. Between
// steps a parameter is an empty placeholder unless a read through its module
// attached it (Note [External parameters]), so a write either reached the
// 16-bit slot (attached) or nothing (a held Parameter, a placeholder), and the
// fp32 master, from which the step makes the next 16-bit copy, never. The
// parameter's version counter (which set_data keeps) says that a write
// happened and when: between an attach and a detach, to the slot; else to a
// placeholder (WriteTracker, hooks/write_tracker.h, keeps the versions).
// take_param_writes() tells the engine, which puts what the slot holds (or a
// tensor set as `p.data`) into the master and refuses a lost write by name
// (OutsideAccess, python/tidal/engine/outside_access.py). A write through `p.data` (a tensor
// with a version counter of its own) is not seen this way: on an attached
// parameter it reaches the slot and shows as data that differs from the
// master only where the engine compares them; on a placeholder it writes
// nothing.

void ModuleHooks::slot_written(Param& p) {
  if (!p.read_only) return;  // attached by a write access: its chunk counts as changed already
  scheduler_->mark_written(TensorRef{kSlot, p.id});
  p.read_only = false;
}

// Parameter `i`'s data is about to go to the placeholder.
void ModuleHooks::detaching(std::size_t i) {
  const Param& p = params_[i];
  writes_.detaching(i, p.param, !p.served && storage_data(p.param) == p.slot_data);
}

ParamWrites ModuleHooks::take_param_writes() {
  ParamWrites out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    if (p.attached && !p.served && storage_data(p.param) != p.slot_data) {
      // `p.data = t` on an attached parameter: t goes to the engine, the
      // parameter back to its slot.
      out.assigned.emplace_back(i, p.param.detach().clone());
      p.param.set_data(slot_view(const_cast<void*>(p.slot_data), p.shape,
                                 binding_->dtype(kSlot), binding_->torch_device(MemorySpace::kDevice)));
      writes_.seen(i, p.param, /*attached=*/true, /*forget=*/false);
    } else if (!p.attached && p.param.numel() != 0) {
      // `p.data = t` on a placeholder: t goes to the engine.
      out.assigned.emplace_back(i, p.param.detach().clone());
      p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
      writes_.seen(i, p.param, /*attached=*/false, /*forget=*/false);
    } else {
      writes_.look(i, p.param, p.attached, /*on_slot=*/!p.served);
    }
    writes_.take(i, out);
  }
  return out;
}

void ModuleHooks::sync_param_writes(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) {
    check_param(i);
    writes_.seen(i, params_[i].param, params_[i].attached, /*forget=*/true);
  }
}

void ModuleHooks::sync_param_writes() {
  for (std::size_t i = 0; i < params_.size(); ++i) {
    writes_.seen(i, params_[i].param, params_[i].attached, /*forget=*/true);
  }
}

}  // namespace tidal::hooks
