// The engine's module and gradient hooks, one C++ call each: the parameters'
// use counts and attached flags, the trace point, the chunk room for the
// moment, attach/detach through the ParamBinding (with the scheduler's
// prefetch), and a gradient landing in its 16-bit slot.
//
// What ModuleHooks owns, and what its parts own (each a member, each with its
// own state):
//   ModuleHooks   the parameters and modules (by index), which are attached
//                 and for what (uses, backward, transient external reads),
//                 landed flags, the running modules, first-use order;
//   ChunksInUse   the 16-bit chunks the attached parameters hold (chunks_in_use.h);
//   DeviceRoom    room on the device for those chunks beside activations,
//                 the room maker and the arbiter with DTR (device_room.h);
//   BackwardEnd   the end of a backward and a raw loss.backward()'s rules
//                 (backward_end.h);
//   GradNorms     the landed gradients' measures for the step (grad_norms.h);
//   GradientSums  gradient accumulation's fp32 sums (gradient_sums.h);
//   WriteTracker  what user code wrote to the parameters (write_tracker.h).
//
// Note [One call per hook]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Each hook torch calls (a C++ callable, Note [Hooks torch calls into C++] in
// python/csrc/hook_callables.cpp) does one call into this class:
//   forward_pre(m)   trace point (FORWARD, m); every parameter of m counts one
//                    more use in flight; the chunk room for the parameters in
//                    use plus m's (Note [The warm-up budget], or make_room when
//                    DTR manages activations); the parameters not yet attached
//                    are attached (COMPUTE). All or nothing: when the attach
//                    throws, the use counts go back.
//   forward_post(m)  each parameter of m counts one use less; those at zero
//                    are detached to HOLD_AFTER_FWD (HOLD under no_grad).
//   backward_pre(m)  trace point (BACKWARD, m); m's parameters are attached
//                    and remembered: end_backward() detaches what is still
//                    attached when backward returns.
//   land_gradient(p) trace point (GRAD, p); the gradient measured for the
//                    step's clipping and overflow check (Note [Gradient
//                    norms as they land] in hooks/grad_norms.h) and written
//                    into p's 16-bit slot, which is then released to
//                    HOLD_AFTER_BWD; p counts as landed until clear_landed()
//                    (or a fold) says otherwise.
// A parameter is known by its index here (the engine's record index, stable
// across relayout); the store's tensor id of each index follows the layout
// (set_chunks). The engine keeps the user API and the error messages in
// Python. With gradient accumulation (Note [Gradient sums in chunks] in
// cpu_adam/adam.h) a gradient lands the same way, unmeasured; at the end of
// each backward fold_gradients() adds a chunk's landed gradients into their
// fp32 sums in one call, and the sums are measured (measure_sums) by the
// step, or right after their fold in the window's last backward (Note
// [Measured where folded] in tidal/engine/overlap.py).
//
// Note [External parameters]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A module's forward may read a parameter of another module without calling
// that module: nn.MultiheadAttention passes out_proj.weight to
// F.multi_head_attention_forward, CLIP's embeddings read
// position_embedding.weight.shape, a head reads a tied embedding's weight. A
// detached parameter is an empty placeholder, so such a read would compute
// with nothing. The engine sees every read that goes through a module's
// _parameters (attribute access does; python/tidal/engine/external.py) and
// calls read_param() for one that finds a placeholder:
//  * inside a forward (a module of running() is the innermost hooked module
//    running), the parameter is attached for that module (one more use, as
//    forward_pre does) and, with learn, added to its parameter list: from
//    then on its forward_pre attaches the parameter with its own, and
//    backward_pre for backward. Without learn (the innermost module running
//    is not hooked yet: the engine hooks it from the next forward on) the
//    use is transient: forward_post of that module ends it.
//  * outside any forward (backward without a module's forward running, a
//    regularizer in the loss, user code), the parameter is attached as
//    backward_pre attaches: end_backward() detaches it.
// A module can also be given parameters by hand (add_to_module:
// tidal.register_external_parameter, leaf modules).
//
// Note [Weights while gradients wait]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Between backward and the step a landed gradient occupies its parameter's
// 16-bit slot. A parameter attached then (a forward between backward and the
// step, evaluation under no_grad, the recompute of a checkpointed segment
// whose parameter also served a later segment, a second backward over a
// retained graph) must compute with its weight, not with that gradient: it is
// attached to a temporary device tensor made from its fp32 master ("served"),
// and the slot is left alone. A gradient landing on a parameter that has
// landed already (a second backward before the step, reentrant checkpointing)
// is added to the first, as torch accumulates .grad, and the parameter's
// norm is measured again over the sum.
//
// Thread safety: none; one thread at a time (forward on the caller's thread,
// backward's hooks on autograd's while the caller waits).
#pragma once

