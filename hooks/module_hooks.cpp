#include "hooks/module_hooks.h"

#include "hooks/cuda_room.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <iterator>
#include <limits>
#include <optional>
#include <span>
#include <thread>
#include <utility>

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/graph_task.h>

#include "cpu_adam/adam.h"
#include "hooks/host_allocation_counter.h"
#include "hooks/dtr/interceptor.h"
#include "runtime/core/error.h"

namespace tidal::hooks {
namespace {

constexpr ChunkKind kSlot = ChunkKind::kParam16;

// cpu_adam's name for a dtype its kernels take.
std::optional<cpu_adam::DType> cpu_adam_dtype(at::ScalarType type) {
  switch (type) {
    case at::kFloat:
      return cpu_adam::DType::kFloat32;
    case at::kHalf:
      return cpu_adam::DType::kFloat16;
    case at::kBFloat16:
      return cpu_adam::DType::kBFloat16;
    default:
      return std::nullopt;
  }
}

const void* storage_data(const at::Tensor& t) {
  return t.storage().data_ptr().get();
}

// A tensor's version counter: in-place writes through it (or through views of
// it) count; Tensor::set_data keeps it, `p.data` makes another.
std::uint32_t version_of(const at::Tensor& t) {
  return t.unsafeGetTensorImpl()->version_counter().current_version();
}

// dst = src: a memcpy for contiguous CPU tensors of one dtype and size (a
// gradient landing in its slot on the simulated device; copy_ costs ~2 us of
// dispatch for a small tensor), else torch's copy_ into dst's data, which
// autograd does not see (dst may be a parameter).
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
    : scheduler_(scheduler), binding_(binding), tracer_(tracer) {
  TIDAL_INTERNAL_ASSERT(scheduler_ != nullptr && binding_ != nullptr && tracer_ != nullptr,
                        "ModuleHooks needs a scheduler, a binding and a tracer");
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
  p.version_attached = p.version_detached = version_of(p.param);
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
  for (std::size_t i = 0; i < ids.size(); ++i) {
    params_[i].id = ids[i];
    params_[i].chunk = scheduler_->store().placement(ids[i]).chunk;
  }
  attached_in_chunk_.assign(scheduler_->store().num_chunks(), 0);
  bytes_in_use_ = 0;
}

void ModuleHooks::check_param(std::size_t param) const {
  TIDAL_CHECK_INDEX(param < params_.size(), "ModuleHooks: parameter index ", param, " of ",
                    params_.size());
}

void ModuleHooks::check_module(std::size_t module) const {
  TIDAL_CHECK_INDEX(module < modules_.size(), "ModuleHooks: module index ", module, " of ",
                    modules_.size());
}

// ---- the hooks -------------------------------------------------------------

void ModuleHooks::forward_pre(std::size_t module, bool trace_point) {
  check_module(module);
  if (cuda_ordinal_ >= 0) set_cuda_room_thread();  // (Note [Room on a cache miss])
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
      attach_now(scratch_, /*for_backward=*/false, /*replay=*/false);
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

// Note [The end of a backward].
void ModuleHooks::queue_backward_end() {
  if (backward_end_queued_ || torch::autograd::get_current_graph_task_id() == -1) return;
  TIDAL_CHECK(engine_backward_ || raw_refusal_.empty(), raw_refusal_);
  std::weak_ptr<ModuleHooks> self = weak_from_this();
  if (self.expired()) return;
  const bool raw = !engine_backward_;
  if (raw && raw_limit_ && cuda_ordinal_ < 0) {
    // Limited from here as under engine.backward() (set_raw_backward_limits).
    tracer_->set_enforce(true);
    if (raw_room_maker_) set_device_room_maker(true);
  }
  torch::autograd::Engine::get_default_engine().queue_callback([self, raw] {
    if (const std::shared_ptr<ModuleHooks> hooks = self.lock()) {
      hooks->end_backward();
      // What the engine's _count(False) does after its own backward.
      hooks->tracer_->set_enforce(false);
      hooks->set_device_room_maker(false);
      set_host_allocation_counting(false);
      if (raw) hooks->raw_backward_ended_ = true;
    }
  });
  backward_end_queued_ = true;
}

void ModuleHooks::backward_pre(std::size_t module) {
  check_module(module);
  if (cuda_ordinal_ >= 0) set_cuda_room_thread();  // (Note [Room on a cache miss])
  queue_backward_end();
  tracer_->point(PointKind::kBackward, static_cast<std::int64_t>(module));
  scratch_.clear();
  for (std::size_t i : modules_[module]) {
    if (!params_[i].attached) scratch_.push_back(i);
  }
  if (!scratch_.empty()) {
    make_room_for(scratch_);
    attach_now(scratch_, /*for_backward=*/true, /*replay=*/false);
  }
}

void ModuleHooks::land_gradient(std::size_t param, const at::Tensor& grad) {
  check_param(param);
  if (cuda_ordinal_ >= 0) set_cuda_room_thread();  // (Note [Room on a cache miss])
  queue_backward_end();
  tracer_->point(PointKind::kGrad, static_cast<std::int64_t>(param));
  c10::NoGradGuard no_grad;
  TIDAL_CHECK(grad.layout() == at::kStrided, "land_gradient: parameter ", param,
              " got a gradient of layout ", grad.layout(),
              "; tidal's chunk slots hold dense (strided) gradients");
  Param& p = params_[param];
  // Note [Writes to a parameter]: a write the slot held (made in the forward,
  // or before a loss.backward()) and nobody carried is overwritten now.
  // engine.backward() carries them first; here it can only be named.
  if (p.attached && !p.served && version_of(p.param) != p.version_attached) {
    p.lost = true;
    p.version_attached = version_of(p.param);
  }
  if (p.written) {
    p.written = false;
    p.lost = true;
  }
  // (A landed parameter that is attached is served: its slot holds the
  // gradient, Note [Weights while gradients wait].)
  if (p.attached && !p.landed) {
    copy_gradient(p.param, grad);
    if (!accumulating_) measure_gradient(param, grad);
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
      if (!accumulating_) measure_gradient(param, slot);
    } else {
      copy_gradient(slot, grad);
      if (!accumulating_) measure_gradient(param, grad);
    }
  } catch (...) {
    scheduler_->release(TensorRef{kSlot, p.id},
                        p.landed ? TensorState::kHoldAfterBwd : TensorState::kHold);
    throw;
  }
  p.landed = true;
  scheduler_->release(TensorRef{kSlot, p.id}, TensorState::kHoldAfterBwd);
  tracer_->update_nonchunk_limit();
  rebalance_dtr();
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
  backward_end_queued_ = false;
  std::vector<std::size_t> rest;
  rest.swap(backward_attached_);
  detach(rest, TensorState::kHold);
}

std::vector<std::string> ModuleHooks::release_all() noexcept {
  std::vector<std::string> failed;
  backward_attached_.clear();
  backward_end_queued_ = false;
  running_.clear();
  transient_.clear();
  for (Param& p : params_) {
    p.uses = 0;
    if (!p.attached) continue;
    try {
      const TensorRef ref{kSlot, p.id};
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
      note_detach(p);
      p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
    } catch (...) {
    }
    p.attached = false;
    p.served = false;
  }
  attached_by_data_.clear();
  std::fill(attached_in_chunk_.begin(), attached_in_chunk_.end(), 0);
  bytes_in_use_ = 0;
  return failed;
}

// ---- gradient accumulation -------------------------------------------------

void ModuleHooks::fold_gradients(const std::vector<std::size_t>& params,
                                 const std::vector<bool>& first, MemorySpace space,
                                 int num_threads, const cpu_adam::BlockRunner* runner) {
  TIDAL_CHECK(first.size() == params.size(), "ModuleHooks.fold_gradients: ", first.size(),
              " first flags for ", params.size(), " parameters");
  for (std::size_t i : params) {
    check_param(i);
    TIDAL_CHECK(!params_[i].attached, "ModuleHooks.fold_gradients: parameter ", i,
                " is attached; fold after backward");
  }
  if (params.empty()) return;
  c10::NoGradGuard no_grad;
  constexpr ChunkKind kKinds[3] = {kSlot, ChunkKind::kParam32, ChunkKind::kGradAccum};
  // The states to go back to on an error: the gradient stays in its slot, the
  // master is unchanged, a sum written for the first time holds nothing.
  struct Held {
    TensorRef ref;
    TensorState before;
  };
  std::vector<Held> held;
  held.reserve(3 * params.size());
  const bool host_memory = binding_->torch_device(space).is_cpu();
  std::vector<cpu_adam::FoldSpan> spans;
  std::vector<at::Tensor> halves, masters, sums;
  try {
    for (std::size_t k = 0; k < params.size(); ++k) {
      const Param& p = params_[params[k]];
      const std::size_t numel = scheduler_->store().tensor_numel(p.id);
      void* data[3];
      for (int j = 0; j < 3; ++j) {
        const TensorRef ref{kKinds[j], p.id};
        const TensorState before = scheduler_->store().state(ref);
        data[j] = scheduler_->access(ref, space);
        held.push_back({ref, before});
      }
      if (host_memory) {
        spans.push_back({static_cast<float*>(data[2]), data[0], static_cast<const float*>(data[1]),
                         numel, static_cast<bool>(first[k])});
      } else {
        const std::int64_t n = static_cast<std::int64_t>(numel);
        const at::Device device = binding_->torch_device(space);
        halves.push_back(slot_view(data[0], {n}, binding_->dtype(kSlot), device));
        masters.push_back(slot_view(data[1], {n}, at::kFloat, device));
        sums.push_back(slot_view(data[2], {n}, at::kFloat, device));
      }
    }
    if (host_memory) {
      const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(binding_->dtype(kSlot));
      TIDAL_INTERNAL_ASSERT(dtype.has_value(), "a 16-bit chunk list of another dtype");
      cpu_adam::fold_gradients(*dtype, spans, cpu_adam::ExecOptions{num_threads, cpu_adam::CopyStores::kAuto, runner});
    } else {
      for (std::size_t k = 0; k < params.size(); ++k) {
        if (first[k]) {
          sums[k].copy_(halves[k]);
        } else {
          sums[k].add_(halves[k]);
        }
      }
      for (std::size_t k = 0; k < params.size(); ++k) halves[k].copy_(masters[k]);
    }
  } catch (...) {
    for (const Held& h : held) {
      try {
        scheduler_->release(h.ref, h.before == TensorState::kFree ? TensorState::kFree
                                                                  : TensorState::kHold);
      } catch (...) {
      }
    }
    // A gradient that was in its slot stays there (HOLD_AFTER_BWD cannot be
    // re-entered; the engine still counts it as landed and restores it).
    throw;
  }
  for (const Held& h : held) scheduler_->release(h.ref, TensorState::kHold);
  for (std::size_t i : params) params_[i].landed = false;
}

void ModuleHooks::measure_sums(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) check_param(i);
  c10::NoGradGuard no_grad;
  for (std::size_t i : params) {
    const Param& p = params_[i];
    const TensorRef ref{ChunkKind::kGradAccum, p.id};
    const ChunkId chunk = scheduler_->store().chunk_of(ref);
    const MemorySpace space = scheduler_->store().chunk(chunk).space();
    TIDAL_CHECK(holds_data(scheduler_->store().state(ref)), "ModuleHooks.measure_sums: parameter ",
                i, " ('", scheduler_->store().tensor_name(p.id), "') has no gradient sum");
    const std::int64_t n = static_cast<std::int64_t>(scheduler_->store().tensor_numel(p.id));
    void* data = scheduler_->access(ref, space);
    try {
      measure_sum(slot_view(data, {n}, at::kFloat, binding_->torch_device(space)));
    } catch (...) {
      scheduler_->release(ref, TensorState::kHold);
      throw;
    }
    scheduler_->release(ref, TensorState::kHold);
  }
}

void ModuleHooks::drop_sums(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) check_param(i);
  for (std::size_t i : params) {
    scheduler_->set_state(TensorRef{ChunkKind::kGradAccum, params_[i].id}, TensorState::kFree);
  }
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
}

