#include "python/csrc/bindings.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "tidal's C++ core: device layer, host memory, CPU Adam, chunk runtime";
  m.attr("__version__") = TIDAL_VERSION;
  tidal::python::bind_errors(m);  // first: later bindings may raise them
  tidal::python::bind_device(m);
  tidal::python::bind_cpu_adam(m);
  tidal::python::bind_dtr(m);
  tidal::python::bind_chunks(m);
  tidal::python::bind_hook_callables(m);
}
