// mimalloc, loaded so that it serves tidal's buffers and nothing else.
// See Note [Why mimalloc is loaded with dlopen].
//
// Note [Why mimalloc is loaded with dlopen]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Debian's libmimalloc.so is built to override malloc/free and operator
// new/delete. Linked into tidal._C, the dynamic linker binds the module's
// (and its dependencies') operator new to mimalloc while libtorch_python's
// operator delete stays glibc's, and pybind11 objects shared between the two
// are freed with the wrong allocator ("double free or corruption"). Linked
// into a test program it would replace the allocator under AddressSanitizer.
// So we dlopen the library with RTLD_LOCAL and call only mi_malloc_aligned and
// mi_free through pointers: mimalloc manages HostBuffer memory, and every
// other allocation in the process stays where it was.
#pragma once

#include <cstddef>

namespace tidal {

struct MimallocApi {
  void* (*malloc_aligned)(std::size_t bytes, std::size_t alignment) = nullptr;
  void (*free)(void* ptr) = nullptr;
};

// Loads the library on first use; throws tidal::Error naming the library and
// the loader's message if it is missing.
const MimallocApi& mimalloc();

}  // namespace tidal
