#include "hooks/torch_memory_provider.h"

#include <c10/core/Allocator.h>
#include <c10/core/CPUAllocator.h>
#include <dlfcn.h>

#include <algorithm>
#include <atomic>

#include "hooks/host_allocation_counter.h"
#include "runtime/core/error.h"

#include "hooks/cuda_room.h"
#include "hooks/torch_cuda_allocator.h"

namespace tidal::hooks {

#if defined(TIDAL_WITH_CUDA)
// Mangled name of c10::cuda::CUDACachingAllocator::allocator (std::atomic<CUDAAllocator*>).
constexpr const char* kAllocatorSymbol = "_ZN3c104cuda20CUDACachingAllocator9allocatorE";

void* find_c10_cuda_symbol(const char* symbol, std::string* why) {
  // Only if torch already loaded it: a CUDA build of torch does at import.
  void* lib = dlopen("libc10_cuda.so", RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) {
    const char* e = dlerror();
    *why = detail::str_cat("libc10_cuda.so is not loaded in this process (", e != nullptr ? e : "?",
                           "); is torch a CPU build?");
    return nullptr;
  }
  void* found = dlsym(lib, symbol);
  if (found == nullptr) {
    const char* e = dlerror();
    *why = detail::str_cat("libc10_cuda.so has no ", symbol, " (", e != nullptr ? e : "?",
                           "): this torch's CUDA allocator is not the one tidal was built against");
  }
  dlclose(lib);  // torch keeps it loaded; NOLOAD took one more reference
  return found;
}

c10::cuda::CUDACachingAllocator::CUDAAllocator* find_torch_cuda_allocator() {
  std::string why;
  void* symbol = find_c10_cuda_symbol(kAllocatorSymbol, &why);
  TIDAL_CHECK_SUPPORTED(symbol != nullptr, "chunk memory from torch's CUDA caching allocator: ", why);
  auto* allocator =
      static_cast<std::atomic<c10::cuda::CUDACachingAllocator::CUDAAllocator*>*>(symbol)->load();
  TIDAL_CHECK_RUNTIME(allocator != nullptr && allocator->initialized(),
                      "torch's CUDA caching allocator is not initialized; call "
                      "torch.cuda.init() first");
  return allocator;
}
#endif

TorchMemoryProvider::TorchMemoryProvider(std::unique_ptr<Source> source)
    : source_(std::move(source)) {
  TIDAL_INTERNAL_ASSERT(source_ != nullptr, "TorchMemoryProvider without a source");
  source_->reset_peak();
}

std::string TorchMemoryProvider::name() const { return source_->name(); }

void TorchMemoryProvider::close_interval() {
  // held_ was constant since the last restart of torch's peak, so the peak of
  // everything else in that interval is torch's peak less held_.
  window_peak_ = std::max(window_peak_, source_->peak_allocated_bytes() - held_);
  window_reserved_peak_ = std::max(window_reserved_peak_, source_->peak_reserved_bytes());
}

void* TorchMemoryProvider::allocate(std::size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  close_interval();
  const std::int64_t before = source_->allocated_bytes();
  void* ptr = source_->allocate(bytes);
  if (ptr != nullptr) {
    // What torch counted for it (its rounding included); at least the request.
    const std::int64_t counted =
        std::max(source_->allocated_bytes() - before, static_cast<std::int64_t>(bytes));
    const auto [it, inserted] = counted_.emplace(ptr, counted);
    TIDAL_INTERNAL_ASSERT(inserted, name(), " returned live block ", ptr, " twice");
    (void)it;
    held_ += counted;
    ++allocations_;
  }
  source_->reset_peak();
  return ptr;
}

void TorchMemoryProvider::free(void* ptr) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = counted_.find(ptr);
  TIDAL_INTERNAL_ASSERT(it != counted_.end(), name(), ": free of ", ptr,
                        ", a block it did not hand out");
  close_interval();
  source_->free(ptr);
  held_ -= it->second;
  counted_.erase(it);
  ++frees_;
  source_->reset_peak();
}

std::int64_t TorchMemoryProvider::held_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return held_;
}

std::int64_t TorchMemoryProvider::held_blocks() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return static_cast<std::int64_t>(counted_.size());
}

std::int64_t TorchMemoryProvider::other_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return source_->allocated_bytes() - held_;
}

std::int64_t TorchMemoryProvider::other_peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::max(window_peak_, source_->peak_allocated_bytes() - held_);
}

std::int64_t TorchMemoryProvider::reserved_peak_bytes() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::max(window_reserved_peak_, source_->peak_reserved_bytes());
}

void TorchMemoryProvider::reset_window() {
  std::lock_guard<std::mutex> lock(mutex_);
  source_->reset_peak();
  window_peak_ = source_->allocated_bytes() - held_;
  window_reserved_peak_ = source_->peak_reserved_bytes();
}

std::int64_t TorchMemoryProvider::allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocations_;
}

