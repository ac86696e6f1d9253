// The engine's module and gradient hooks, one C++ call each: the parameters'
// use counts and attached flags, the trace point, the chunk room for the
// moment, attach/detach through the ParamBinding (with the scheduler's
// prefetch), and a gradient landing in its 16-bit slot.
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
//                    norms as they land]) and written into p's 16-bit slot,
//                    which is then released to HOLD_AFTER_BWD; p counts as
//                    landed until clear_landed() (or a fold) says otherwise.
// A parameter is known by its index here (the engine's record index, stable
// across relayout); the store's tensor id of each index follows the layout
// (set_chunks). The engine keeps the user API and the error messages in
// Python. With gradient accumulation (Note [Gradient sums in chunks] in
// cpu_adam/adam.h) a gradient lands the same way, unmeasured; at the end of
// each backward fold_gradients() adds a chunk's landed gradients into their
// fp32 sums in one call, and the step measures the sums (measure_sums).
//
// Note [Gradient norms as they land]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// The step needs the global L2 norm of the gradients (clipping) and whether
// all are finite (fp16 overflow). Each gradient is measured as it lands, while
// it is in cache: a CPU gradient (the simulated device, CPU training) by
// cpu_adam's grad_stats on its memory (squares in fp32, summed in double; no
// torch op: a torch norm per gradient was ~4.5 us of every landing on the
// simulated device), a device gradient by an fp32 torch norm that stays on the device
// until take_grad_norm() reduces them all with one read. Both measures agree
// to the fp32 rounding of the squares' sums (about 1e-6 relative).
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
// Note [The end of a backward]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// engine.backward() ends each backward with end_backward(). A script that
// calls loss.backward() itself (the Hugging Face Trainer, accelerate) does
// not: the first backward_pre or land_gradient of a backward queues a final
// callback on autograd's engine (the graph task's final callbacks run before
// backward returns), which does the same: the parameters attached for
// backward go back to their chunks, and the simulated device's meter of
// torch's CPU allocations stops (Note [The memory tracer]). Only for a
// ModuleHooks owned by a shared_ptr (the engine's). Such a backward is known
// to the engine by take_backward_ended(); what engine.backward() does after
// its backward (gradient accumulation's fold, counting the micro-step) the
// engine does at its next call. Where a backward must go through
// engine.backward() (fp16 loss scaling, data parallel), set_raw_backward()
// holds the reason, and the first hook of a backward not run by it raises
// it, before any gradient lands.
//
// Thread safety: none; one thread at a time (forward on the caller's thread,
// backward's hooks on autograd's while the caller waits).
#pragma once

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "chunk/chunk_id.h"
#include "chunk/tensor_state.h"
#include "cpu_adam/adam.h"
#include "hooks/dtr/storage_runtime.h"
#include "hooks/param_binding.h"
#include "runtime/tracer/memory_tracer.h"
#include "runtime/scheduler/chunk_scheduler.h"

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

class ModuleHooks : public dtr::ChunkArbiter, public std::enable_shared_from_this<ModuleHooks> {
 public:
  // None of the three is owned; set_chunks replaces the first two.
  ModuleHooks(ChunkScheduler* scheduler, ParamBinding* binding, MemoryTracer* tracer);
  ~ModuleHooks() override;
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
  // DTR manages activations: the chunk room rises to what attaching needs
  // (MemoryTracer::make_room) in every step, not only in the warm-up.
  void set_make_room(bool on) { make_room_ = on; }
  // The arbiter (Note [DTR under the training engine] in
  // python/tidal/engine/dtr_link.py): while on, every attach, detach and
  // landed gradient sets the running DTR session's eviction threshold to
  // dtr_threshold().
  // link_bytes_per_s > 0 also prices chunks for the sessions this engine's
  // parameter provider joins (Note [The arbiter between chunks and
  // activations] in hooks/dtr/storage_runtime.h): evictions go to a chunk
  // when its round trip over the link costs less per byte than the
  // activation's recompute.
  void set_dtr_arbiter(bool on, std::size_t limit, std::size_t cap, double link_bytes_per_s = 0);
  // The DTR session routing ops now, told by this engine's parameter
  // provider (EngineParamProvider, engine_dtr.h), or nullptr: the session
  // chunk attaches evict activations for and whose threshold the arbiter
  // sets. Not owned; the session clears it before it goes.
  void set_dtr_session(dtr::ActivationRoom* session) { dtr_session_.store(session); }
  double chunk_seconds_per_byte() const override;
  std::size_t evict_chunk() override;
  // On the simulated device (Note [The simulated device's budget is a hard
  // limit] in hooks/host_allocation_counter.h): an allocation that would
  // pass the budget first moves chunks not in use off the device, on this
  // thread, before it fails (and DTR evicts activations).
  // On a GPU (after set_cuda_room) the same room maker answers torch's cache
  // misses instead (Note [Room on a cache miss] in hooks/cuda_room.h), on
  // whatever thread allocates (backward runs on autograd's device thread).
  void set_device_room_maker(bool on);
  bool free_device_room(std::size_t bytes);
  // The engine's GPU: device `ordinal` and its budget `cap` (torch's cap for
  // this engine); from then on set_device_room_maker arms the CUDA callback.
  void set_cuda_room(int ordinal, std::size_t cap);
  // limit - the chunk bytes held on the device, at most cap (when > 0), at
  // least 1 (0 would mean "no threshold").
  std::size_t dtr_threshold() const;
  void rebalance_dtr() const;
  // Record the order of first attaches (until the engine's relayout).
  void set_track_first_use(bool on) { track_first_use_ = on; }

