// tidal._C.chunks: the chunk scheduler and parameter binding for the
// training engine (python/tidal/engine/). Chunk kinds, memory spaces and
// tensor states cross as enums (ChunkKind, MemorySpace, TensorState), tensors
// as zero-copy views of chunk slots.
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <array>
#include <cerrno>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "python/csrc/bindings.h"
#include "python/csrc/hook_callables.h"
#include "python/csrc/record.h"
#include "chunk/chunk_store.h"
#include "cpu_adam/update_worker.h"
#include "hooks/chunk_step.h"
#include "hooks/cuda_room.h"
#include "hooks/engine_chunks.h"
#include "hooks/host_allocation_counter.h"
#include "hooks/module_hooks.h"
#include "hooks/nonchunk_meters.h"
#include "hooks/param_binding.h"
#include "hooks/torch_memory_provider.h"
#include "hooks/torch_threads.h"
#include "runtime/tracer/memory_tracer.h"
#include "runtime/core/error.h"
#include "runtime/core/uncounted.h"
#include "runtime/device/device.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::python {
namespace {

using Chunks = hooks::EngineChunks;  // hooks/engine_chunks.h

// The NVMe tier as Chunks.disk shows it: what DiskTier says when asked.
struct DiskInfo {
  std::string path;
  bool direct = false;
  bool memory_backed = false;
  std::string backend;
  std::vector<std::string> removed_stale;
  std::size_t budget_bytes = 0;
  std::size_t file_bytes = 0;
  std::uint64_t bytes_read = 0;
  std::uint64_t bytes_written = 0;
  std::optional<std::string> failure;  // the first failed read or write
};

DiskInfo disk_info(const DiskTier& d) {
  DiskInfo out;
  out.path = d.path();
  out.direct = d.direct();
  out.memory_backed = d.memory_backed();
  out.backend = d.backend();
  out.removed_stale = d.removed_stale();
  out.budget_bytes = d.budget_bytes();
  out.file_bytes = d.held_bytes();
  out.bytes_read = d.bytes_read();
  out.bytes_written = d.bytes_written();
  if (d.failed()) out.failure = d.failure();
  return out;
}

// Note [Records, not dicts] in python/csrc/record.h: the scheduler's and the
// allocation hooks' counters, bound once each.
void bind_records(py::module_& m) {
  RecordBinding<ChunkSchedulerStats> stats(m, "SchedulerStats",
                                           "The chunk scheduler's counters (Chunks.stats()), bytes per space.");
#define TIDAL_FIELD(name) stats.field(#name, &ChunkSchedulerStats::name)
  TIDAL_FIELD(accesses);
  TIDAL_FIELD(releases);
  TIDAL_FIELD(hits);
  TIDAL_FIELD(prefetch_hits);
  TIDAL_FIELD(misses);
  TIDAL_FIELD(materializations);
  TIDAL_FIELD(prefetches);
  TIDAL_FIELD(prefetches_wasted);
  TIDAL_FIELD(evictions);
  TIDAL_FIELD(spills);
  TIDAL_FIELD(payload_drops);
  TIDAL_FIELD(copy_waits);
  TIDAL_FIELD(copy_wait_seconds);
  TIDAL_FIELD(host_block_allocations);
  TIDAL_FIELD(host_block_bytes_allocated);
  TIDAL_FIELD(device_block_allocations);
  TIDAL_FIELD(host_pins);
  TIDAL_FIELD(host_bytes_pinned);
  TIDAL_FIELD(pageable_copies);
  TIDAL_FIELD(block_waits);
  TIDAL_FIELD(block_wait_seconds);
  TIDAL_FIELD(bytes_left_leaving);
  TIDAL_FIELD(prefetch_rewinds);
  TIDAL_FIELD(evictions_ahead);
  TIDAL_FIELD(prefetches_put_off);
  TIDAL_FIELD(prefetches_ahead);
  TIDAL_FIELD(moves_host_to_device);
  TIDAL_FIELD(moves_device_to_host);
  TIDAL_FIELD(bytes_host_to_device);
  TIDAL_FIELD(bytes_device_to_host);
  TIDAL_FIELD(moves_host_to_disk);
  TIDAL_FIELD(moves_disk_to_host);
  TIDAL_FIELD(bytes_host_to_disk);
  TIDAL_FIELD(bytes_disk_to_host);
  TIDAL_FIELD(disk_writes_skipped);
  TIDAL_FIELD(bytes_disk_writes_skipped);
  TIDAL_FIELD(copies_down_skipped);
  TIDAL_FIELD(images_taken_back);
  TIDAL_FIELD(bytes_images_taken_back);
  TIDAL_FIELD(blocks_for_images);
  TIDAL_FIELD(bytes_down_skipped);
  TIDAL_FIELD(steps);
  TIDAL_FIELD(trace_adoptions);
  TIDAL_FIELD(trace_divergences);
#undef TIDAL_FIELD
  // The per-space arrays read as one field per space: resident_bytes_host, ...
  using PerSpace = std::array<std::size_t, kNumMemorySpaces> ChunkSchedulerStats::*;
  const std::pair<const char*, PerSpace> per_space[] = {
      {"resident_bytes_", &ChunkSchedulerStats::resident_bytes},
      {"peak_resident_bytes_", &ChunkSchedulerStats::peak_resident_bytes},
      {"held_bytes_", &ChunkSchedulerStats::held_bytes},
      {"budget_bytes_", &ChunkSchedulerStats::budget_bytes}};
  for (MemorySpace space : {MemorySpace::kHost, MemorySpace::kDevice, MemorySpace::kDisk}) {
    const std::size_t i = index_of(space);
    for (const auto& entry : per_space) {
      const PerSpace member = entry.second;
      const std::string name = std::string(entry.first) + to_string(space);
      stats.field_from(name.c_str(), [member, i](const ChunkSchedulerStats& s) { return (s.*member)[i]; });
    }
  }
  stats.done();

  RecordBinding<hooks::HostAllocationCounts>(m, "HostAllocationCounts",
                                             "torch's counted CPU allocations (Note [Counting CPU allocations]).")
      .field("live_bytes", &hooks::HostAllocationCounts::live_bytes)
      .field("peak_bytes", &hooks::HostAllocationCounts::peak_bytes)
      .field("allocations", &hooks::HostAllocationCounts::allocations)
      .done();
  RecordBinding<hooks::HostAllocationModelUse>(
      m, "HostAllocationModelUse", "The simulated device's caching allocator model (Note [Who owns a device byte]).")
      .field("on", &hooks::HostAllocationModelUse::on)
      .field("reserved", &hooks::HostAllocationModelUse::reserved)
      .field("allocated", &hooks::HostAllocationModelUse::allocated)
      .field("stuck", &hooks::HostAllocationModelUse::stuck)
      .field("largest_request", &hooks::HostAllocationModelUse::largest_request)
      .field("device_reserved_peak", &hooks::HostAllocationModelUse::device_reserved_peak)
      .field("misses", &hooks::HostAllocationModelUse::misses)
      .field("made_room", &hooks::HostAllocationModelUse::made_room)
      .field("failures", &hooks::HostAllocationModelUse::failures)
      .done();
  RecordBinding<hooks::CudaRoomCounts>(m, "CudaRoomCounts",
                                       "What the room maker on torch's cache misses did (hooks/cuda_room.h).")
      .field("misses", &hooks::CudaRoomCounts::misses)
      .field("made_room", &hooks::CudaRoomCounts::made_room)
      .field("bytes_asked", &hooks::CudaRoomCounts::bytes_asked)
      .field("short_of_room", &hooks::CudaRoomCounts::short_of_room)
      .field("errors", &hooks::CudaRoomCounts::errors)
      .field("largest_request", &hooks::CudaRoomCounts::largest_request)
      .field("last_error", &hooks::CudaRoomCounts::last_error)
      .done();
  RecordBinding<DiskInfo>(m, "DiskInfo", "The NVMe tier (Chunks.disk).")
      .field("path", &DiskInfo::path, "its file")
      .field("direct", &DiskInfo::direct, "whether it does direct I/O (O_DIRECT)")
      .field("memory_backed", &DiskInfo::memory_backed, "whether its file lives in memory (a tmpfs)")
      .field("backend", &DiskInfo::backend, "the I/O backend")
      .field("removed_stale", &DiskInfo::removed_stale, "stale files a killed process left, removed at its start")
      .field("budget_bytes", &DiskInfo::budget_bytes)
      .field("file_bytes", &DiskInfo::file_bytes, "the bytes its file holds now")
      .field("bytes_read", &DiskInfo::bytes_read)
      .field("bytes_written", &DiskInfo::bytes_written)
      .field("failure", &DiskInfo::failure, "its first failed read or write, or None")
      .done();
}

// Non-chunk memory read through Python (CUDA where torch's caching
// allocator could not be reached: torch.cuda.memory_reserved and its peak).
class CallbackMeter final : public NonChunkMeter {
 public:
  CallbackMeter(py::function read, py::function restart)
      : read_(std::move(read)), restart_(std::move(restart)) {}
  ~CallbackMeter() override {
    py::gil_scoped_acquire gil;
    read_ = py::function();
    restart_ = py::function();
  }
  std::pair<std::size_t, std::size_t> read() override {
    py::gil_scoped_acquire gil;
    const py::tuple t = read_();
    return {t[0].cast<std::size_t>(), t[1].cast<std::size_t>()};
  }
  void restart_peak() override {
    py::gil_scoped_acquire gil;
    restart_();
  }

