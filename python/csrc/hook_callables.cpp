// The engine's hooks as C++ objects torch calls directly.
//
// Note [Hooks torch calls into C++]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// torch keeps a module's forward hooks, a parameter's post-accumulate-grad
// hooks and the saved-tensor hooks in Python and calls whatever callable it
// finds there. Each hook's work is one ModuleHooks call (Note [One call per
// hook] in hooks/module_hooks.h); the Python methods around those calls (a
// frame, dict lookups, the DTR context) cost more than the calls: on a chain
// of 200 nn.Linear(16, 16) the hooks added ~105 us per module to forward and
// backward as Python methods, 67 us as these objects, against 27 us for no-op
// Python hooks of the same kinds (benchmarks/engine_overhead.py; results at
// 08bce73 and 559d966). So the callables are C++ objects (pybind11 classes
// with __call__): torch calls them without a Python frame, and the backward
// pre-hook on a module's outputs is a C++ tensor hook that autograd runs
// without the GIL at all.
//
// What stays in Python, reached through an engine method each callable
// keeps:
//  * under a Python torch dispatch mode (a user's mode, or tidal.dtr's
//    TorchDispatchMode where its dispatch key is not available) the whole
//    hook runs the engine's Python method, which leaves the mode for tidal's
//    own work (dtr.outside()). DTR on its dispatch key (Note [DTR on a
//    dispatch key] in hooks/dtr/interceptor.h, the default) is no Python
//    mode: an engine with DTR in its config makes these objects like any
//    other, and they keep the engine's own ops out of DTR with
//    hooks::dtr::OutsideGuard;
//  * an out-of-memory error goes to the engine's *_failed method (the retry
//    after torch.cuda.empty_cache, the message with the device's side);
//  * outputs other than a tensor or a tuple or list of tensors (a dict, a
//    ModelOutput, a tensor subclass) are marked by the engine's Python
//    wrap_outputs.
// One gradient hook. GradHook below and the engine's Python
// HookWiring.grad_ready are one landing with two entries, not two hooks: both
// call ModuleHooks::land_gradient with DTR's interception kept out (an
// OutsideGuard here, dtr.outside() there), which measures the gradient, writes
// it into the slot and sets DTR's threshold (DeviceRoom::chunks_moved, for
// either interception: both sessions tell the engine's provider while they
// route ops), and both drop .grad. The Python entry is taken only where this
// one cannot work, and adds only what that case needs: a gradient that is not
// strided gets the engine's error naming the parameter; under tidal.dtr's
// TorchDispatchMode an aten alias of the gradient runs inside the mode before
// the landing reads its memory, the one way an evicted gradient comes back
// there (Note [Gradients are optimizer inputs] settles gradients as they are
// made, so it should find none; C++ has no mode to run it in, and on the
// dispatch key it is not needed).
// Lifetimes follow the Python methods they replace. Module hooks and the
// saved-tensor pair hold the engine strongly, as bound methods did, and show
// those references to the garbage collector (tp_traverse), so an engine and
// its model still form a collectable cycle. A gradient hook lives in C++
// autograd meta, out of the collector's sight (Note [Gradient hooks hold the
// engine weakly] in python/tidal/engine/common.py): it holds the hooks by
// weak_ptr and a Python path that holds the engine weakly. A tensor hook on a
// module output holds only weak_ptrs (it may be destroyed on autograd's
// thread without the GIL); its Python object (the failed path) belongs to the
// module's post hook.
#include "python/csrc/hook_callables.h"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "hooks/dtr/interceptor.h"
#include "runtime/core/error.h"

