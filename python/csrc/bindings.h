// Each binding file defines one bind_*() that module.cpp calls. Only files
// that need tensors include torch headers; the rest use plain pybind11.
#pragma once

#include <pybind11/pybind11.h>

#include <exception>
#include <functional>
#include <memory>

namespace tidal::hooks {
class ModuleHooks;
}

namespace tidal::python {

namespace py = pybind11;

// A copy into a chunk still running (Chunks.copy_fence, chunk_bindings.cpp):
// `wait` blocks until it has landed, on any thread, without the GIL; what
// the update worker's jobs wait on (cpu_adam_bindings.cpp). Valid while the
// chunk is in use (COMPUTE).
struct CopyFence {
  std::function<void()> wait;
};

void bind_errors(py::module_& m);
// A tidal.OutOfMemoryError carrying `message`, to hand to Python code (the
// GIL held; after bind_errors).
py::object out_of_memory_error(const char* message);
// Sets the Python exception for one of tidal's C++ errors (the GIL held);
// false (nothing set) for any other exception.
bool set_python_error(std::exception_ptr p);
// The C++ side of a tidal._C.chunks.ModuleHooks object (chunk_bindings.cpp).
std::shared_ptr<hooks::ModuleHooks> module_hooks_of(py::handle hooks_object);
void bind_hook_callables(py::module_& m);
void bind_device(py::module_& m);
void bind_cpu_adam(py::module_& m);
void bind_dtr(py::module_& m);
void bind_chunks(py::module_& m);

}  // namespace tidal::python