 private:
  py::function read_;
  py::function restart_;
};

// The engine's tracer over a Chunks object, which it keeps alive (the
// engine swaps in the relaid-out one with set_chunks).
class Tracer {
 public:
  Tracer(py::object chunks, std::size_t device_budget, std::size_t margin, std::size_t warmup_room,
         std::shared_ptr<hooks::TorchMemoryProvider> provider, bool provider_baseline,
         std::optional<py::function> read, std::optional<py::function> restart, bool torch_caching)
      : chunks_(std::move(chunks)) {
    std::unique_ptr<NonChunkMeter> meter;
    if (provider != nullptr) {
      meter = hooks::make_provider_meter(std::move(provider), provider_baseline);
    } else if (read && restart) {
      meter = std::make_unique<CallbackMeter>(std::move(*read), std::move(*restart));
    } else {
      TIDAL_CHECK(!read && !restart, "MemoryTracer: give both read and restart, or neither");
      meter = hooks::make_host_counter_meter(device_budget, torch_caching);
    }
    tracer_ = std::make_unique<MemoryTracer>(
        &chunks_.cast<Chunks&>().scheduler(), std::move(meter),
        MemoryTracerLimits{device_budget, margin, warmup_room});
  }
  ~Tracer() {
    py::gil_scoped_release nogil;  // a callback meter's destructor takes the GIL itself
    tracer_.reset();
  }
  void set_chunks(py::object chunks) {
    tracer_->set_scheduler(&chunks.cast<Chunks&>().scheduler());
    chunks_ = std::move(chunks);
  }
  MemoryTracer& get() { return *tracer_; }

 private:
  py::object chunks_;
  std::unique_ptr<MemoryTracer> tracer_;
};

py::list timeline_list(const std::vector<TracePoint>& points) {
  py::list out;
  for (const TracePoint& p : points) {
    out.append(py::make_tuple(p.index, tidal::to_string(p.kind), p.what, p.chunk_bytes,
                              p.nonchunk_peak,
                              py::make_tuple(p.moves_host_to_device, p.moves_device_to_host,
                                             p.evictions)));
  }
  return out;
}

// The engine's module hooks over a Chunks object and a tracer, both kept
// alive here (Note [One call per hook] in hooks/module_hooks.h).
class Hooks {
 public:
  Hooks(py::object chunks, py::object tracer)
      : chunks_(std::move(chunks)), tracer_(std::move(tracer)),
        hooks_(std::make_shared<hooks::ModuleHooks>(&chunks_.cast<Chunks&>().scheduler(),
                                                    &chunks_.cast<Chunks&>().binding(),
                                                    &tracer_.cast<Tracer&>().get())) {}
  void set_chunks(py::object chunks, const std::vector<TensorId>& ids) {
    Chunks& c = chunks.cast<Chunks&>();
    hooks_->set_chunks(&c.scheduler(), &c.binding(), ids);
    chunks_ = std::move(chunks);
  }
  hooks::ModuleHooks& get() { return *hooks_; }
  // For the callables of hook_callables.h: `self` is this object's Python side.
  static HookTarget target(py::object self) {
    return HookTarget{self, self.cast<Hooks&>().hooks_};
  }
  const std::shared_ptr<hooks::ModuleHooks>& shared() const { return hooks_; }

 private:
  py::object chunks_;
  py::object tracer_;
  // Shared with the callables; a gradient hook or an output's tensor hook
  // holds it weakly (Note [Hooks torch calls into C++]).
  std::shared_ptr<hooks::ModuleHooks> hooks_;
};

}  // namespace

std::shared_ptr<hooks::ModuleHooks> module_hooks_of(py::handle hooks_object) {
  return hooks_object.cast<Hooks&>().shared();
}