namespace tidal::python {
namespace {

bool in_dispatch_mode() { return c10::impl::TorchDispatchModeTLS::stack_len() > 0; }

py::object wrap(at::Tensor t) { return py::reinterpret_steal<py::object>(THPVariable_Wrap(std::move(t))); }

// The C++ object of a pybind11 instance, or null while it has none (these
// instances are made by py::cast of a finished object, so only in theory).
// The GPU image's torch may bundle a pybind11 without is_holder_constructed.
template <typename T>
T* constructed(PyObject* self) noexcept {
#if PYBIND11_VERSION_MAJOR >= 3
  if (!py::detail::is_holder_constructed(self)) return nullptr;
#endif
  try {
    return &py::cast<T&>(py::handle(self));
  } catch (...) {
    return nullptr;
  }
}

// A pybind11 class whose instances hold Python objects, made visible to the
// garbage collector: T::references() lists them (tp_traverse) and T::clear()
// drops them (tp_clear).
template <typename T>
py::custom_type_setup collectable() {
  return py::custom_type_setup([](PyHeapTypeObject* heap_type) {
    PyTypeObject* type = &heap_type->ht_type;
    type->tp_flags |= Py_TPFLAGS_HAVE_GC;
    type->tp_traverse = [](PyObject* self, visitproc visit, void* arg) -> int {
      Py_VISIT(Py_TYPE(self));
      if (T* t = constructed<T>(self)) {
        for (PyObject* o : t->references()) Py_VISIT(o);
      }
      return 0;
    };
    type->tp_clear = [](PyObject* self) -> int {
      if (T* t = constructed<T>(self)) t->clear();
      return 0;
    };
  });
}

class ForwardPreHook {
 public:
  ForwardPreHook(HookTarget target, std::size_t module, py::object python_path, py::object failed)
      : target_(std::move(target)), module_(module), python_path_(std::move(python_path)),
        failed_(std::move(failed)) {}

  py::object operator()(py::handle module, py::handle args) {
    if (!target_.hooks) return py::none();  // cleared by the collector
    if (in_dispatch_mode()) return python_path_(module, args);
    try {
      py::gil_scoped_release nogil;
      hooks::dtr::OutsideGuard outside;  // the engine's own ops are not DTR's
      target_.hooks->forward_pre(module_);
    } catch (const OutOfMemoryError& e) {
      failed_(module_, out_of_memory_error(e.what()));
    }
    return py::none();
  }

  std::vector<PyObject*> references() const {
    return {target_.owner.ptr(), python_path_.ptr(), failed_.ptr()};
  }
  void clear() {
    target_ = HookTarget{};
    python_path_ = py::object();
    failed_ = py::object();
  }

 private:
  HookTarget target_;
  std::size_t module_;
  py::object python_path_;
  py::object failed_;
};

// A Python callable shared by a module's post hook and the tensor hooks it
// puts on outputs, which hold it weakly: it is only touched with the GIL held.
struct SharedCallable {
  py::object fn;
};

// The C++ tensor hook on a module's output: the module's backward pre-hook.
struct BackwardPre {
  std::weak_ptr<hooks::ModuleHooks> hooks;
  std::weak_ptr<SharedCallable> failed;
  std::size_t module;

  void operator()(const at::Tensor& /*grad*/) const {
    const std::shared_ptr<hooks::ModuleHooks> h = hooks.lock();
    if (!h) return;  // the engine is gone
    try {
      hooks::dtr::OutsideGuard outside;
      h->backward_pre(module);
    } catch (const OutOfMemoryError& e) {
      py::gil_scoped_acquire gil;
      const std::shared_ptr<SharedCallable> f = failed.lock();
      if (!f || !f->fn) throw;
      f->fn(module, out_of_memory_error(e.what()));
    }
  }
};

class ForwardPostHook {
 public:
  ForwardPostHook(HookTarget target, std::size_t module, py::object python_path,
                  py::object wrap_outputs, py::object backward_failed)
      : target_(std::move(target)), module_(module), python_path_(std::move(python_path)),
        wrap_outputs_(std::move(wrap_outputs)),
        backward_failed_(std::make_shared<SharedCallable>(SharedCallable{std::move(backward_failed)})) {}