#include <ATen/ATen.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/tensor_state.h"
#include "cpu_adam/adam.h"
#include "hooks/backward_end.h"
#include "hooks/chunks_in_use.h"
#include "hooks/device_room.h"
#include "hooks/grad_norms.h"
#include "hooks/gradient_sums.h"
#include "hooks/param_binding.h"
#include "hooks/write_tracker.h"
#include "runtime/scheduler/chunk_scheduler.h"
#include "runtime/tracer/memory_tracer.h"

namespace tidal::hooks {

// On this thread, a recompute that packs what it saves through the engine's
// saved-tensor pair (tidal.recompute under an engine): its forward lets the
// parameters go as any forward does (Note [A recompute inside backward] in
// module_hooks.cpp). enter()/exit() for Python's context manager.
class PackedRecomputeScope {
 public:
  PackedRecomputeScope();
  ~PackedRecomputeScope();
  PackedRecomputeScope(const PackedRecomputeScope&) = delete;
  PackedRecomputeScope& operator=(const PackedRecomputeScope&) = delete;
  static bool active();
  static void enter();
  static void exit();
};

class ModuleHooks : public std::enable_shared_from_this<ModuleHooks> {
 public:
  // None of the three is owned; set_chunks replaces the first two.
  ModuleHooks(ChunkScheduler* scheduler, ParamBinding* binding, MemoryTracer* tracer);
  ModuleHooks(const ModuleHooks&) = delete;
  ModuleHooks& operator=(const ModuleHooks&) = delete;

  // ---- set-up -------------------------------------------------------------
  // Parameter `index` (the next one: indexes are 0, 1, ...) is `param`, the
  // store's tensor `id`, shaped `shape`.
  std::size_t add_param(at::Tensor param, TensorId id, std::vector<std::int64_t> shape);
  // Module `index` (the next one) uses these parameters (may be none: a
  // module that only reads others' parameters, Note [External parameters]).
  std::size_t add_module(std::vector<std::size_t> params);
  // Module `module` uses parameter `param` too, from its next forward on.
  void add_to_module(std::size_t module, std::size_t param);
  // After a relayout: the new scheduler and binding, and each parameter's
  // tensor id in them (ids[i] for parameter i). Nothing may be attached.
  void set_chunks(ChunkScheduler* scheduler, ParamBinding* binding,
                  const std::vector<TensorId>& ids);
  // Record the order of first attaches (until the engine's relayout).
  void set_track_first_use(bool on) { track_first_use_ = on; }

  // ---- the parts ------------------------------------------------------------
  DeviceRoom& room() { return room_; }
  const DeviceRoom& room() const { return room_; }
  // The room as a handle that keeps these hooks alive (the room maker's and
  // DTR's arbiter set's); empty unless a shared_ptr owns the hooks.
  std::weak_ptr<DeviceRoom> room_handle();
  BackwardEnd& backward_end() { return backward_end_; }
  GradNorms& grad_norms() { return grad_norms_; }
  GradientSums& gradient_sums() { return gradient_sums_; }

  // ---- the hooks (Note [One call per hook]) ---------------------------------
  void forward_pre(std::size_t module, bool trace_point = true);
  void forward_post(std::size_t module, bool grad_enabled);
  void backward_pre(std::size_t module);
  void land_gradient(std::size_t param, const at::Tensor& grad);
  // A read of `param` found its placeholder (Note [External parameters]).
  // learn: add it to the innermost running module's parameters.
  void read_param(std::size_t param, bool learn);