  // ---- the hooks (Note [One call per hook]) ---------------------------------
  void forward_pre(std::size_t module, bool trace_point = true);
  void forward_post(std::size_t module, bool grad_enabled);
  void backward_pre(std::size_t module);
  void land_gradient(std::size_t param, const at::Tensor& grad);
  // A read of `param` found its placeholder (Note [External parameters]).
  // learn: add it to the innermost running module's parameters.
  void read_param(std::size_t param, bool learn);

  // Note [The end of a backward]: engine.backward() is running its backward;
  // a backward it does not run raises `refusal` unless it is empty.
  void set_engine_backward(bool running) { engine_backward_ = running; }
  void set_raw_backward(std::string refusal) { raw_refusal_ = std::move(refusal); }
  // Note [The end of a backward]: a backward engine.backward() does not run
  // (loss.backward() on the model) limits the simulated device again at its
  // first hook, as engine.backward() does before it starts (between a forward
  // and its backward nothing is limited): `limit` turns the tracer's hard
  // limit on, `room_maker` the room maker with it.
  void set_raw_backward_limits(bool limit, bool room_maker) {
    raw_limit_ = limit;
    raw_room_maker_ = room_maker;
  }
  // Whether a backward that engine.backward() did not run ended since the last call.
  bool take_backward_ended() {
    const bool ended = raw_backward_ended_;
    raw_backward_ended_ = false;
    return ended;
  }

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
  // On: land_gradient() does not measure (the step measures the sums).
  void set_accumulating(bool on) { accumulating_ = on; }
  // The gradients in the 16-bit slots of `params` (one chunk's; none
  // attached) are added into their sums (written when first[i]) in `space`,
  // and the slots get their weights back from the fp32 masters: one
  // cpu_adam::fold_gradients pass over CPU-addressable memory, torch ops on a
  // GPU. At most num_threads CPU threads (0: all). Every slot ends HOLD and
  // its parameter no longer counts as landed; on an error the gradients stay
  // in their slots (still landed) and new sums hold nothing.
  void fold_gradients(const std::vector<std::size_t>& params, const std::vector<bool>& first,
                      MemorySpace space, int num_threads = 0,
                      const cpu_adam::BlockRunner* runner = nullptr);
  // Measures the gradient sums of `params` where their chunks are, into what
  // take_grad_norm() returns.
  void measure_sums(const std::vector<std::size_t>& params);
  // The sums of `params` are consumed (the step) or dropped: FREE, so their
  // chunks give their memory back.
  void drop_sums(const std::vector<std::size_t>& params);

  // ---- queries -------------------------------------------------------------
  bool attached(std::size_t param) const { return params_.at(param).attached; }

