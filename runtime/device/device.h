// The device layer: the one interface through which tidal touches device
// memory, copies and ordering. Two backends implement it (cuda_device.cpp and
// sim_device.cpp); select.h picks one. See Note [Device layer contract].
//
// Note [Device layer contract]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// * Memory: allocate() hands out device memory up to capacity(); asking for
//   more throws OutOfMemoryError stating the request, the bytes in use and the
//   capacity. Capacity is a budget that may be lowered below the physical
//   memory (set_capacity) but never below what is in use. The base class does
//   the accounting, so both backends report the same numbers.
// * Copies are asynchronous: copy_async() returns at once and the copy runs
//   on the given stream in issue order. Data is only guaranteed to have
//   arrived once an event recorded after the copy has completed (or the
//   stream/device was synchronized). Reading early is a bug that the
//   simulated device makes visible: its copies land at the end of their
//   simulated transfer time.
// * Events follow CUDA semantics: record() captures the work issued so far on
//   a stream; query()/synchronize() observe the most recent record; an event
//   never recorded counts as complete; Stream::wait(event) makes later work
//   on the stream wait for the record captured at the time of the call.
// * Lifetimes: streams, events and buffers hold a shared_ptr to their Device,
//   so a Device lives until the last of them is gone. Destroying a stream
//   blocks until its queued work has finished.
// * Memory providers: allocate() takes its memory from the backend
//   (cudaMalloc, the simulated arena) unless a DeviceMemoryProvider is set;
//   see Note [Device memory providers].
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>

namespace tidal {

enum class DeviceBackend { kCuda, kSimulated };
const char* to_string(DeviceBackend backend);

enum class CopyKind { kHostToDevice, kDeviceToHost, kDeviceToDevice };
const char* to_string(CopyKind kind);

struct DeviceInfo {
  DeviceBackend backend = DeviceBackend::kSimulated;
  std::string name;                     // "NVIDIA H100 80GB HBM3", "simulated device"
  int ordinal = 0;                      // CUDA device ordinal; 0 for the simulated device
  std::size_t total_memory_bytes = 0;   // physical memory (CUDA) or arena size (simulated)
  std::size_t capacity_bytes = 0;       // what allocate() may hand out in total (the budget)
  // Free now: CUDA, what cudaMemGetInfo says (the CUDA context, other
  // processes and every allocation of this one, torch's cache included, are
  // not free); simulated, the capacity less what tidal holds.
  std::size_t free_memory_bytes = 0;
  bool pinned_host_memory = false;      // whether register_host() really pins pages
  double copy_bandwidth_bytes_per_s = 0;  // simulated: configured limit, 0 = unlimited; CUDA: 0
  double copy_latency_s = 0;              // simulated: fixed cost per copy; CUDA: 0
  double pin_bandwidth_bytes_per_s = 0;   // simulated: what pinning costs (0: free); CUDA: 0
};

struct DeviceMemoryStats {
  std::size_t in_use_bytes = 0;
  std::size_t peak_in_use_bytes = 0;
  std::size_t capacity_bytes = 0;
  std::size_t live_allocations = 0;
  std::uint64_t allocations = 0;  // total allocate() calls that succeeded
  std::uint64_t frees = 0;
  std::uint64_t failed_allocations = 0;  // OutOfMemoryError thrown
  // Of in_use_bytes, the bytes of live allocations a DeviceMemoryProvider
  // gave (Note [Device memory providers]).
  std::size_t provided_bytes = 0;
};

// Note [Device memory providers]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A provider replaces the backend's own allocator (cudaMalloc, the simulated
// arena) as the source of the memory Device::allocate() hands out, e.g. torch's
// CUDA caching allocator (hooks/torch_memory_provider.h; why: Note [Chunk memory
// and torch's caching allocator] there). The Device base keeps doing the
// accounting: capacity, in use, peak and owns() are the same with or without a
// provider. Each live allocation remembers the provider it came from and goes
// back to that one, so set_memory_provider() may switch at any time, also while
// memory is allocated. Rules for a provider:
// * allocate(bytes) returns memory of the device (usable by its copies and
//   kernels, aligned as cudaMalloc aligns: 256 bytes) or nullptr when it has
//   none left; Device turns nullptr into OutOfMemoryError, as for its backend.
//   It runs under the device's memory lock: it must not call back into this
//   Device's memory functions.
// * free(ptr) gets back exactly what allocate() returned, once. Device frees
//   only memory no queued work touches any more (the caller's duty, as for the
//   backend: Note [Block fences] in runtime/scheduler/block_pool.h), so a provider
//   may hand the memory out again at once.
// * The backend decides the context the calls run in: CudaDevice makes its
//   device current around them (torch allocates on the current device).
class DeviceMemoryProvider {
 public:
  virtual ~DeviceMemoryProvider() = default;
  // Says where the memory comes from ("torch-cuda-caching-allocator").
  virtual std::string name() const = 0;
  virtual void* allocate(std::size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
};

class Device;
class Event;

// An in-order queue of asynchronous work on one device.
class Stream {
 public:
  virtual ~Stream() = default;
  Stream(const Stream&) = delete;
  Stream& operator=(const Stream&) = delete;

