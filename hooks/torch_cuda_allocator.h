// Internal: torch's CUDA caching allocator object, found at run time (Note
// [Chunk memory and torch's caching allocator], "Why the functions are found
// at run time", in hooks/torch_memory_provider.h). Only with the CUDA backend.
#pragma once

#if defined(TIDAL_WITH_CUDA)
// A CPU build of torch ships c10/cuda headers without the generated
// c10/cuda/impl/cuda_cmake_macros.h; on Linux it only defines
// C10_CUDA_BUILD_SHARED_LIBS, which matters on Windows alone.
#define C10_CUDA_NO_CMAKE_CONFIGURE_FILE
#include <c10/cuda/CUDACachingAllocator.h>

namespace tidal::hooks {

// torch's allocator; NotImplementedError when libc10_cuda.so is not loaded (a
// CPU build of torch) or lacks the symbol, RuntimeError when not initialized.
c10::cuda::CUDACachingAllocator::CUDAAllocator* find_torch_cuda_allocator();

// `symbol` (a mangled name) in the loaded libc10_cuda.so, or nullptr with
// `why` set.
void* find_c10_cuda_symbol(const char* symbol, std::string* why);

}  // namespace tidal::hooks
#endif