  // ---- pieces for the engine's other paths --------------------------------
  // Attach those of `params` not attached (the chunk room first, as
  // forward_pre). for_backward: end_backward() detaches them; replay: a
  // recompute's read (DTR), not a first use.
  void attach(const std::vector<std::size_t>& params, bool for_backward, bool replay);
  // Detach those of `params` that are attached, releasing them to `state`.
  void detach(const std::vector<std::size_t>& params, TensorState state);
  // Backward returned: what it attached and is still attached goes to HOLD.
  void end_backward();
  // After a failed forward or backward: every use count to zero, every
  // attached parameter back to its chunk (HOLD) whatever state it got to.
  // Never throws; returns a message per parameter that could not be released.
  std::vector<std::string> release_all() noexcept;

  // ---- gradient accumulation (Note [Gradient sums in chunks]) --------------
  // The gradients in the 16-bit slots of `params` (one chunk's; none
  // attached) are added into their sums (GradientSums::fold; a parameter
  // with no sum yet has it written); every slot ends HOLD, its parameter no
  // longer counts as landed and has a sum; on an error the gradients stay in
  // their slots (still landed) and the sums are as they were.
  void fold_gradients(const std::vector<std::size_t>& params, MemorySpace space, int num_threads = 0,
                      const cpu_adam::BlockRunner* runner = nullptr);
  // fold_gradients in two, for the pass on another thread (Note [Folds on
  // the worker] in tidal/engine/overlap.py): start_fold accesses the slots
  // of `params` (one chunk's, on the host; none attached) without waiting
  // for the copies into them (GradientSums::start_fold); end_fold, after
  // the pass ran (`folded`) or did not, releases them, and where folded the
  // parameters no longer count as landed and have a sum, as fold_gradients
  // leaves them. Until then they count as landed. `measure`: the pass also
  // measures the new sums (StartedFold::stats), for measured_in_fold.
  StartedFold start_fold(const std::vector<std::size_t>& params, bool measure = false);
  void end_fold(StartedFold& fold, bool done);
  // Measures the gradient sums of `params` where their chunks are, into what
  // grad_norms().take() returns.
  void measure_sums(const std::vector<std::size_t>& params);
  // measure_sums of the fold's parameters from what its pass measured as it
  // wrote their sums (a fold started with measure, ended done): the same
  // bits (Note [Measured in the fold] in tidal/engine/overlap.py).
  void measured_in_fold(const StartedFold& fold);
  // The sums of `params` are consumed (the step) or dropped; a parameter
  // without one (its sum handed over, below) is left as it is.
  void drop_sums(const std::vector<std::size_t>& params);
  // The step consumed the sums of `params`, which an update under the next
  // forward still reads: they no longer count as sums (summed() is false, the
  // next fold writes them afresh) but their slots keep their memory until
  // free_sums (Note [Measured where folded] in tidal/engine/overlap.py).
  void hand_over_sums(const std::vector<std::size_t>& params);
  // The slots of sums handed over go (FREE), their update done.
  void free_sums(const std::vector<std::size_t>& params);
  // Whether `param` has a gradient sum (folded since the last drop), and all
  // such parameters in index order.
  bool summed(std::size_t param) const { return params_.at(param).summed; }
  std::vector<std::size_t> summed_params() const;

  // ---- writes to the parameters (Note [Writes to a parameter]) ---------------
  // What user code did to the parameters since the last call (or
  // sync_param_writes); a tensor set as an attached parameter's data comes
  // back with the parameter put back as it was.
  ParamWrites take_param_writes();
  // The parameters' current versions count as seen (torch's own copy into
  // the placeholders in load_state_dict, after the engine wrote the chunks).
  void sync_param_writes();
  void sync_param_writes(const std::vector<std::size_t>& params);