static void bind_enums(py::module_& m) {
  py::enum_<TensorState>(m, "TensorState", "A tensor slot's state (chunk/tensor_state.h).")
      .value("FREE", TensorState::kFree)
      .value("COMPUTE", TensorState::kCompute)
      .value("HOLD", TensorState::kHold)
      .value("HOLD_AFTER_FWD", TensorState::kHoldAfterFwd)
      .value("HOLD_AFTER_BWD", TensorState::kHoldAfterBwd);
  py::enum_<ChunkKind>(m, "ChunkKind", "A chunk list (chunk/chunk_id.h): what its chunks hold.")
      .value("PARAM16", ChunkKind::kParam16)
      .value("PARAM32", ChunkKind::kParam32)
      .value("MOMENTUM", ChunkKind::kMomentum)
      .value("VARIANCE", ChunkKind::kVariance)
      .value("GRAD32", ChunkKind::kGradAccum);
  py::enum_<MemorySpace>(m, "MemorySpace", "Where a chunk is (chunk/memory_space.h).")
      .value("NONE", MemorySpace::kNone)
      .value("HOST", MemorySpace::kHost)
      .value("DEVICE", MemorySpace::kDevice)
      .value("DISK", MemorySpace::kDisk);
}

static void bind_hooks(py::module_& m) {
  using GIL = py::call_guard<py::gil_scoped_release>;
  using Index = std::size_t;
  py::class_<hooks::StartedFold, std::shared_ptr<hooks::StartedFold>>(
      m, "StartedFold", "A fold of one chunk's gradients begun by ModuleHooks.start_fold.")
      .def_property_readonly("ended", [](const hooks::StartedFold& f) { return f.ended; })
      .def_property_readonly("measures", [](const hooks::StartedFold& f) { return f.stats != nullptr; },
                             "Whether its pass also measures the new sums (start_fold's measure).")
      .def_property_readonly("takes_image", [](const hooks::StartedFold& f) { return f.image_chunk >= 0; },
                             "Whether its pass leaves the restore out and its end takes back the weights' "
                             "image (Note [The weights' image instead of the restore]).")
      .def(
          "submit",
          [](const hooks::StartedFold& fold, cpu_adam::UpdateWorker& worker, int num_threads,
             const std::string& pool) {
            TIDAL_CHECK(!fold.ended, "StartedFold.submit: the fold has ended");
            TIDAL_CHECK(!fold.spans.empty(), "StartedFold.submit: the fold has no tensors");
            cpu_adam::UpdateJob job;
            job.fences = fold.fences;
            job.folds = fold.spans;
            job.fold_dtype = fold.dtype;
            job.fold_stats = fold.stats;
            // (Names the job's chunk for run_or_wait; a span's master is null
            // where the fold takes back the weights' image.)
            job.chunk.param = const_cast<float*>(fold.masters.front());
            job.exec = cpu_adam::ExecOptions{num_threads, cpu_adam::CopyStores::kAuto,
                                             hooks::block_runner(pool)};
            return std::const_pointer_cast<cpu_adam::UpdateTicket>(worker.submit(std::move(job)));
          },
          py::arg("worker"), py::kw_only(), py::arg("num_threads") = 0, py::arg("pool") = "onetbb",
          "Queues the fold's pass on `worker` (an UpdateWorker; its fences waited for first) and "
          "returns the UpdateTicket; the fold's slots stay in use until ModuleHooks.end_fold.");
  py::class_<Hooks>(m, "ModuleHooks", R"doc(
The engine's module and gradient hooks, one call each (Note [One call per hook]
in hooks/module_hooks.h). Parameters and modules are known by index; calls that
may wait for a chunk copy release the GIL.)doc")
      .def(py::init<py::object, py::object>(), py::arg("chunks"), py::arg("tracer"))
      .def("add_param",
           [](Hooks& h, at::Tensor param, TensorId id, std::vector<std::int64_t> shape) {
             return h.get().add_param(std::move(param), id, std::move(shape));
           },
           py::arg("param"), py::arg("id"), py::arg("shape"))
      .def("add_module", [](Hooks& h, std::vector<Index> params) { return h.get().add_module(std::move(params)); },
           py::arg("params"))
      .def("add_to_module", [](Hooks& h, Index m, Index p) { h.get().add_to_module(m, p); },
           py::arg("module"), py::arg("param"),
           "Module `module` uses parameter `param` too, from its next forward on "
           "(Note [External parameters]).")
      .def("set_chunks", &Hooks::set_chunks, py::arg("chunks"), py::arg("ids"))
      .def("set_make_room", [](Hooks& h, bool on) { h.get().room().set_make_room(on); }, py::arg("on"))
      .def("set_dtr_arbiter",
           [](Hooks& h, bool on, std::size_t limit, std::size_t cap, double link) {
             h.get().room().set_dtr_arbiter(on, limit, cap, link);
           },
           py::arg("on"), py::arg("limit"), py::arg("cap"), py::arg("link_bytes_per_s") = 0.0,
           "While on, every attach, detach and landed gradient sets DTR's threshold to dtr_threshold(); "
           "with a link bandwidth, DTR's evictions go to a chunk when that costs less per byte "
           "(Note [The arbiter between chunks and activations]).")
      .def("dtr_threshold", [](Hooks& h) { return h.get().room().dtr_threshold(); },
           "limit - chunk bytes held on the device, capped, at least 1.")
      .def("set_track_first_use", [](Hooks& h, bool on) { h.get().set_track_first_use(on); },
           py::arg("on"))
      .def("forward_pre", [](Hooks& h, Index m, bool point) { h.get().forward_pre(m, point); }, GIL(),
           py::arg("module"), py::arg("trace_point") = true)
      .def("forward_post", [](Hooks& h, Index m, bool grad) { h.get().forward_post(m, grad); }, GIL(),
           py::arg("module"), py::arg("grad_enabled"))
      .def("backward_pre", [](Hooks& h, Index m) { h.get().backward_pre(m); }, GIL(), py::arg("module"))
      .def("land_gradient", [](Hooks& h, Index p, const at::Tensor& grad) { h.get().land_gradient(p, grad); },
           GIL(), py::arg("param"), py::arg("grad"))
      .def("attach",
           [](Hooks& h, const std::vector<Index>& params, bool for_backward, bool replay) {
             h.get().attach(params, for_backward, replay);
           },
           GIL(), py::arg("params"), py::kw_only(), py::arg("for_backward") = false,
           py::arg("replay") = false)
      .def("detach", [](Hooks& h, const std::vector<Index>& params, TensorState state) {
             h.get().detach(params, state);
           }, GIL(), py::arg("params"), py::arg("state"))
      .def("read_param", [](Hooks& h, Index p, bool learn) { h.get().read_param(p, learn); }, GIL(),
           py::arg("param"), py::arg("learn"),
           "A read of `param` found its placeholder: attach it for the innermost running module "
           "(learn: from then on in that module's forward), or until end_backward() outside any "
           "forward (Note [External parameters]).")
      .def("running", [](Hooks& h) { return h.get().running(); },
           "The hooked modules whose forward is running, innermost last.")
      .def("module_params", [](Hooks& h, Index m) { return h.get().module_params(m); }, py::arg("module"))
      .def("served", [](Hooks& h, Index p) { return h.get().served(p); }, py::arg("param"),
           "Whether `param` is attached to a weight made from its master (Note [Weights while "
           "gradients wait]).")
      .def("set_device_room_maker",
           [](Hooks& h, bool on) { h.get().room().set_device_room_maker(on, h.get().room_handle()); },
           py::arg("on"),
           "An allocation past the simulated device's budget first moves chunks not in use off the "
           "device (on this thread).")
      .def("set_cuda_room", [](Hooks& h, int ordinal, std::size_t cap) { h.get().room().set_cuda_room(ordinal, cap); },
           py::arg("ordinal"), py::arg("cap"),
           "On a GPU: set_device_room_maker arms torch's cache-miss callback for device `ordinal` "
           "under `cap` bytes (Note [Room on a cache miss] in hooks/cuda_room.h).")
      .def("take_param_writes", [](Hooks& h) {
             hooks::ParamWrites w = h.get().take_param_writes();
             return py::make_tuple(w.written, w.assigned, w.lost);
           },
           "(written, assigned, lost) since the last call: parameter indexes whose in-place writes "
           "the 16-bit slot holds, (index, tensor) set as a parameter's data (the parameter put "
           "back), and indexes whose writes nothing holds (Note [Writes to a parameter] in "
           "hooks/module_hooks.cpp).")
      .def("sync_param_writes",
           [](Hooks& h, std::optional<std::vector<Index>> params) {
             if (params) {
               h.get().sync_param_writes(std::vector<std::size_t>(params->begin(), params->end()));
             } else {
               h.get().sync_param_writes();
             }
           },
           py::arg("params") = py::none(),
           "The versions of `params` (None: all) now count as seen.")
      .def("set_engine_backward", [](Hooks& h, bool on) { h.get().backward_end().set_engine_backward(on); },
           py::arg("running"))
      .def("set_raw_backward_limits",
           [](Hooks& h, bool limit, bool room_maker) {
             h.get().backward_end().set_raw_backward_limits(limit, room_maker);
           },
           py::arg("limit"), py::arg("room_maker"))
      .def("set_raw_backward",
           [](Hooks& h, std::string refusal) { h.get().backward_end().set_raw_backward(std::move(refusal)); },
           py::arg("refusal"),
           "Non-empty: a backward not run by engine.backward() raises this (Note [The end of a backward] "
           "in hooks/backward_end.h).")
      .def("take_backward_ended", [](Hooks& h) { return h.get().backward_end().take_ended(); },
           "Whether a backward engine.backward() did not run ended since the last call.")
      .def("end_backward", [](Hooks& h) { h.get().end_backward(); }, GIL())
      .def("release_all", [](Hooks& h) { return h.get().release_all(); }, GIL())
      .def("forward_pre_hook",
           [](py::object self, Index m, py::object python_path, py::object failed) {
             return forward_pre_hook(Hooks::target(std::move(self)), m, std::move(python_path),
                                     std::move(failed));
           },
           py::arg("module"), py::arg("python_path"), py::arg("failed"),
           "Module `module`'s forward pre-hook as a C++ callable (Note [Hooks torch calls into "
           "C++] in python/csrc/hook_callables.cpp).")
      .def("forward_post_hook",
           [](py::object self, Index m, py::object python_path, py::object wrap_outputs,
              py::object backward_failed) {
             return forward_post_hook(Hooks::target(std::move(self)), m, std::move(python_path),
                                      std::move(wrap_outputs), std::move(backward_failed));
           },
           py::arg("module"), py::arg("python_path"), py::arg("wrap_outputs"), py::arg("backward_failed"),
           "Module `module`'s forward hook as a C++ callable; its outputs get C++ backward pre-hooks.")
      .def("grad_hook",
           [](py::object self, Index p, py::object python_path) {
             return grad_hook(Hooks::target(std::move(self)), p, std::move(python_path));
           },
           py::arg("param"), py::arg("python_path"),
           "Parameter `param`'s post-accumulate-grad hook as a C++ callable (holds the hooks weakly).")
      .def("saved_tensor_hooks",
           [](py::object self, py::object attach) {
             return saved_tensor_hooks(Hooks::target(std::move(self)), std::move(attach));
           },
           py::arg("attach"),
           "(pack, unpack) for torch.autograd.graph.saved_tensors_hooks: parameter aliases are "
           "saved as (parameter, geometry); attach(param) runs before a detached one is rebuilt.")
      .def("attached", [](Hooks& h, Index p) { return h.get().attached(p); }, py::arg("param"))
      .def("landed", [](Hooks& h, Index p) { return h.get().landed(p); }, py::arg("param"),
           "Whether `param`'s 16-bit slot holds a landed gradient (not yet folded, stepped or dropped).")
      .def("landed_params", [](Hooks& h) { return h.get().landed_params(); })
      .def("clear_landed", [](Hooks& h, const std::vector<Index>& params) { h.get().clear_landed(params); },
           py::arg("params"))
      .def("uses", [](Hooks& h, Index p) { return h.get().uses(p); }, py::arg("param"))
      .def("attached_at",
           [](Hooks& h, const at::Tensor& t) -> std::int64_t {
             if (!t.defined() || !t.has_storage()) return -1;
             return h.get().attached_at(t.storage().data_ptr().get());
           },
           py::arg("tensor"),
           "The index of the attached parameter whose slot is `tensor`'s storage, or -1.")
      .def("take_grad_norm",
           [](Hooks& h) {
             const hooks::GradNorm n = h.get().grad_norms().take();
             return py::make_tuple(n.sum_squares, n.finite);
           },
           "(sum of squares, all finite) of the gradients landed since the last take or "
           "clear (Note [Gradient norms as they land] in hooks/grad_norms.h).")
      .def("clear_grad_norm", [](Hooks& h) { h.get().grad_norms().clear(); })
      .def("measure_grad",
           [](Hooks& h, Index p, const at::Tensor& grad) { h.get().grad_norms().measure(p, grad); },
           py::arg("param"), py::arg("grad"),
           "`param`'s gradient measured again, replacing its landing's measure: user code wrote it "
           "between backward and step (Note [Gradients between backward and step] in "
           "python/tidal/engine/user_grads.py).")
      .def("set_fold_images", [](Hooks& h, bool on) { h.get().gradient_sums().set_use_images(on); },
           py::arg("on"),
           "Note [The weights' image instead of the restore] in hooks/gradient_sums.h on (the default) "
           "or off: every fold rounds the masters back into the 16-bit slots (for comparisons).")
      .def_property_readonly("fold_late_restores",
                             [](Hooks& h) { return h.get().gradient_sums().late_restores(); },
                             "Folds that left the restore out for the weights' image and made it at their "
                             "end after all (Note [The weights' image instead of the restore]).")
      .def("set_accumulating", [](Hooks& h, bool on) { h.get().gradient_sums().set_accumulating(on); },
           py::arg("on"))
      .def("fold_gradients",
           [](Hooks& h, const std::vector<Index>& params, MemorySpace space, int num_threads,
              const std::string& pool) {
             h.get().fold_gradients(params, space, num_threads, hooks::block_runner(pool));
           },
           GIL(), py::arg("params"), py::arg("space"), py::kw_only(),
           py::arg("num_threads") = 0, py::arg("pool") = "onetbb",
           "Gradient accumulation: the landed gradients of one chunk's `params` into their "
           "fp32 sums, weights back into the 16-bit slots (Note [Gradient sums in chunks]).")
      .def("start_fold",
           [](Hooks& h, const std::vector<Index>& params, bool measure) {
             return std::make_shared<hooks::StartedFold>(h.get().start_fold(params, measure));
           },
           GIL(), py::arg("params"), py::kw_only(), py::arg("measure") = false,
           "fold_gradients in two (Note [Folds on the worker] in tidal/engine/overlap.py): the "
           "slots of one chunk's `params` on the host, in use without waiting for the copies into "
           "them; StartedFold.submit runs the pass on an UpdateWorker, end_fold releases them. "
           "`measure`: the pass also measures the new sums, for measured_in_fold.")
      .def("end_fold",
           [](Hooks& h, hooks::StartedFold& fold, bool folded) { h.get().end_fold(fold, folded); },
           py::arg("fold"), py::arg("folded"),
           "Releases a started fold's slots: where `folded` (its pass ran) as fold_gradients "
           "leaves them, otherwise as they were.")
      .def("measure_sums", [](Hooks& h, const std::vector<Index>& params) { h.get().measure_sums(params); },
           GIL(), py::arg("params"))
      .def("measured_in_fold", [](Hooks& h, const hooks::StartedFold& fold) { h.get().measured_in_fold(fold); },
           py::arg("fold"),
           "measure_sums of a fold's parameters from what its pass measured (a fold started with "
           "measure, ended folded): Note [Measured in the fold] in tidal/engine/overlap.py.")
      .def("drop_sums", [](Hooks& h, const std::vector<Index>& params) { h.get().drop_sums(params); },
           py::arg("params"))
      .def("hand_over_sums", [](Hooks& h, const std::vector<Index>& params) { h.get().hand_over_sums(params); },
           py::arg("params"),
           "The step consumed these sums, which an update under the next forward still reads: no "
           "longer sums, their slots kept until free_sums (Note [Measured where folded] in "
           "python/tidal/engine/overlap.py).")
      .def("free_sums", [](Hooks& h, const std::vector<Index>& params) { h.get().free_sums(params); },
           py::arg("params"))
      .def("summed_params", [](Hooks& h) { return h.get().summed_params(); },
           "The parameters whose gradient sum holds something (folded since the last drop), in "
           "index order.")
      .def("take_first_use", [](Hooks& h) { return h.get().take_first_use(); })
      .def_property_readonly("peak_bytes_in_use",
                             [](Hooks& h) { return h.get().peak_bytes_in_use(); },
                             "The most 16-bit chunk bytes the attached parameters needed at once.")
      .def_property_readonly("num_params", [](Hooks& h) { return h.get().num_params(); })
      .def_property_readonly("num_modules", [](Hooks& h) { return h.get().num_modules(); });
}

