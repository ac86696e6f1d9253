// tidal._C.dtr: the Python face of DTR's C++ side (hooks/dtr/). Thin:
//   * Session: a DTR session whose ops are intercepted in C++ (Note [DTR on
//     a dispatch key] in hooks/dtr/interceptor.h), what tidal.dtr uses;
//   * Runtime: the storage runtime alone, driven op by op by tidal.dtr's
//     Python TorchDispatchMode where the dispatch key is not available (and
//     by the benchmark that compares the two);
//   * ParamProvider: the training engine's parameters for replays, looked
//     up in C++ (ModuleHooks::attached_at) and rebuilt through Python;
//   * Outside: a guard that keeps tidal's own bookkeeping out of DTR.
#include <ATen/ATen.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <atomic>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "hooks/dtr/interceptor.h"
#include "hooks/dtr/storage_runtime.h"
#include "hooks/engine_dtr.h"
#include "hooks/module_hooks.h"
#include "python/csrc/bindings.h"
#include "python/csrc/record.h"
#include "runtime/core/error.h"

namespace tidal::python {
namespace {

namespace d = tidal::dtr;
namespace hd = tidal::hooks::dtr;

d::DtrOptions options_of(std::size_t threshold, std::size_t minimum, bool sqrt_sampling, const std::string& scorer,
                         std::uint64_t seed, double max_recompute_ratio) {
  TIDAL_CHECK(max_recompute_ratio >= 0, "tidal.dtr.max_recompute_ratio: expected a number >= 0 (0: no bound), got ",
              max_recompute_ratio);
  d::DtrOptions o;
  o.max_recompute_ratio = max_recompute_ratio;
  o.eviction_threshold = threshold;
  o.evictee_minimum_size = minimum;
  o.enable_sqrt_sampling = sqrt_sampling;
  o.scorer = d::parse_scorer(scorer);
  o.seed = seed;
  return o;
}

py::list records_list(const std::vector<hd::RecordView>& records) {
  py::list out;
  for (const auto& r : records) {
    out.append(py::make_tuple(r.id, r.bytes, r.state, r.alive, r.locked, r.external, r.pins, r.recipe_length,
                              r.use_count));
  }
  return out;
}

// Raises a Python exception (set by the caller or by `e`) through torch:
// its error handling restores a python_error as it was, on any thread.
[[noreturn]] void throw_python_error() {
  python_error err;
  err.persist();
  throw err;
}

// tidal's C++ errors thrown inside an intercepted op become tidal's Python
// exceptions (torch would turn them into RuntimeErrors).
void rethrow_as_python(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (const tidal::Error&) {
    py::gil_scoped_acquire gil;
    if (set_python_error(p)) throw_python_error();
  } catch (...) {
  }
}

// An allocation failure: torch's C++ one, or torch.OutOfMemoryError raised
// by a Python kernel (its error state is cleared: the op will be retried).
bool is_out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e) != nullptr) return true;
  auto* pe = dynamic_cast<const python_error*>(&e);
  auto* pa = dynamic_cast<const py::error_already_set*>(&e);
  if (pe == nullptr && pa == nullptr) return false;
  py::gil_scoped_acquire gil;
  static py::handle oom = py::object(py::module_::import("torch").attr("OutOfMemoryError")).release();
  if (pa != nullptr) return pa->matches(oom);
  if (pe->type != nullptr) return PyErr_GivenExceptionMatches(pe->type, oom.ptr()) != 0;
  if (PyErr_Occurred() != nullptr && PyErr_ExceptionMatches(oom.ptr()) != 0) {
    PyErr_Clear();
    return true;
  }
  return false;
}

// --------------------------------------------------------------- Python mode

struct PyRecipe final : hd::Recipe {
  explicit PyRecipe(py::object o) : obj(std::move(o)) {}
  ~PyRecipe() override {
    py::gil_scoped_acquire gil;
    obj = py::object();
  }
  py::object obj;
};

// The storage runtime driven by the Python TorchDispatchMode, op by op.
// Like the C++ Session it is an engine's ActivationRoom while its mode is
// entered (activate() to deactivate()), and it prices the engines' chunks
// through their arbiters (hooks/engine_dtr.h).
class Runtime final : public hd::ActivationRoom {
 public:
  explicit Runtime(d::DtrOptions options) : rt_(options) { rt_.set_arbiter(&arbiters_); }
  ~Runtime() override { deactivate(); }