std::int64_t ModuleHooks::attached_at(const void* data) const {
  const auto it = attached_by_data_.find(data);
  return it == attached_by_data_.end() ? -1 : static_cast<std::int64_t>(it->second);
}

ModuleHooks::GradNorm ModuleHooks::take_grad_norm() {
  GradNorm out = host_norm_;
  std::vector<at::Tensor> device = norms_;
  for (std::size_t i : measured_) {
    const Param& p = params_[i];
    if (p.norm.defined()) {
      device.push_back(p.norm);
    } else {
      out.sum_squares += p.sum_squares;
      out.finite = out.finite && p.finite;
    }
  }
  if (!device.empty()) {
    c10::NoGradGuard no_grad;
    // Squares in double: an fp16 run's scaled norms may square past fp32.
    const double squares = at::stack(device).to(at::kDouble).square().sum().item<double>();
    out.sum_squares += squares;
    out.finite = out.finite && std::isfinite(squares);
  }
  clear_grad_norm();
  return out;
}

void ModuleHooks::clear_grad_norm() {
  for (std::size_t i : measured_) {
    Param& p = params_[i];
    p.measured = false;
    p.norm = at::Tensor();
  }
  measured_.clear();
  host_norm_ = GradNorm{};
  norms_.clear();
}

// The measure of parameter `param`'s landed gradient `grad` (replacing an
// earlier one: a second landing measures the sum).
void ModuleHooks::measure_gradient(std::size_t param, const at::Tensor& grad) {
  Param& p = params_[param];
  if (!p.measured) {
    p.measured = true;
    measured_.push_back(param);
  }
  p.norm = at::Tensor();
  p.sum_squares = 0.0;
  p.finite = true;
  const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(grad.scalar_type());
  if (grad.is_cpu() && grad.is_contiguous() && dtype) {
    const cpu_adam::GradSpan span{grad.const_data_ptr(), static_cast<std::size_t>(grad.numel())};
    const cpu_adam::GradStats stats = cpu_adam::grad_stats(*dtype, std::span(&span, 1));
    p.sum_squares = stats.sum_squares;
    p.finite = stats.finite;
    return;
  }
  p.norm = at::linalg_vector_norm(grad, 2, c10::nullopt, false, at::kFloat);
}