  // Note [Writes to a parameter]: what user code did to the parameters since
  // the last call (or sync_param_writes): `written`, in-place writes the
  // 16-bit slot holds; `assigned`, a tensor set as the parameter's data
  // (`p.data = t`), returned with the parameter put back as it was; `lost`,
  // in-place writes to an empty placeholder or to a weight made from the
  // master (nothing holds them).
  struct ParamWrites {
    std::vector<std::size_t> written;
    std::vector<std::pair<std::size_t, at::Tensor>> assigned;
    std::vector<std::size_t> lost;
  };
  ParamWrites take_param_writes();
  // The parameters' current versions count as seen (torch's own copy into
  // the placeholders in load_state_dict, after the engine wrote the chunks).
  void sync_param_writes();
  void sync_param_writes(const std::vector<std::size_t>& params);
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
  // The gradients landed since the last take or clear: the sum of their
  // squares and whether every element was finite (Note [Gradient norms as
  // they land]). Reads the device once when device gradients landed.
  struct GradNorm {
    double sum_squares = 0.0;
    bool finite = true;
  };
  GradNorm take_grad_norm();
  void clear_grad_norm();
  // Parameters in the order of their first attach since tracking began.
  std::vector<std::size_t> take_first_use();
  // The most 16-bit chunk bytes the attached parameters needed at once.
  std::size_t peak_bytes_in_use() const { return peak_bytes_in_use_; }
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
    bool served = false;  // attached to a weight made from the master
    bool first_used = false;
    // Note [Gradient norms as they land]: the landed gradient's measure, one
    // of the two: the sum of squares of a CPU gradient, or a device norm.
    bool measured = false;
    bool finite = true;
    double sum_squares = 0.0;
    at::Tensor norm;
    // Note [Writes to a parameter]: its version counter when it was last
    // attached and detached, the slot its data viewed while attached, and
    // what a write did since the engine last took the writes.
    std::uint32_t version_attached = 0;
    std::uint32_t version_detached = 0;
    const void* slot_data = nullptr;
    bool written = false;  // written while attached to its slot: the slot has it
    bool lost = false;     // written while detached (or on a weight from the master)
  };

  void queue_backward_end();
  // Note [Writes to a parameter]: before the parameter's data goes to the placeholder.
  void note_detach(Param& p);
  void measure_gradient(std::size_t param, const at::Tensor& grad);
  void measure_sum(const at::Tensor& sum);
  at::Tensor weight_from_master(const Param& p);
  void end_transient(std::size_t module);
  void make_room_for(const std::vector<std::size_t>& params);
  void reserve_for_chunks(std::size_t need);
  void attach_now(const std::vector<std::size_t>& params, bool for_backward, bool replay);
  void detach_now(const std::vector<std::size_t>& params, TensorState state);
  std::size_t chunk_bytes(ChunkIndex chunk) const;
  void count_chunk(ChunkIndex chunk, int delta);
  void check_param(std::size_t param) const;
  void check_module(std::size_t module) const;

  ChunkScheduler* scheduler_;
  ParamBinding* binding_;
  MemoryTracer* tracer_;
  std::vector<Param> params_;
  std::vector<std::vector<std::size_t>> modules_;
  std::unordered_map<const void*, std::size_t> attached_by_data_;
  // Attached parameters per 16-bit chunk, and the bytes of the chunks with any.
  std::vector<std::uint32_t> attached_in_chunk_;
  std::size_t bytes_in_use_ = 0;
  std::size_t peak_bytes_in_use_ = 0;
  std::vector<std::size_t> backward_attached_;
  // Note [Gradient norms as they land]: the parameters measured since the
  // last take (their measures are in Param), and the gradient sums measured
  // (accumulation: CPU statistics and device norms).
  std::vector<std::size_t> measured_;
  GradNorm host_norm_;
  std::vector<at::Tensor> norms_;
  // Note [External parameters]: the hooked modules running (innermost
  // last), and transient uses (module, parameter) that module's forward_post ends.
  std::vector<std::size_t> running_;
  std::vector<std::pair<std::size_t, std::size_t>> transient_;
  std::vector<std::size_t> first_use_;
  bool make_room_ = false;
  bool dtr_arbiter_ = false;
  std::atomic<dtr::ActivationRoom*> dtr_session_{nullptr};
  std::size_t dtr_limit_ = 0;
  std::size_t dtr_cap_ = 0;
  double dtr_link_bytes_per_s_ = 0;
  bool track_first_use_ = false;
  bool accumulating_ = false;
  // Note [The end of a backward].
  bool backward_end_queued_ = false;
  bool room_maker_ = false;
  int cuda_ordinal_ = -1;          // set_cuda_room: the CUDA callback instead of the host counter's
  std::size_t cuda_cap_ = 0;
  std::uint64_t cuda_room_token_ = 0;  // nonzero while this engine's callback is armed
  bool engine_backward_ = false;
  bool raw_backward_ended_ = false;
  bool raw_limit_ = false;
  bool raw_room_maker_ = false;
  std::string raw_refusal_;
  // Scratch of the hooks, reused to keep them free of allocations.
  std::vector<std::size_t> scratch_;
};

}  // namespace tidal::hooks