  void add_provider(const std::shared_ptr<hd::ParamProvider>& p) {
    if (p == nullptr || std::find(providers_.begin(), providers_.end(), p) != providers_.end()) return;
    arbiters_.add(p.get(), p->arbiter());
    providers_.push_back(p);
    if (active_) p->session_changed(this);
  }
  void remove_provider(hd::ParamProvider* p) {
    arbiters_.remove(p);
    for (auto it = providers_.begin(); it != providers_.end(); ++it) {
      if (it->get() != p) continue;
      if (active_) p->session_changed(nullptr);
      providers_.erase(it);
      return;
    }
  }
  void activate() {
    active_ = true;
    for (const auto& p : providers_) p->session_changed(this);
  }
  void deactivate() {
    if (!active_) return;
    active_ = false;
    for (const auto& p : providers_) p->session_changed(nullptr);
  }

  // ActivationRoom (this mode runs on the thread that entered it).
  void set_eviction_threshold(std::size_t bytes) override { rt_.set_eviction_threshold(bytes); }
  bool evict_one() override { return rt_.evict_one(); }
  std::size_t tracked_bytes() override { return rt_.tracked_bytes(); }
  double best_eviction_seconds_per_byte() override { return rt_.best_eviction_seconds_per_byte(); }
  void count_chunk_eviction(std::size_t bytes) override { rt_.count_chunk_eviction(bytes); }

  py::tuple begin_op(const std::vector<at::Tensor>& inputs) {
    std::vector<hd::TensorId> ids, missing;
    rt_.begin_op(inputs, &ids, &missing);
    return py::make_tuple(py::cast(ids), py::cast(missing));
  }
  // [(step, recipe)]: replay_inputs(step) and replayed(step, ...) name a step.
  py::list plan(const std::vector<hd::TensorId>& targets, bool bounded) {
    plan_ = rt_.plan(targets, bounded);
    py::list out;
    for (std::size_t i = 0; i < plan_.size(); ++i) {
      const auto* r = dynamic_cast<const PyRecipe*>(plan_[i].recipe);
      TIDAL_INTERNAL_ASSERT(r != nullptr, "op ", plan_[i].op, " has no Python recipe");
      out.append(py::make_tuple(i, r->obj));
    }
    return out;
  }
  std::vector<at::Tensor> replay_inputs(std::size_t step) { return rt_.replay_inputs(plan_.at(step).op); }
  void replayed(std::size_t step, const std::vector<at::Tensor>& outputs, double seconds) {
    rt_.replayed(plan_.at(step), outputs, seconds);
  }
  void end_plan() {
    plan_.clear();
    rt_.end_plan();
  }
  int64_t record(const std::vector<at::Tensor>& inputs, const std::vector<hd::TensorId>& ids,
                 const std::vector<at::Tensor>& outputs, double seconds, bool replayable, py::object recipe,
                 bool last_resort) {
    return rt_.record(inputs, ids, outputs, seconds, replayable, std::make_shared<PyRecipe>(std::move(recipe)),
                      last_resort);
  }
  py::tuple prepare_mutation(hd::TensorId target, bool replayable) {
    auto plan = rt_.prepare_mutation(target, replayable);
    return py::make_tuple(plan.chain, py::cast(plan.regenerate));
  }
  void commit_mutation(hd::TensorId target, bool chain, const std::vector<at::Tensor>& inputs,
                       const std::vector<hd::TensorId>& ids, double seconds, py::object recipe) {
    rt_.commit_mutation(target, chain, inputs, ids, seconds,
                        recipe.is_none() ? nullptr : std::make_shared<PyRecipe>(std::move(recipe)));
  }
  hd::StorageRuntime& get() { return rt_; }

 private:
  hd::ArbiterSet arbiters_;  // declared first: rt_ points at it
  hd::StorageRuntime rt_;
  std::vector<std::shared_ptr<hd::ParamProvider>> providers_;
  bool active_ = false;
  std::vector<hd::StorageRuntime::PlanItem> plan_;
};

// ---------------------------------------------------------------- C++ mode

