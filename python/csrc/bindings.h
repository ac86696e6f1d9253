// Each binding file defines one bind_*() that module.cpp calls. Only files
// that need tensors include torch headers; the rest use plain pybind11.
#pragma once

#include <pybind11/pybind11.h>

namespace tidal::python {

namespace py = pybind11;

void bind_errors(py::module_& m);
// A tidal.OutOfMemoryError carrying `message`, to hand to Python code (the
// GIL held; after bind_errors).
py::object out_of_memory_error(const char* message);
void bind_hook_callables(py::module_& m);
void bind_device(py::module_& m);
void bind_cpu_adam(py::module_& m);
void bind_dtr(py::module_& m);
void bind_chunks(py::module_& m);

}  // namespace tidal::python