std::int64_t TorchMemoryProvider::frees() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return frees_;
}

namespace {

// ---- torch's CPU allocator, counted (the simulated device's stand-in) -------

// Same alignment cudaMalloc (and the simulated arena) guarantee.
constexpr std::size_t kAlignment = 256;

class CpuSource final : public TorchMemoryProvider::Source {
 public:
  std::string name() const override { return "torch-cpu-allocator"; }

  void* allocate(std::size_t bytes) override {
    // Counted whatever the counter's switch says, as torch's CUDA allocator
    // counts every block (Note [Counting CPU allocations]).
    const bool was = host_allocation_counting();
    set_host_allocation_counting(true);
    c10::DataPtr data;
    try {
      data = c10::GetCPUAllocator()->allocate(bytes + kAlignment);
    } catch (const c10::Error&) {
      set_host_allocation_counting(was);
      return nullptr;  // out of host memory: the device is out of memory
    }
    set_host_allocation_counting(was);
    const auto raw = reinterpret_cast<std::uintptr_t>(data.get());
    void* aligned = reinterpret_cast<void*>((raw + kAlignment - 1) / kAlignment * kAlignment);
    blocks_.emplace(aligned, std::move(data));
    return aligned;
  }
  void free(void* ptr) override {
    const auto it = blocks_.find(ptr);
    TIDAL_INTERNAL_ASSERT(it != blocks_.end(), "torch CPU provider: free of unknown block ", ptr);
    blocks_.erase(it);  // the DataPtr's deleter gives it back (and uncounts it)
  }
  std::int64_t allocated_bytes() const override { return host_allocation_counts().live_bytes; }
  std::int64_t peak_allocated_bytes() const override {
    return host_allocation_counts().peak_bytes;
  }
  void reset_peak() override { reset_host_allocation_peak(); }

 private:
  std::unordered_map<void*, c10::DataPtr> blocks_;
};

// ---- torch's CUDA caching allocator, found at run time ----------------------

#if defined(TIDAL_WITH_CUDA)
namespace cca = c10::cuda::CUDACachingAllocator;

class CudaSource final : public TorchMemoryProvider::Source {
 public:
  CudaSource(cca::CUDAAllocator* allocator, int ordinal, std::uintptr_t stream)
      : allocator_(allocator),
        ordinal_(static_cast<c10::DeviceIndex>(ordinal)),
        stream_(reinterpret_cast<cudaStream_t>(stream)) {}

  std::string name() const override { return "torch-cuda-caching-allocator"; }

  // The caller (CudaDevice::do_allocate_from) made the device current: torch
  // allocates on the current device.
  void* allocate(std::size_t bytes) override {
    const ChunkBlockScope chunk_block;  // (Note [Room on a cache miss]: no room made for it)
    try {
      return allocator_->raw_alloc_with_stream(bytes, stream_);
    } catch (const c10::OutOfMemoryError&) {
      // torch already freed its cached segments and retried; the chunk
      // scheduler goes on with its own cache and evictions.
      return nullptr;
    }
  }
  void free(void* ptr) override {
    const ChunkBlockScope chunk_block;
    allocator_->raw_delete(ptr);
  }
  // From torch's trace tracker (hooks/cuda_room.h): requested bytes and their
  // peaks, kept by tidal, so torch's own statistics are never reset.
  std::int64_t allocated_bytes() const override { return cuda_allocator_totals().requested; }
  std::int64_t peak_allocated_bytes() const override { return cuda_allocator_totals().requested_peak; }
  std::int64_t peak_reserved_bytes() const override { return cuda_allocator_totals().reserved_peak; }
  void reset_peak() override { reset_cuda_allocator_peaks(); }

 private:
  cca::CUDAAllocator* allocator_;
  c10::DeviceIndex ordinal_;
  cudaStream_t stream_;
};
#endif

}  // namespace

std::shared_ptr<TorchMemoryProvider> make_torch_cuda_memory_provider(int ordinal,
                                                                    std::uintptr_t stream) {
#if defined(TIDAL_WITH_CUDA)
  TIDAL_CHECK(ordinal >= 0, "torch CUDA memory provider: expected a device ordinal >= 0, got ",
              ordinal);
  cca::CUDAAllocator* allocator = find_torch_cuda_allocator();
  track_cuda_requests(ordinal);  // (the tracker that keeps the statistics CudaSource reads)
  return std::make_shared<TorchMemoryProvider>(std::make_unique<CudaSource>(allocator, ordinal, stream));
#else
  (void)ordinal;
  (void)stream;
  TIDAL_THROW(NotImplementedError,
              "chunk memory from torch's CUDA caching allocator: tidal was built without the "
              "CUDA backend");
#endif
}

std::shared_ptr<TorchMemoryProvider> make_torch_cpu_memory_provider() {
  return std::make_shared<TorchMemoryProvider>(std::make_unique<CpuSource>());
}

}  // namespace tidal::hooks
