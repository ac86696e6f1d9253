#include "runtime/memory/mimalloc_api.h"

#include <dlfcn.h>

#include <mutex>

#include "runtime/core/error.h"

#ifndef TIDAL_MIMALLOC_SONAME
#define TIDAL_MIMALLOC_SONAME "libmimalloc.so.2"
#endif

namespace tidal {
namespace {

MimallocApi load() {
  // RTLD_LOCAL: mimalloc's malloc/new overrides stay out of the global scope.
  // (No RTLD_DEEPBIND: the sanitizer runtimes refuse it, and mimalloc's own
  // code calls its mi_* functions directly.)
  void* handle = ::dlopen(TIDAL_MIMALLOC_SONAME, RTLD_NOW | RTLD_LOCAL);
  TIDAL_CHECK_RUNTIME(handle != nullptr, "could not load mimalloc (", TIDAL_MIMALLOC_SONAME,
                      "): ", ::dlerror(), ". Install Debian's libmimalloc2.0 or put the library on "
                      "LD_LIBRARY_PATH.");
  MimallocApi api;
  api.malloc_aligned =
      reinterpret_cast<void* (*)(std::size_t, std::size_t)>(::dlsym(handle, "mi_malloc_aligned"));
  api.free = reinterpret_cast<void (*)(void*)>(::dlsym(handle, "mi_free"));
  TIDAL_CHECK_RUNTIME(api.malloc_aligned != nullptr && api.free != nullptr, TIDAL_MIMALLOC_SONAME,
                      " lacks mi_malloc_aligned or mi_free");
  return api;  // the handle stays open for the life of the process
}

}  // namespace

const MimallocApi& mimalloc() {
  static const MimallocApi api = load();
  return api;
}

}  // namespace tidal