  const std::string& name() const { return name_; }
  Device& device() const { return *device_; }

  // Work issued on this stream after this call waits for the most recent
  // record of `event` (as of this call) to complete. The host does not block.
  // The event must belong to the same device.
  void wait(const Event& event);
  // Blocks the calling thread until all work issued so far has finished.
  virtual void synchronize() = 0;
  // True when all work issued so far has finished.
  virtual bool query() = 0;

 protected:
  Stream(std::shared_ptr<Device> device, std::string name)
      : device_(std::move(device)), name_(std::move(name)) {}

  // Backend hook; `event` is known to belong to this stream's device.
  virtual void do_wait(const Event& event) = 0;

 private:
  std::shared_ptr<Device> device_;
  std::string name_;
};

class Event {
 public:
  virtual ~Event() = default;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  Device& device() const { return *device_; }

  // Captures the work issued on `stream` (of the same device) so far;
  // completes when it has run.
  void record(Stream& stream);
  // True when the most recent record has completed (or there was none).
  virtual bool query() const = 0;
  // Blocks the calling thread until the most recent record has completed.
  virtual void synchronize() const = 0;
  // Seconds between the completion of `start` and of this event. Both must
  // belong to one device, have been created with timing enabled, recorded
  // and completed.
  double elapsed_seconds_since(const Event& start) const;

 protected:
  Event(std::shared_ptr<Device> device, bool timing) : device_(std::move(device)), timing_(timing) {}

  // Backend hooks; arguments are known to belong to this event's device (and,
  // for elapsed time, both events to have timing enabled).
  virtual void do_record(Stream& stream) = 0;
  virtual double do_elapsed_seconds_since(const Event& start) const = 0;