  py::object operator()(py::handle module, py::handle args, py::handle output) {
    if (!target_.hooks) return py::none();
    if (in_dispatch_mode()) return python_path_(module, args, output);
    const bool grad = c10::GradMode::is_enabled();
    {
      py::gil_scoped_release nogil;
      hooks::dtr::OutsideGuard outside;
      target_.hooks->forward_post(module_, grad);
    }
    if (!grad) return py::none();
    if (THPVariable_CheckExact(output.ptr())) {
      mark(THPVariable_Unpack(output.ptr()));
      return py::none();
    }
    if (PyTuple_Check(output.ptr()) || PyList_Check(output.ptr())) {
      const py::sequence items = py::reinterpret_borrow<py::sequence>(output);
      bool plain = true;
      for (py::handle item : items) {
        plain = plain && (THPVariable_CheckExact(item.ptr()) || item.is_none() ||
                          PyLong_Check(item.ptr()) || PyFloat_Check(item.ptr()));
      }
      if (plain) {
        for (py::handle item : items) {
          if (THPVariable_CheckExact(item.ptr())) mark(THPVariable_Unpack(item.ptr()));
        }
        return py::none();
      }
    }
    return wrap_outputs_(module, output);
  }

  std::vector<PyObject*> references() const {
    return {target_.owner.ptr(), python_path_.ptr(), wrap_outputs_.ptr(), backward_failed_->fn.ptr()};
  }
  void clear() {
    target_ = HookTarget{};
    python_path_ = py::object();
    wrap_outputs_ = py::object();
    backward_failed_->fn = py::object();
  }

 private:
  void mark(const at::Tensor& t) const {
    if (t.requires_grad() && at::isFloatingType(t.scalar_type())) {
      t.register_hook(BackwardPre{target_.hooks, backward_failed_, module_});
    }
  }

  HookTarget target_;
  std::size_t module_;
  py::object python_path_;
  py::object wrap_outputs_;
  std::shared_ptr<SharedCallable> backward_failed_;
};

class GradHook {
 public:
  GradHook(const HookTarget& target, std::size_t param, py::object python_path)
      : hooks_(target.hooks), param_(param), python_path_(std::move(python_path)) {}

  py::object operator()(py::handle param) {
    if (!python_path_) return py::none();
    if (!THPVariable_Check(param.ptr())) return python_path_(param);
    const at::Tensor& p = THPVariable_Unpack(param.ptr());
    at::Tensor grad = p.grad();
    if (!grad.defined()) return py::none();
    if (grad.layout() != at::kStrided || in_dispatch_mode()) return python_path_(param);
    const std::shared_ptr<hooks::ModuleHooks> h = hooks_.lock();
    if (!h) return py::none();  // the engine is gone
    {
      py::gil_scoped_release nogil;
      hooks::dtr::OutsideGuard outside;
      h->land_gradient(param_, grad);
    }
    p.mutable_grad().reset();
    return py::none();
  }

  std::vector<PyObject*> references() const { return {python_path_.ptr()}; }
  void clear() { python_path_ = py::object(); }

 private:
  std::weak_ptr<hooks::ModuleHooks> hooks_;
  std::size_t param_;
  py::object python_path_;
};

// A saved tensor that is (a view of) an attached parameter's slot.
struct PackedParam {
  std::size_t param;
  std::vector<std::int64_t> size;
  std::vector<std::int64_t> stride;
  std::int64_t offset;
};

class PackHook {
 public:
  explicit PackHook(HookTarget target) : target_(std::move(target)) {}

  // Note [Saved tensors are packed detached]: a saved tensor that is not a
  // parameter's alias is packed as a detached alias of its data, never as
  // the tensor itself. A pack hook returning the tensor an op saved of its
  // own output (softmax, log_softmax, tanh, exp save theirs) makes a cycle
  // through C++ (the node holds the packed object, the object's grad_fn is
  // the node) that Python's collector cannot see: a forward whose backward
  // never runs (evaluation with grad on, an error, a dropped engine) then
  // kept its graph, every parameter in it, the unpack hook and with it the
  // engine, for the life of the process.
  py::object operator()(py::handle obj) {
    if (!target_.hooks || !THPVariable_Check(obj.ptr())) return py::reinterpret_borrow<py::object>(obj);
    const at::Tensor& t = THPVariable_Unpack(obj.ptr());
    if (t.layout() != at::kStrided || !t.has_storage()) return wrap(t.detach());
    const std::int64_t i = target_.hooks->attached_at(t.storage().data_ptr().get());
    if (i < 0) {
      hooks::dtr::OutsideGuard outside;  // (an alias, not an op DTR records)
      return wrap(t.detach());
    }
    return py::cast(PackedParam{static_cast<std::size_t>(i), t.sizes().vec(), t.strides().vec(),
                                t.storage_offset()});
  }

