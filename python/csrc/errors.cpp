// Maps tidal's C++ error types to Python exceptions. See Note [Two tiers of checks].
#include <exception>

#include "python/csrc/bindings.h"
#include "runtime/core/error.h"

namespace tidal::python {
namespace {
py::handle oom_type;
py::handle internal_type;
}  // namespace

py::object out_of_memory_error(const char* message) { return oom_type(message); }

bool set_python_error(std::exception_ptr p) {
  if (!p) return false;
  try {
    std::rethrow_exception(p);
  } catch (const OutOfMemoryError& e) {
    PyErr_SetString(oom_type.ptr(), e.what());
  } catch (const InternalError& e) {
    PyErr_SetString(internal_type.ptr(), e.what());
  } catch (const ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what());
  } catch (const NotImplementedError& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what());
  } catch (const Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    return false;
  }
  return true;
}

void bind_errors(py::module_& m) {
  // tidal.OutOfMemoryError is a RuntimeError, like torch.OutOfMemoryError,
  // so code catching either keeps working.
  oom_type = py::exception<OutOfMemoryError>(m, "OutOfMemoryError", PyExc_RuntimeError).release();
  internal_type = py::exception<InternalError>(m, "InternalError", PyExc_RuntimeError).release();
  // Not one of ours: rethrown for the next translator.
  py::register_exception_translator([](std::exception_ptr p) {
    if (p && !set_python_error(p)) std::rethrow_exception(p);
  });
}

}  // namespace tidal::python