static void bind_tracer(py::module_& m) {
  py::enum_<PointKind>(m, "PointKind", "Where a trace point is.")
      .value("FORWARD", PointKind::kForward)
      .value("BACKWARD", PointKind::kBackward)
      .value("GRAD", PointKind::kGrad)
      .value("STEP", PointKind::kStep);
  using GIL = py::call_guard<py::gil_scoped_release>;
  py::class_<Tracer>(m, "MemoryTracer", R"doc(
The engine's memory tracer and device-budget arbiter (runtime/tracer/memory_tracer.h):
one call per trace point measures non-chunk device memory and sets the chunk
budget. The meter: `provider` (a TorchMemoryProvider), or `read`/`restart`
callables, or (neither) torch's CPU allocations counted on the simulated device.)doc")
      .def(py::init<py::object, std::size_t, std::size_t, std::size_t,
                    std::shared_ptr<hooks::TorchMemoryProvider>, bool, std::optional<py::function>,
                    std::optional<py::function>, bool>(),
           py::arg("chunks"), py::kw_only(), py::arg("device_budget"), py::arg("margin"),
           py::arg("warmup_room"), py::arg("provider") = nullptr,
           py::arg("provider_baseline") = false, py::arg("read") = py::none(),
           py::arg("restart") = py::none(), py::arg("torch_caching") = false)
      .def("set_chunks", &Tracer::set_chunks, py::arg("chunks"))
      .def("point", [](Tracer& t, PointKind kind, std::int64_t what) { t.get().point(kind, what); },
           GIL(), py::arg("kind"), py::arg("what") = -1)
      .def("end_step", [](Tracer& t) { t.get().end_step(); }, GIL())
      .def("drop_step", [](Tracer& t) { t.get().drop_step(); })
      .def("grow_warmup_room", [](Tracer& t, std::size_t need) { t.get().grow_warmup_room(need); },
           GIL(), py::arg("need"))
      .def("make_room", [](Tracer& t, std::size_t need) { t.get().make_room(need); }, GIL(),
           py::arg("need"))
      .def("set_warmup_room", [](Tracer& t, std::size_t bytes) { t.get().set_warmup_room(bytes); },
           py::arg("bytes"))
      .def("live", [](Tracer& t) { return t.get().live(); }, GIL())
      .def("set_enforce", [](Tracer& t, bool on) { t.get().set_enforce(on); }, py::arg("on"),
           "Chunks plus the meter's bytes never pass the budget less the margin: the meter's "
           "limit follows the chunk bytes (Note [The simulated device's budget is a hard limit]).")
      .def_property_readonly("limit", [](Tracer& t) { return t.get().limit(); })
      .def_property_readonly("warmed_up", [](Tracer& t) { return t.get().warmed_up(); })
      .def_property_readonly("warmup_room", [](Tracer& t) { return t.get().warmup_room(); })
      .def_property_readonly("peak_nonchunk", [](Tracer& t) { return t.get().peak_nonchunk(); })
      .def_property_readonly("peak_total", [](Tracer& t) { return t.get().peak_total(); })
      .def_property_readonly("peak_reserved", [](Tracer& t) { return t.get().peak_reserved(); })
      .def_property_readonly("overruns", [](Tracer& t) { return t.get().overruns(); })
      .def_property_readonly("trace", [](Tracer& t) { return t.get().trace(); })
      .def_property_readonly("timeline", [](Tracer& t) { return timeline_list(t.get().timeline()); },
                             "The last completed step's points: (index, kind, what, chunk bytes held, "
                             "non-chunk peak of the interval ending there, (moves host->device, "
                             "moves device->host, evictions)).")
      .def_property_readonly(
          "timeline_base",
          [](Tracer& t) {
            const TracePoint& b = t.get().timeline_base();
            return py::make_tuple(b.moves_host_to_device, b.moves_device_to_host, b.evictions);
          },
          "The counters the timeline's first interval counts from: the previous step's last "
          "point's (moves host->device, moves device->host, evictions).");
}

void bind_chunks(py::module_& parent) {
  py::module_ m = parent.def_submodule("chunks", R"doc(
The chunk scheduler and the parameter binding the training engine drives
(see runtime/scheduler/chunk_scheduler.h and hooks/param_binding.h). One
Python thread drives a Chunks object.)doc");
  bind_enums(m);  // first: the signatures below name them
  bind_records(m);
  py::class_<CopyFence>(m, "CopyFence",
                        "A copy into a chunk still running (Chunks.copy_fence): calling it waits "
                        "for the copy to land, the GIL released.")
      .def("__call__", [](const CopyFence& f) {
        py::gil_scoped_release release;
        f.wait();
      });

  py::class_<Chunks>(m, "Chunks")
      .def(py::init([](std::shared_ptr<Device> device, std::size_t chunk_bytes, const std::string& param_dtype,
                       std::size_t device_budget, std::size_t host_budget, bool prefetch,
                       std::size_t prefetch_depth, bool evict_ahead, bool skip_clean_copies,
                       const std::string& policy,
                       bool pin_host_memory,
                       std::optional<std::uintptr_t> compute_stream, const std::string& torch_device,
                       std::size_t host_reserve, const std::string& state_dtype,
                       const std::string& disk_path, std::size_t disk_budget,
                       const std::vector<ChunkKind>& disk_kinds, int disk_threads,
                       std::size_t disk_request_bytes, bool disk_allow_buffered,
                       const std::string& disk_backend, bool disk_skip_clean_writes) {
             hooks::EngineChunksOptions o;
             o.chunk_bytes = chunk_bytes;
             o.param_dtype = param_dtype;
             o.state_dtype = state_dtype;
             o.device_budget = device_budget;
             o.host_budget = host_budget;
             o.prefetch = prefetch;
             o.prefetch_depth = prefetch_depth;
             o.evict_ahead = evict_ahead;
             o.skip_clean_copies = skip_clean_copies;
             o.policy = policy;
             o.pin_host_memory = pin_host_memory;
             o.compute_stream = compute_stream;
             o.torch_device = torch_device;
             o.host_reserve = host_reserve;
             o.disk_path = disk_path;
             o.disk_budget = disk_budget;
             o.disk_kinds = disk_kinds;
             o.disk_threads = disk_threads;
             o.disk_request_bytes = disk_request_bytes;
             o.disk_allow_buffered = disk_allow_buffered;
             o.disk_backend = disk_backend;
             o.disk_skip_clean_writes = disk_skip_clean_writes;
             return std::make_unique<Chunks>(std::move(device), o);
           }),
           py::arg("device"), py::kw_only(), py::arg("chunk_bytes"), py::arg("param_dtype"),
           py::arg("device_budget"), py::arg("host_budget") = 0, py::arg("prefetch") = true,
           py::arg("prefetch_depth") = 4, py::arg("evict_ahead") = true,
           py::arg("skip_clean_copies") = true, py::arg("policy") = "opt",
           py::arg("pin_host_memory") = true, py::arg("compute_stream") = py::none(),
           py::arg("torch_device") = "cpu", py::arg("host_reserve") = 0,
           py::arg("state_dtype") = "float32", py::arg("disk_path") = "", py::arg("disk_budget") = 0,
           py::arg("disk_kinds") = std::vector<ChunkKind>{ChunkKind::kParam32, ChunkKind::kMomentum,
                                                          ChunkKind::kVariance},
           py::arg("disk_threads") = 8, py::arg("disk_request_bytes") = std::size_t{1} << 20,
           py::arg("disk_allow_buffered") = false, py::arg("disk_backend") = "threads",
           py::arg("disk_skip_clean_writes") = true)
      .def("register", [](Chunks& c, std::string name, std::size_t numel, std::uint8_t pool,
                          bool with_previous) {
             return c.scheduler().register_tensor(std::move(name), numel, pool, with_previous);
           }, py::arg("name"), py::arg("numel"), py::arg("pool") = 0, py::arg("with_previous") = false,
           "Tensors of different pools never share a chunk (Note [Pools keep frozen tensors apart]); "
           "with_previous: the next tensor of the previous one's module (Note [One layout, five lists]).")
      // Note [Chunk calls release the GIL]: access, release, set_state,
      // set_budget and end_step (and ModuleHooks' hooks) may wait for a copy
      // (a fence of a chunk in flight, an eviction's write-back); they run
      // without the GIL, so other Python threads (data loading) go on
      // meanwhile. Arguments are converted and results returned with the GIL
      // held; the calls touch no Python object (a parameter's data is set
      // through its at::Tensor). The engine calls a Chunks object from one thread at a time (forward on the
      // caller's thread; backward hooks on the autograd thread while the
      // caller waits), as before: the GIL was never the scheduler's lock.
      .def("access",
           [](Chunks& c, TensorId id, ChunkKind kind, MemorySpace space,
              const std::vector<std::int64_t>& shape, bool wait, bool write) {
             // A chunk on disk is read into the host (asking for it "where it is").
             if (space == MemorySpace::kDisk) space = MemorySpace::kHost;
             return c.binding().access(id, kind, space, shape, write ? AccessMode::kWrite : AccessMode::kRead,
                                       wait);
           },
           py::call_guard<py::gil_scoped_release>(), py::arg("id"), py::arg("kind"), py::arg("space"), py::arg("shape"),
           py::arg("wait") = true, py::arg("write") = true,
           "Access (COMPUTE) one slot and return a view of it; release() ends the use. wait=False: a "
           "host access may return before a copy into the chunk lands (Note [A pin that does not "
           "wait]); copy_fence() gives what to wait on. write=False: the caller does not change the "
           "slot's bytes (the chunk's write count stays: Note [A clean chunk goes down without a "
           "copy] in chunk_scheduler.cpp).")
      .def("send_ahead",
           [](Chunks& c, std::uint32_t chunk, ChunkKind kind) {
             return c.scheduler().send_ahead(make_chunk_id(kind, chunk));
           },
           py::call_guard<py::gil_scoped_release>(), py::arg("chunk"), py::arg("kind"),
           "Note [Sent ahead of the cursor]: starts the chunk's move to where its next use in the "
           "trace wants it, now, out of the prefetch's order; whether a copy started.")
      .def("take_ahead_wasted",
           [](Chunks& c, ChunkKind kind) {
             std::vector<std::uint32_t> chunks;
             for (const ChunkId id : c.scheduler().take_ahead_wasted()) {
               if (id % kNumChunkKinds == index_of(kind)) chunks.push_back(id / kNumChunkKinds);
             }
             return chunks;
           },
           py::arg("kind"),
           "The chunks of `kind` send_ahead moved that were evicted for room before the use they were "
           "sent for, since the last call (of any kind: the others are dropped).")
      .def("copy_fence",
           [](Chunks& c, std::uint32_t chunk, ChunkKind kind) -> std::optional<CopyFence> {
             const Event* fence = c.scheduler().copy_fence(make_chunk_id(kind, chunk));
             if (fence == nullptr) return std::nullopt;
             return CopyFence{[fence] { fence->synchronize(); }};
           },
           py::arg("chunk"), py::arg("kind"),
           "Note [A pin that does not wait]: a CopyFence, which waits for the copy into the chunk "
           "still running when called (or in an update worker's job), or None; valid while the chunk "
           "is in use (COMPUTE).")
      .def("chunk_view",
           [](Chunks& c, std::uint32_t chunk, ChunkKind kind) {
             // The whole payload of a chunk, flat, wherever it is: for the
             // optimizer, which works on whole chunks while their slots are
             // accessed (COMPUTE), so the payload cannot move meanwhile.
             const ChunkStore& store = c.scheduler().store();
             const Chunk& ch = store.chunk(make_chunk_id(kind, chunk));
             TIDAL_CHECK(ch.has_payload() && ch.space() != MemorySpace::kDisk, "chunk_view: ",
                         store.describe_chunk(make_chunk_id(kind, chunk)),
                         ch.has_payload() ? " is on disk; access it first" : " has no payload");
             const auto numel = static_cast<std::int64_t>(ch.capacity_bytes() / element_size(ch.dtype()));
             return hooks::slot_view(ch.payload(), {numel}, hooks::scalar_type_of(ch.dtype()),
                                     c.binding().torch_device(ch.space()));
           },
           py::arg("chunk"), py::arg("kind"))
      .def("mark_written",
           [](Chunks& c, TensorId id, ChunkKind kind) { c.scheduler().mark_written(TensorRef{kind, id}); },
           py::arg("id"), py::arg("kind"),
           "A write reached this slot's chunk outside an access that declared it (through a view of an "
           "attached parameter): its copy on disk is stale (Note [Chunks on NVMe: clean chunks]).")
      .def("release",
           [](Chunks& c, TensorId id, ChunkKind kind, TensorState state) {
             c.scheduler().release(TensorRef{kind, id}, state);
           },
           py::call_guard<py::gil_scoped_release>(), py::arg("id"), py::arg("kind"), py::arg("state"))
      .def("set_state",
           [](Chunks& c, TensorId id, ChunkKind kind, TensorState state) {
             c.scheduler().set_state(TensorRef{kind, id}, state);
           },
           py::call_guard<py::gil_scoped_release>(), py::arg("id"), py::arg("kind"), py::arg("state"))
      .def("state",
           [](Chunks& c, TensorId id, ChunkKind kind) { return c.scheduler().store().state(TensorRef{kind, id}); },
           py::arg("id"), py::arg("kind"))
      .def("placement",
           [](Chunks& c, TensorId id) {
             const TensorPlacement& p = c.scheduler().store().placement(id);
             return py::make_tuple(p.chunk, p.offset, p.numel);
           },
           py::arg("id"), "(chunk index, offset in elements, numel) of a tensor.")
      .def("step_chunk",
           [](Chunks& c, std::uint32_t chunk, const std::vector<py::tuple>& groups, bool adamw_mode,
              bool bias_correction, double grad_scale, bool use_sums, bool prefer_device, bool host_short,
              bool device_simd, int num_threads, const std::string& pool, std::size_t max_temporary_bytes) {
             std::vector<hooks::ChunkStepGroup> gs;
             gs.reserve(groups.size());
             for (const py::tuple& t : groups) {
               TIDAL_CHECK(t.size() == 7, "step_chunk: a group is (lr, beta1, beta2, eps, weight_decay, "
                           "tensor ids, steps), got ", t.size(), " items");
               hooks::ChunkStepGroup g;
               g.hyper.lr = t[0].cast<double>();
               g.hyper.beta1 = t[1].cast<double>();
               g.hyper.beta2 = t[2].cast<double>();
               g.hyper.eps = t[3].cast<double>();
               g.hyper.weight_decay = t[4].cast<double>();
               g.hyper.adamw_mode = adamw_mode;
               g.hyper.bias_correction = bias_correction;
               g.tensors = t[5].cast<std::vector<TensorId>>();
               g.steps = t[6].cast<std::vector<std::int64_t>>();
               gs.push_back(std::move(g));
             }
             hooks::ChunkStepOptions o;
             o.grad_scale = grad_scale;
             o.use_sums = use_sums;
             o.prefer_device = prefer_device;
             o.host_short = host_short;
             o.device_simd = device_simd;
             o.max_temporary_bytes = max_temporary_bytes;
             o.num_threads = num_threads;
             o.runner = hooks::block_runner(pool);
             py::gil_scoped_release no_gil;
             return hooks::step_chunk(c.scheduler(), c.binding(), chunk, gs, o);
           },
           py::arg("chunk"), py::arg("groups"), py::kw_only(), py::arg("adamw_mode"), py::arg("bias_correction"),
           py::arg("grad_scale"), py::arg("use_sums"), py::arg("prefer_device"), py::arg("host_short"),
           py::arg("device_simd"), py::arg("num_threads") = 0, py::arg("pool") = "onetbb",
           py::arg("max_temporary_bytes") = 0,
           "Note [The step of a chunk in one call] (hooks/chunk_step.h): where the update runs, the pins, "
           "Adam over each group's tensors, the write-back and the releases; returns the space it ran in. "
           "groups: (lr, beta1, beta2, eps, weight_decay, tensor ids, steps) per parameter group.")
      .def("update_on_device",
           [](Chunks& c, std::uint32_t chunk, const std::vector<ChunkKind>& kinds, bool host_short,
              bool prefer_device) {
             return hooks::update_on_device(c.scheduler(), chunk, kinds, host_short, prefer_device);
           },
           py::arg("chunk"), py::arg("kinds"), py::arg("host_short"), py::arg("prefer_device"),
           "Whether the update of a chunk (the step, or a gradient fold) runs on the device "
           "(hooks/chunk_step.h).")
      .def("chunk_space",
           [](Chunks& c, std::uint32_t chunk, ChunkKind kind) {
             return c.scheduler().store().chunk(make_chunk_id(kind, chunk)).space();
           },
           py::arg("chunk"), py::arg("kind"))
      .def("chunk_bytes",
           [](Chunks& c, ChunkKind kind) {
             return c.scheduler().store().chunk_elements() *
                    element_size(c.scheduler().store().list(kind).dtype());
           },
           py::arg("kind"), "Bytes of a regular chunk of a list.")
      .def("chunk_capacity_bytes",
           [](Chunks& c, std::uint32_t chunk, ChunkKind kind) {
             return c.scheduler().store().chunk(make_chunk_id(kind, chunk)).capacity_bytes();
           },
           py::arg("chunk"), py::arg("kind"))
      .def("describe_chunk",
           [](Chunks& c, std::uint32_t chunk, ChunkKind kind) {
             return c.scheduler().store().describe_chunk(make_chunk_id(kind, chunk));
           },
           py::arg("chunk"), py::arg("kind"))
      .def_property_readonly("num_chunks", [](Chunks& c) { return c.scheduler().store().num_chunks(); })
      .def_property_readonly("num_tensors", [](Chunks& c) { return c.scheduler().store().num_tensors(); })
      .def_property_readonly("chunk_elements",
                             [](Chunks& c) { return c.scheduler().store().chunk_elements(); })
      .def_property_readonly("moment", [](Chunks& c) { return c.scheduler().moment(); })
      .def_property_readonly("following_trace", [](Chunks& c) { return c.scheduler().following_trace(); })
      .def("end_step", [](Chunks& c) { c.scheduler().end_step(); }, py::call_guard<py::gil_scoped_release>())
      .def("set_budget",
           [](Chunks& c, MemorySpace space, std::size_t bytes) { c.scheduler().set_budget(space, bytes); },
           py::call_guard<py::gil_scoped_release>(), py::arg("space"), py::arg("bytes"))
      .def("budget", [](Chunks& c, MemorySpace space) { return c.scheduler().budget(space); },
           py::arg("space"))
      .def("held_bytes",
           [](Chunks& c, MemorySpace space) { return c.scheduler().stats().held_bytes[index_of(space)]; },
           py::arg("space"), "Chunk bytes held in a space (resident + cached blocks); for hooks.")
      .def("stats", [](Chunks& c) { return c.scheduler().stats(); }, "The scheduler's counters (a SchedulerStats record).")
      .def("reserve_disk", [](Chunks& c) { c.scheduler().reserve_disk(); },
           py::call_guard<py::gil_scoped_release>(),
           "Gives every chunk of the NVMe tier's lists its home in the file now: a disk too "
           "small fails before training (ChunkScheduler::reserve_disk).")
      .def("close_disk", [](Chunks& c) { c.scheduler().close_disk(); },
           py::call_guard<py::gil_scoped_release>(),
           "Removes the NVMe tier's file now; an error while a chunk is on disk.")
      .def_property_readonly(
          "disk",
          [](Chunks& c) -> std::optional<DiskInfo> {
            const DiskTier* d = c.scheduler().disk();
            if (d == nullptr) return std::nullopt;
            return disk_info(*d);
          },
          "The disk tier: its file, whether it does direct I/O, stale files removed at its "
          "start, its budget and size, bytes read and written, its first failed read or write "
          "(None while none failed); None without a tier.")
      .def("check_disk", [](Chunks& c) { c.scheduler().check_disk(); },
           "RuntimeError with the NVMe tier's first failure once a read or write failed (Note "
           "[Chunks on NVMe: after a failure] in runtime/scheduler/disk_tier.h); nothing otherwise.")
      .def("_fail_disk_io",
           [](Chunks& c, const std::string& direction, std::uint64_t nth, int err) {
             DiskTier* d = c.scheduler().disk();
             TIDAL_CHECK(d != nullptr, "_fail_disk_io: this scheduler has no NVMe tier");
             TIDAL_CHECK(direction == "read" || direction == "write", "_fail_disk_io: direction '",
                         direction, "': expected 'read' or 'write'");
             d->fail_nth(direction == "write", nth, err);
           },
           py::arg("direction"), py::arg("nth"), py::arg("errno") = EIO,
           "For tests: the nth read or write of the NVMe tier from now (1: the next) fails with "
           "errno (EIO by default), as a broken disk would (DirectFile::fail_nth).")
      .def("move_counts",
           [](Chunks& c) {
             const ChunkSchedulerStats s = c.scheduler().stats();
             return py::make_tuple(s.moves_host_to_device, s.moves_device_to_host, s.evictions);
           },
           "(moves host->device, moves device->host, evictions) so far: the memory profile "
           "reads them at every trace point, where stats() would build a dict")
      .def("reset_stats", [](Chunks& c) { c.scheduler().reset_stats(); })
      .def("validate", [](Chunks& c) { c.scheduler().validate(); })
      .def("take_warnings", [](Chunks& c) { return c.scheduler().take_warnings(); });

  bind_tracer(m);
  bind_hooks(m);

  m.def("enter_uncounted", [] { ++g_uncounted_depth; },
        "This thread's allocations are not counted until exit_uncounted() (Note [tidal's own "
        "host allocations] in runtime/core/uncounted.h).");
  m.def("exit_uncounted", [] {
    TIDAL_INTERNAL_ASSERT(g_uncounted_depth > 0, "exit_uncounted without enter_uncounted");
    --g_uncounted_depth;
  });
  m.def("set_host_allocation_counting", &hooks::set_host_allocation_counting, py::arg("enabled"),
        "Counts torch's CPU allocations (Note [Counting CPU allocations]).");
  m.def("host_allocation_counting", &hooks::host_allocation_counting);
  m.def("host_allocation_counts", &hooks::host_allocation_counts);
  m.def("reset_host_allocation_peak", &hooks::reset_host_allocation_peak);
  m.def("host_allocation_model_use", &hooks::host_allocation_model_use,
        "The simulated device's caching allocator model (Note [Who owns a device byte]).");
  m.def("enter_packed_recompute", &hooks::PackedRecomputeScope::enter,
        "tidal.recompute's replay on this thread packs parameter views through the engine's pair "
        "(Note [A recompute inside backward] in hooks/module_hooks.cpp).");
  m.def("exit_packed_recompute", &hooks::PackedRecomputeScope::exit);
  m.def("cuda_room_counts", &hooks::cuda_room_counts,
        "What the room maker on torch's cache misses did (Note [Room on a cache miss] in hooks/cuda_room.h).");
  m.def("reset_cuda_room_counts", &hooks::reset_cuda_room_counts);
  m.def("roll_cuda_request_window", &hooks::roll_cuda_request_window,
        "A step ended: the room made on a miss is sized by this step's and the last step's requests.");
  // Tensor.untyped_storage() makes a Python storage object, which PyTorch
  // then keeps alive with the StorageImpl: one more owner per storage ever
  // looked at, which breaks DTR's "no user reference" test (use_count() == 1).
  m.def(
      "storage_data_ptr",
      [](const at::Tensor& t) -> std::uintptr_t {
        if (!t.defined() || !t.has_storage()) return 0;
        return reinterpret_cast<std::uintptr_t>(t.storage().data_ptr().get());
      },
      py::arg("tensor"),
      "The address of a tensor's storage (0 without storage or data), without making a Python storage "
      "object.");
  m.def(
      "storage_nbytes",
      [](const at::Tensor& t) -> std::size_t {
        return t.defined() && t.has_storage() ? t.storage().nbytes() : 0;
      },
      py::arg("tensor"), "The bytes of a tensor's storage (0 without storage), without a Python storage object.");
}

}  // namespace tidal::python