// A gradient sum's measure (accumulation: measure_sums).
void ModuleHooks::measure_sum(const at::Tensor& sum) {
  const std::optional<cpu_adam::DType> dtype = cpu_adam_dtype(sum.scalar_type());
  if (sum.is_cpu() && sum.is_contiguous() && dtype) {
    const cpu_adam::GradSpan span{sum.const_data_ptr(), static_cast<std::size_t>(sum.numel())};
    const cpu_adam::GradStats stats = cpu_adam::grad_stats(*dtype, std::span(&span, 1));
    host_norm_.sum_squares += stats.sum_squares;
    host_norm_.finite = host_norm_.finite && stats.finite;
    return;
  }
  norms_.push_back(at::linalg_vector_norm(sum, 2, c10::nullopt, false, at::kFloat));
}

std::vector<std::size_t> ModuleHooks::take_first_use() {
  std::vector<std::size_t> out;
  out.swap(first_use_);
  return out;
}

// ---- internals -------------------------------------------------------------

std::size_t ModuleHooks::chunk_bytes(ChunkIndex chunk) const {
  return scheduler_->store().chunk(make_chunk_id(kSlot, chunk)).capacity_bytes();
}

void ModuleHooks::count_chunk(ChunkIndex chunk, int delta) {
  if (chunk >= attached_in_chunk_.size()) attached_in_chunk_.resize(chunk + 1, 0);
  std::uint32_t& n = attached_in_chunk_[chunk];
  if (delta > 0) {
    if (n++ == 0) {
      bytes_in_use_ += chunk_bytes(chunk);
      peak_bytes_in_use_ = std::max(peak_bytes_in_use_, bytes_in_use_);
    }
  } else {
    TIDAL_INTERNAL_ASSERT(n > 0, "ModuleHooks: chunk ", chunk, " has no attached parameter");
    if (--n == 0) bytes_in_use_ -= chunk_bytes(chunk);
  }
}