  std::vector<PyObject*> references() const { return {target_.owner.ptr()}; }
  void clear() { target_ = HookTarget{}; }

 private:
  HookTarget target_;
};

class UnpackHook {
 public:
  UnpackHook(HookTarget target, py::object attach) : target_(std::move(target)), attach_(std::move(attach)) {}

  py::object operator()(py::handle obj) {
    if (!py::isinstance<PackedParam>(obj)) return py::reinterpret_borrow<py::object>(obj);
    TIDAL_CHECK(target_.hooks != nullptr, "tidal: a saved parameter is unpacked after its engine was collected");
    const auto& packed = obj.cast<const PackedParam&>();
    if (!target_.hooks->attached(packed.param)) attach_(packed.param);
    hooks::dtr::OutsideGuard outside;
    return wrap(target_.hooks->param(packed.param).variable_data().as_strided(packed.size, packed.stride,
                                                                               packed.offset));
  }

  std::vector<PyObject*> references() const { return {target_.owner.ptr(), attach_.ptr()}; }
  void clear() {
    target_ = HookTarget{};
    attach_ = py::object();
  }

 private:
  HookTarget target_;
  py::object attach_;
};

}  // namespace

py::object forward_pre_hook(HookTarget target, std::size_t module, py::object python_path,
                            py::object failed) {
  return py::cast(ForwardPreHook(std::move(target), module, std::move(python_path), std::move(failed)));
}

py::object forward_post_hook(HookTarget target, std::size_t module, py::object python_path,
                             py::object wrap_outputs, py::object backward_failed) {
  return py::cast(ForwardPostHook(std::move(target), module, std::move(python_path),
                                  std::move(wrap_outputs), std::move(backward_failed)));
}

py::object grad_hook(HookTarget target, std::size_t param, py::object python_path) {
  return py::cast(GradHook(target, param, std::move(python_path)));
}

py::tuple saved_tensor_hooks(HookTarget target, py::object attach) {
  return py::make_tuple(PackHook(target), UnpackHook(target, std::move(attach)));
}

void bind_hook_callables(py::module_& m) {
  py::module_ sub = m.def_submodule("hook_callables", "The engine's hooks as C++ callables "
                                                      "(Note [Hooks torch calls into C++]).");
  py::class_<ForwardPreHook>(sub, "ForwardPreHook", collectable<ForwardPreHook>())
      .def("__call__", &ForwardPreHook::operator(), py::arg("module"), py::arg("args"));
  py::class_<ForwardPostHook>(sub, "ForwardPostHook", collectable<ForwardPostHook>())
      .def("__call__", &ForwardPostHook::operator(), py::arg("module"), py::arg("args"), py::arg("output"));
  py::class_<GradHook>(sub, "GradHook", collectable<GradHook>())
      .def("__call__", &GradHook::operator(), py::arg("param"));
  py::class_<PackedParam>(sub, "PackedParam", "A saved tensor that aliases a parameter's slot.")
      .def_readonly("param", &PackedParam::param);
  py::class_<PackHook>(sub, "PackHook", collectable<PackHook>())
      .def("__call__", &PackHook::operator(), py::arg("tensor"));
  py::class_<UnpackHook>(sub, "UnpackHook", collectable<UnpackHook>())
      .def("__call__", &UnpackHook::operator(), py::arg("packed"));
}

}  // namespace tidal::python
