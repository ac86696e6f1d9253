// The engine's module, gradient and saved-tensor hooks as C++ objects that
// torch calls directly (Note [Hooks torch calls into C++] in
// hook_callables.cpp). The engine (python/tidal/engine/engine.py) makes them
// through its _C ModuleHooks and registers them where it registered Python
// methods before; each keeps a Python method of the engine for what only
// Python does (DTR's dispatch mode, the out-of-memory retry and message).
#pragma once

#include <torch/csrc/utils/pybind.h>

#include <cstddef>
#include <memory>

#include "hooks/module_hooks.h"
#include "python/csrc/bindings.h"

namespace tidal::python {

// The hooks a callable drives, and the Python object that keeps them and the
// scheduler, binding and tracer they point at alive (the engine's _C
// ModuleHooks).
struct HookTarget {
  py::object owner;
  std::shared_ptr<hooks::ModuleHooks> hooks;
};

// callable(module, args): hooks.forward_pre(module). python_path(module,
// args) runs instead under a dispatch mode; failed(module, error) after an
// out-of-memory error.
py::object forward_pre_hook(HookTarget target, std::size_t module, py::object python_path,
                            py::object failed);
// callable(module, args, output): hooks.forward_post(module) and, with grad
// enabled, a C++ tensor hook on each floating-point output that requires grad
// that runs hooks.backward_pre(module). python_path(module, args, output)
// runs instead under a dispatch mode; wrap_outputs(module, output) marks
// outputs other than tensors and tuples or lists of them; backward_failed
// (module, error) after an out-of-memory error in backward (hold it weakly:
// the autograd graph keeps it).
py::object forward_post_hook(HookTarget target, std::size_t module, py::object python_path,
                             py::object wrap_outputs, py::object backward_failed);
// callable(param), for register_post_accumulate_grad_hook: the gradient lands
// in parameter `param`'s slot and param.grad is cleared. Holds the hooks
// weakly; python_path(param) (holding the engine weakly) runs instead under a
// dispatch mode or for a gradient that is not strided.
py::object grad_hook(HookTarget target, std::size_t param, py::object python_path);
// (pack, unpack) for torch.autograd.graph.saved_tensors_hooks: a saved
// tensor that aliases an attached parameter's slot is packed as (parameter,
// geometry) and rebuilt from the parameter's data; attach(param) first when
// the parameter is not attached.
py::tuple saved_tensor_hooks(HookTarget target, py::object attach);

}  // namespace tidal::python