  // ---- queries -------------------------------------------------------------
  bool attached(std::size_t param) const { return params_.at(param).attached; }
  // Attached to a weight made from its master (Note [Weights while gradients wait]).
  bool served(std::size_t param) const { return params_.at(param).served; }
  // The hooked modules whose forward is running, innermost last.
  const std::vector<std::size_t>& running() const { return running_; }
  const std::vector<std::size_t>& module_params(std::size_t module) const {
    return modules_.at(module);
  }
  // Whether `param`'s 16-bit slot holds a gradient that landed (not yet
  // folded, stepped or dropped), and all such parameters in index order.
  bool landed(std::size_t param) const { return params_.at(param).landed; }
  std::vector<std::size_t> landed_params() const;
  // The step consumed, or the engine dropped, the gradients of `params`.
  void clear_landed(const std::vector<std::size_t>& params);
  // Parameter `param` itself (its Parameter's TensorImpl).
  const at::Tensor& param(std::size_t param) const { return params_.at(param).param; }
  int uses(std::size_t param) const { return params_.at(param).uses; }
  // The attached parameter whose slot is the storage at `data`, or -1.
  std::int64_t attached_at(const void* data) const;
  // Parameters in the order of their first attach since tracking began.
  std::vector<std::size_t> take_first_use();
  // The most 16-bit chunk bytes the attached parameters needed at once.
  std::size_t peak_bytes_in_use() const { return chunks_in_use_.peak_bytes(); }
  std::size_t num_params() const { return params_.size(); }
  std::size_t num_modules() const { return modules_.size(); }

 private:
  struct Param {
    at::Tensor param;  // shares the module's Parameter TensorImpl
    TensorId id = kNoTensor;
    std::vector<std::int64_t> shape;
    ChunkIndex chunk = 0;
    int uses = 0;      // forward uses in flight (nested or shared modules)
    bool attached = false;
    bool landed = false;  // a gradient is in the 16-bit slot
    bool summed = false;  // its fp32 gradient sum holds something (accumulation)
    bool served = false;  // attached to a weight made from the master
    bool first_used = false;
    const void* slot_data = nullptr;  // the storage its data viewed when attached
    // Attached by a read access (forward, backward): its version then, and
    // whether its chunk still counts as unchanged (Note [Chunks on NVMe:
    // clean chunks] in runtime/scheduler/disk_tier.h).
    bool read_only = false;
    std::uint32_t read_version = 0;
  };

  void queue_backward_end();
  // land_gradient without the count of its writes (accumulating).
  void land_gradient_now(std::size_t param, const at::Tensor& grad);
  // Whether `params` are in one chunk and hold every gradient landed in it
  // (Note [The weights' image instead of the restore] in gradient_sums.h).
  bool every_landed_of_chunk(const std::vector<std::size_t>& params) const;
  void detaching(std::size_t i);
  at::Tensor weight_from_master(const Param& p);
  void end_transient(std::size_t module);
  void make_room_for(const std::vector<std::size_t>& params);
  // mode: AccessMode::kRead only for the hooks' own forward and backward.
  void attach_now(const std::vector<std::size_t>& params, bool for_backward, bool replay,
                  AccessMode mode = AccessMode::kWrite);
  // A write reached parameter `i`'s slot although it was attached to be read.
  void slot_written(Param& p);
  void detach_now(const std::vector<std::size_t>& params, TensorState state);
  std::vector<TensorId> ids_of(const std::vector<std::size_t>& params) const;
  void check_param(std::size_t param) const;
  // Whether each of `params` (checked, none attached: `caller` names the
  // call in the error) has no gradient sum yet, so a fold writes it.
  std::vector<bool> first_sums(const std::vector<std::size_t>& params, const char* caller) const;
  // `params` were folded: no longer landed, with a sum.
  void folded(const std::vector<std::size_t>& params);
  void check_module(std::size_t module) const;

  ChunkScheduler* scheduler_;
  ParamBinding* binding_;
  MemoryTracer* tracer_;
  std::vector<Param> params_;
  std::vector<std::vector<std::size_t>> modules_;
  std::unordered_map<const void*, std::size_t> attached_by_data_;
  std::vector<std::size_t> backward_attached_;
  // Note [External parameters]: the hooked modules running (innermost
  // last), and transient uses (module, parameter) that module's forward_post ends.
  std::vector<std::size_t> running_;
  std::vector<std::pair<std::size_t, std::size_t>> transient_;
  std::vector<std::size_t> first_use_;
  bool track_first_use_ = false;
  // Scratch of the hooks, reused to keep them free of allocations.
  std::vector<std::size_t> scratch_;

  ChunksInUse chunks_in_use_;
  DeviceRoom room_;
  BackwardEnd backward_end_;
  GradNorms grad_norms_;
  GradientSums gradient_sums_;
  WriteTracker writes_;
};

}  // namespace tidal::hooks