// The training engine's parameters (Note [DTR with chunk-managed
// parameters]): alias() is C++ (called for every tensor of every op),
// the rest calls back into Python (only while replaying).
class PyParamProvider final : public hooks::EngineParamProvider {
 public:
  PyParamProvider(py::handle hooks, py::function view, py::function end_replay_step, py::function name)
      : EngineParamProvider(module_hooks_of(hooks)), view_(std::move(view)), end_(std::move(end_replay_step)),
        name_(std::move(name)) {}
  ~PyParamProvider() override {
    py::gil_scoped_acquire gil;
    view_ = py::function();
    end_ = py::function();
    name_ = py::function();
  }

  at::Tensor view(std::int64_t param, at::IntArrayRef sizes, at::IntArrayRef strides,
                  std::int64_t offset) override {
    py::gil_scoped_acquire gil;
    try {
      return view_(param, sizes.vec(), strides.vec(), offset).cast<at::Tensor>();
    } catch (py::error_already_set& e) {
      e.restore();
      throw_python_error();
    }
  }
  void end_replay_step() override {
    py::gil_scoped_acquire gil;
    try {
      end_();
    } catch (py::error_already_set& e) {
      e.restore();
      throw_python_error();
    }
  }
  std::string param_name(std::int64_t param) const override {
    py::gil_scoped_acquire gil;
    return py::str(name_(param));
  }

 private:
  py::function view_, end_, name_;
};

// Holds a Python callable for the session's after-op hook.
struct AfterOp {
  py::function fn;
  ~AfterOp() {
    py::gil_scoped_acquire gil;
    fn = py::function();
  }
};

class Outside {
 public:
  void enter() { guard_ = std::make_unique<hd::OutsideGuard>(); }
  void exit() { guard_.reset(); }

 private:
  std::unique_ptr<hd::OutsideGuard> guard_;
};

}  // namespace