// The chunk room for the parameters in use plus `params` at once (Note [The
// warm-up budget]; make_room under DTR: Note [DTR under the training engine]).
void ModuleHooks::make_room_for(const std::vector<std::size_t>& params) {
  if (!make_room_ && tracer_->warmed_up()) return;
  std::size_t need = bytes_in_use_;
  std::vector<ChunkIndex> added;
  for (std::size_t i : params) {
    if (params_[i].landed) continue;  // served from its master, not its chunk
    const ChunkIndex c = params_[i].chunk;
    const bool in_use = c < attached_in_chunk_.size() && attached_in_chunk_[c] > 0;
    if (!in_use && std::find(added.begin(), added.end(), c) == added.end()) {
      added.push_back(c);
      need += chunk_bytes(c);
    }
  }
  reserve_for_chunks(need);
  if (make_room_) {
    tracer_->make_room(need);
  } else {
    tracer_->grow_warmup_room(need);
  }
}

ModuleHooks::~ModuleHooks() {
  if (room_maker_) set_device_room_maker(false);
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
  void* data = scheduler_->access(ref, space);
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
                             bool replay) {
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
      at::Tensor slot = binding_->access(p.id, kSlot, MemorySpace::kDevice, p.shape);
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
    // Note [Writes to a parameter]: a write since the detach hit the placeholder.
    const std::uint32_t version = version_of(p.param);
    if (version != p.version_detached) p.lost = true;
    p.version_attached = version;
    p.slot_data = storage_data(p.param);
    p.attached = true;
    attached_by_data_[p.slot_data] = i;
    if (!p.served) count_chunk(p.chunk, +1);
    if (for_backward) backward_attached_.push_back(i);
    if (track_first_use_ && !replay && !p.first_used) {
      p.first_used = true;
      first_use_.push_back(i);
    }
  }
  tracer_->update_nonchunk_limit();
  rebalance_dtr();
}