 private:
  std::shared_ptr<Device> device_;
  bool timing_;
};

// Device memory owned by one holder; frees itself on destruction.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(std::shared_ptr<Device> device, void* data, std::size_t bytes)
      : device_(std::move(device)), data_(data), bytes_(bytes) {}
  DeviceBuffer(DeviceBuffer&& other) noexcept { swap(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept {
    DeviceBuffer(std::move(other)).swap(*this);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer();  // never throws; see device.cpp

  void* data() const { return data_; }
  std::size_t size() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  const std::shared_ptr<Device>& device() const { return device_; }
  // Frees the memory now (the buffer becomes empty).
  void reset();

 private:
  void swap(DeviceBuffer& other) noexcept {
    std::swap(device_, other.device_);
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
  }

  std::shared_ptr<Device> device_;
  void* data_ = nullptr;
  std::size_t bytes_ = 0;
};

class Device : public std::enable_shared_from_this<Device> {
 public:
  virtual ~Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceInfo info() const = 0;
  DeviceBackend backend() const { return backend_; }

  // ---- memory -------------------------------------------------------------
  // Throws OutOfMemoryError (requested, in use, capacity) when the request
  // does not fit the capacity or the backend has no memory left.
  DeviceBuffer allocate(std::size_t bytes);
  void* allocate_raw(std::size_t bytes);
  // `ptr` must come from allocate_raw() of this device.
  void free_raw(void* ptr);

  std::size_t capacity() const;
  // Lowers (or raises, up to the physical memory) the budget allocate()
  // enforces. Throws ValueError if `bytes` is below what is in use now.
  void set_capacity(std::size_t bytes);
  DeviceMemoryStats memory_stats() const;
  // Resets the peak to the bytes in use now.
  void reset_peak_memory();
  // True if [ptr, ptr + bytes) lies inside one live allocation of this device.
  bool owns(const void* ptr, std::size_t bytes) const;
  // Where later allocations come from: `provider`, or the backend when null.
  // Live allocations keep going back to where they came from (Note [Device
  // memory providers]).
  void set_memory_provider(std::shared_ptr<DeviceMemoryProvider> provider);
  std::shared_ptr<DeviceMemoryProvider> memory_provider() const;

  // ---- streams, events, copies -------------------------------------------
  std::unique_ptr<Stream> create_stream(std::string name);
  // A non-owning Stream over a stream someone else created, e.g. the CUDA
  // stream torch computes on (`handle` is its cudaStream_t). Destroying the
  // wrapper neither synchronizes nor destroys the stream. The simulated
  // device has no foreign streams (torch computes on the host there) and
  // throws NotImplementedError.
  std::unique_ptr<Stream> wrap_external_stream(std::uintptr_t handle, std::string name);
  std::unique_ptr<Event> create_event(bool enable_timing = false);
  // Enqueues a copy on `stream`. The device side of the copy must lie inside
  // one live allocation of this device; violations throw ValueError.
  void copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind, Stream& stream);
  // A host<->device copy whose device side is memory this device did not
  // allocate: a tensor from torch's own allocator (tidal.recompute's
  // offloaded checkpoints). The checks of copy_async, except that the device
  // side need not lie inside an allocation of this device: on the simulated
  // device torch's "device" tensors are host memory, on CUDA the copy
  // addresses any device pointer of the context. The host side must still not
  // be this device's memory. `kind`: kHostToDevice or kDeviceToHost.
  void copy_async_external(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                           Stream& stream);
  // Blocks until all work on all streams of this device has finished.
  virtual void synchronize() = 0;

  // ---- host memory --------------------------------------------------------
  // Page-locks host memory for fast asynchronous copies. Returns true if the
  // backend pinned it (CUDA), false if pinning does not apply (simulated).
  virtual bool register_host(void* ptr, std::size_t bytes) = 0;
  virtual void unregister_host(void* ptr) = 0;

 protected:
  Device(DeviceBackend backend, std::size_t physical_bytes, std::size_t capacity_bytes);

  // Backend hooks. do_allocate returns nullptr when the backend itself is out
  // of memory; the base turns that into OutOfMemoryError.
  virtual void* do_allocate(std::size_t bytes) = 0;
  virtual void do_free(void* ptr) = 0;
  // The same through a provider (Note [Device memory providers]); a backend
  // overrides them to set up the context the provider needs.
  virtual void* do_allocate_from(DeviceMemoryProvider& provider, std::size_t bytes) {
    return provider.allocate(bytes);
  }
  virtual void do_free_to(DeviceMemoryProvider& provider, void* ptr) { provider.free(ptr); }
  virtual std::unique_ptr<Stream> do_create_stream(std::string name) = 0;
  virtual std::unique_ptr<Stream> do_wrap_external_stream(std::uintptr_t handle, std::string name) = 0;
  virtual std::unique_ptr<Event> do_create_event(bool enable_timing) = 0;
  virtual void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                             Stream& stream) = 0;

  std::size_t physical_bytes() const { return physical_bytes_; }

 private:
  [[noreturn]] void throw_out_of_memory(std::size_t requested, const char* reason);
  void check_device_range(const void* ptr, std::size_t bytes, const char* role, CopyKind kind) const;
  // The checks every copy makes (`who` names the call in the message); false
  // when there is nothing to copy.
  bool check_copy(const char* who, const void* dst, const void* src, std::size_t bytes,
                  const Stream& stream) const;

  const DeviceBackend backend_;
  const std::size_t physical_bytes_;

  mutable std::mutex mutex_;
  std::size_t capacity_;
  struct Allocation {
    std::size_t bytes = 0;
    std::shared_ptr<DeviceMemoryProvider> provider;  // null: the backend's
  };
  std::map<std::uintptr_t, Allocation> live_;  // allocation start -> allocation
  std::shared_ptr<DeviceMemoryProvider> provider_;  // null: the backend allocates
  DeviceMemoryStats stats_;
};

}  // namespace tidal