void bind_dtr(py::module_& parent) {
  py::module_ m = parent.def_submodule("dtr", R"doc(
DTR's C++ side (hooks/dtr/). Users call tidal.dtr (python/tidal/dtr.py).)doc");
  m.def("parse_scorer", [](const std::string& name) { return std::string(d::scorer_name(d::parse_scorer(name))); },
        "Checks a scorer name ('dtr_eq', 'local', 'lru', 'size'); returns it.");
  m.def("records_outputs_now", &hd::records_outputs_now,
        "Whether the fresh outputs of an op run now are DTR's to track (Note [What DTR tracks]).");
  m.def("interception_status", &hd::interception_status,
        "'' when ops can be intercepted in C++ (Note [DTR on a dispatch key]), else why not.");

  // Note [Records, not dicts] in python/csrc/record.h.
  RecordBinding<hd::RuntimeStats>(m, "RuntimeStats", "The storage runtime's counters (tidal.dtr.stats()).")
      .field("evictions", &hd::RuntimeStats::evictions)
      .field("recomputes", &hd::RuntimeStats::recomputes)
      .field("recompute_seconds", &hd::RuntimeStats::recompute_seconds)
      .field("tracked_bytes", &hd::RuntimeStats::tracked_bytes)
      .field("peak_tracked_bytes", &hd::RuntimeStats::peak_tracked_bytes)
      .field("max_op_working_set", &hd::RuntimeStats::max_op_working_set)
      .field("live_tensors", &hd::RuntimeStats::live_tensors)
      .field("live_ops", &hd::RuntimeStats::live_ops)
      .field("fake_deleted", &hd::RuntimeStats::fake_deleted)
      .field("locked_bytes", &hd::RuntimeStats::locked_bytes)
      .field("held_storages", &hd::RuntimeStats::held_storages)
      .field("recipes", &hd::RuntimeStats::recipes)
      .field("chunk_evictions", &hd::RuntimeStats::chunk_evictions)
      .field("chunk_bytes_freed", &hd::RuntimeStats::chunk_bytes_freed)
      .done();
  RecordBinding<hd::Session::OpCounters>(m, "OpCounters", "Where one op's recomputation comes from.")
      .field("evicted", &hd::Session::OpCounters::evicted)
      .field("evicted_bytes", &hd::Session::OpCounters::evicted_bytes)
      .field("replays", &hd::Session::OpCounters::replays)
      .field("replay_seconds", &hd::Session::OpCounters::replay_seconds)
      .done();
  RecordBinding<hd::Session::PlanCounters>(m, "PlanCounters", "The regenerations (plans) and their length in ops.")
      .field("plans", &hd::Session::PlanCounters::plans)
      .field("ops", &hd::Session::PlanCounters::ops)
      .field("longest", &hd::Session::PlanCounters::longest)
      .done();

  py::class_<Runtime>(m, "Runtime", "The storage runtime driven op by op by tidal.dtr's Python mode.")
      .def(py::init([](std::size_t threshold, std::size_t minimum, bool sqrt_sampling, const std::string& scorer,
                       std::uint64_t seed, double max_recompute_ratio) {
             return std::make_unique<Runtime>(
                 options_of(threshold, minimum, sqrt_sampling, scorer, seed, max_recompute_ratio));
           }),
           py::arg("eviction_threshold"), py::arg("evictee_minimum_size"), py::arg("enable_sqrt_sampling"),
           py::arg("scorer") = "dtr_eq", py::arg("seed") = 0x5eed, py::arg("max_recompute_ratio") = d::DtrOptions{}.max_recompute_ratio)
      .def("set_eviction_threshold", [](Runtime& r, std::size_t b) { r.get().set_eviction_threshold(b); })
      .def("add_provider", [](Runtime& r, std::shared_ptr<PyParamProvider> p) { r.add_provider(p); })
      .def("remove_provider", [](Runtime& r, PyParamProvider* p) { r.remove_provider(p); })
      .def("activate", &Runtime::activate, "Its mode is entered: engines may ask it for room.")
      .def("deactivate", &Runtime::deactivate)
      .def("begin_op", &Runtime::begin_op)
      .def("plan", &Runtime::plan, py::arg("targets"), py::arg("bounded") = true)
      .def("replay_inputs", &Runtime::replay_inputs)
      .def("replayed", &Runtime::replayed)
      .def("end_plan", &Runtime::end_plan)
      .def("record", &Runtime::record)
      .def("prepare_mutation", &Runtime::prepare_mutation)
      .def("commit_mutation", &Runtime::commit_mutation)
      .def("run_mutation", [](Runtime& r, const std::vector<hd::TensorId>& targets) { r.get().run_mutation(targets); })
      .def("end_op", [](Runtime& r, const std::string& name) { r.get().end_op(name); })
      .def("abandon_op", [](Runtime& r) { r.get().abandon_op(); })
      .def("evict_one", [](Runtime& r) { return r.get().evict_one(); })
      .def("set_hold_evictions", [](Runtime& r, bool hold) { r.get().set_hold_evictions(hold); })
      .def("evicted_alive", [](Runtime& r) { return r.get().evicted_alive(); })
      .def("clear", [](Runtime& r) { r.get().clear(); })
      .def("stats", [](Runtime& r) { return r.get().stats(); })
      .def("reset_peak", [](Runtime& r) { r.get().reset_peak(); })
      .def("validate", [](Runtime& r) { r.get().validate(); })
      .def("lookup", [](Runtime& r, const at::Tensor& t) { return r.get().lookup(t); })
      .def("state_of", [](Runtime& r, hd::TensorId id) { return r.get().state_of(id); })
      .def("records", [](Runtime& r) { return records_list(r.get().records()); })
      .def("evict_tensor", [](Runtime& r, const at::Tensor& t) { r.get().evict_tensor(t); })
      .def("evict_all", [](Runtime& r) { return r.get().evict_all(); })
      .def("settle", [](Runtime& r, const at::Tensor& t) { return r.get().settle(t); });

  py::class_<PyParamProvider, std::shared_ptr<PyParamProvider>>(
      m, "ParamProvider", "An engine's chunk-managed parameters for DTR's replays.")
      .def(py::init<py::handle, py::function, py::function, py::function>(), py::arg("hooks"), py::arg("view"),
           py::arg("end_replay_step"), py::arg("name"),
           "hooks: the engine's ModuleHooks; view(index, size, stride, offset) -> tensor; "
           "end_replay_step(); name(index) -> str.")
      .def_property("weights_epoch", &PyParamProvider::weights_epoch, &PyParamProvider::set_weights_epoch)
      .def("alias", &PyParamProvider::alias, py::arg("tensor"));

  py::class_<hd::Session>(m, "Session", "A DTR session whose ops are intercepted in C++.")
      .def(py::init([](std::size_t threshold, std::size_t minimum, bool sqrt_sampling, const std::string& scorer,
                       std::uint64_t seed, double max_recompute_ratio) {
             auto s = std::make_unique<hd::Session>(
                 options_of(threshold, minimum, sqrt_sampling, scorer, seed, max_recompute_ratio));
             s->set_rethrow(&rethrow_as_python);
             s->set_is_oom(&is_out_of_memory);
             return s;
           }),
           py::arg("eviction_threshold"), py::arg("evictee_minimum_size"), py::arg("enable_sqrt_sampling"),
           py::arg("scorer") = "dtr_eq", py::arg("seed") = 0x5eed, py::arg("max_recompute_ratio") = d::DtrOptions{}.max_recompute_ratio)
      .def("activate", &hd::Session::activate, "Routes this thread's ops through the session.")
      .def("deactivate", &hd::Session::deactivate)
      .def_property_readonly("active", &hd::Session::active)
      .def_property_readonly("last_op", &hd::Session::last_op, "The last op intercepted (tests).")
      .def("regenerate_evicted", &hd::Session::regenerate_evicted,
           "Brings back every evicted tensor still reachable.")
      .def("set_eviction_threshold", &hd::Session::set_eviction_threshold)
      .def("add_provider", [](hd::Session& s, std::shared_ptr<PyParamProvider> p) { s.add_provider(std::move(p)); })
      .def("remove_provider", [](hd::Session& s, PyParamProvider* p) { s.remove_provider(p); })
      .def("set_after_op",
           [](hd::Session& s, py::object fn) {
             if (fn.is_none()) {
               s.set_after_op(nullptr);
               return;
             }
             auto holder = std::make_shared<AfterOp>();
             holder->fn = fn.cast<py::function>();
             s.set_after_op([holder]() {
               py::gil_scoped_acquire gil;
               try {
                 holder->fn();
               } catch (py::error_already_set& e) {
                 e.restore();
                 throw_python_error();
               }
             });
           },
           py::arg("fn"), "Calls fn() after every intercepted op (tests); None removes it.")
      .def("op_counters",
           [](hd::Session& s) {
             py::dict out;
             for (const auto& [name, c] : s.op_counters()) out[py::str(name)] = c;
             return py::make_tuple(out, s.plan_counters());
           },
           "({op name: OpCounters}, PlanCounters): "
           "where recomputation comes from.")
      .def("evicted_alive", [](hd::Session& s) { return s.with_runtime([](auto& r) { return r.evicted_alive(); }); })
      .def("clear", [](hd::Session& s) { s.with_runtime([](auto& r) { r.clear(); }); })
      .def("stats", [](hd::Session& s) { return s.with_runtime([](auto& r) { return r.stats(); }); })
      .def("reset_peak", [](hd::Session& s) { s.with_runtime([](auto& r) { r.reset_peak(); }); })
      .def("validate", [](hd::Session& s) { s.with_runtime([](auto& r) { r.validate(); }); })
      .def("lookup", [](hd::Session& s, const at::Tensor& t) { return s.with_runtime([&](auto& r) { return r.lookup(t); }); })
      .def("state_of",
           [](hd::Session& s, hd::TensorId id) { return s.with_runtime([&](auto& r) { return r.state_of(id); }); })
      .def("records",
           [](hd::Session& s) { return records_list(s.with_runtime([](auto& r) { return r.records(); })); })
      .def("evict_tensor",
           [](hd::Session& s, const at::Tensor& t) { s.with_runtime([&](auto& r) { r.evict_tensor(t); }); })
      .def("evict_all", [](hd::Session& s) { return s.with_runtime([](auto& r) { return r.evict_all(); }); },
           "Evicts every candidate now (tests); returns how many.")
      .def("settle",
           [](hd::Session& s, const at::Tensor& t) { return s.with_runtime([&](auto& r) { return r.settle(t); }); },
           py::arg("tensor"), "tensor became an optimizer input (a .grad): no longer tracked or evicted.");

  py::class_<Outside>(m, "Outside", "Keeps the block's ops out of DTR's C++ interception (tidal.dtr.outside()).")
      .def(py::init<>())
      .def("__enter__", [](Outside& o) { o.enter(); })
      .def("__exit__", [](Outside& o, py::args) {
        o.exit();
        return false;
      });
}

}  // namespace tidal::python