void ModuleHooks::detach_now(const std::vector<std::size_t>& params, TensorState state) {
  for (std::size_t i : params) {
    Param& p = params_[i];
    if (!p.attached) continue;
    if (!p.served) scheduler_->release(TensorRef{kSlot, p.id}, state);
    attached_by_data_.erase(p.slot_data);
    note_detach(p);
    p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
    p.attached = false;
    if (p.served) {
      p.served = false;
    } else {
      count_chunk(p.chunk, -1);
    }
  }
  tracer_->update_nonchunk_limit();
  rebalance_dtr();
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
// placeholder. take_param_writes() tells the engine, which puts what the slot
// holds (or a tensor set as `p.data`) into the master and refuses a lost write
// by name (python/tidal/engine/external_mixin.py). A write through `p.data`
// (a tensor with a version counter of its own) is not seen this way: on an
// attached parameter it reaches the slot and shows as data that differs from
// the master only where the engine compares them; on a placeholder it writes
// nothing.
void ModuleHooks::note_detach(Param& p) {
  const std::uint32_t version = version_of(p.param);
  if (version != p.version_attached) {
    if (p.served || storage_data(p.param) != p.slot_data) {
      p.lost = true;  // a weight made from the master, or data set in a forward
    } else {
      p.written = true;
    }
  }
  p.version_detached = version;
}

ModuleHooks::ParamWrites ModuleHooks::take_param_writes() {
  ParamWrites out;
  for (std::size_t i = 0; i < params_.size(); ++i) {
    Param& p = params_[i];
    const std::uint32_t version = version_of(p.param);
    if (p.attached) {
      if (!p.served && storage_data(p.param) != p.slot_data) {
        // `p.data = t` on an attached parameter: t goes to the engine, the
        // parameter back to its slot.
        out.assigned.emplace_back(i, p.param.detach().clone());
        p.param.set_data(slot_view(const_cast<void*>(p.slot_data), p.shape,
                                   binding_->dtype(kSlot), binding_->torch_device(MemorySpace::kDevice)));
      } else if (version != p.version_attached) {
        (p.served ? p.lost : p.written) = true;
      }
      p.version_attached = version_of(p.param);
    } else {
      if (p.param.numel() != 0) {
        out.assigned.emplace_back(i, p.param.detach().clone());
        p.param.set_data(binding_->placeholder(kSlot, MemorySpace::kDevice));
      } else if (version != p.version_detached) {
        p.lost = true;
      }
      p.version_detached = version_of(p.param);
    }
    if (p.written) out.written.push_back(i);
    if (p.lost) out.lost.push_back(i);
    p.written = p.lost = false;
  }
  return out;
}

void ModuleHooks::sync_param_writes(const std::vector<std::size_t>& params) {
  for (std::size_t i : params) {
    check_param(i);
    Param& p = params_[i];
    const std::uint32_t version = version_of(p.param);
    if (p.attached) {
      p.version_attached = version;
    } else {
      p.version_detached = version;
    }
    p.written = p.lost = false;
  }
}

void ModuleHooks::sync_param_writes() {
  for (Param& p : params_) {
    const std::uint32_t version = version_of(p.param);
    if (p.attached) {
      p.version_attached = version;
    } else {
      p.version_detached = version;
    }
    p.written = p.lost = false;
  }
}

}  // namespace tidal::hooks
