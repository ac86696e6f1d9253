#include "runtime/device/sim_device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/core/units.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#define TIDAL_POISON(p, n) ASAN_POISON_MEMORY_REGION(p, n)
#define TIDAL_UNPOISON(p, n) ASAN_UNPOISON_MEMORY_REGION(p, n)
#else
#define TIDAL_POISON(p, n) ((void)(p), (void)(n))
#define TIDAL_UNPOISON(p, n) ((void)(p), (void)(n))
#endif

namespace tidal {
namespace {

std::uintptr_t page_size() {
  static const std::uintptr_t size = [] {
    const long value = ::sysconf(_SC_PAGESIZE);
    return value > 0 ? static_cast<std::uintptr_t>(value) : std::uintptr_t{4096};
  }();
  return size;
}

// Whether [lo, lo + bytes) is covered by read-write mappings (/proc/self/maps, sorted).
bool range_mapped_read_write(std::uintptr_t lo, std::size_t bytes) {
  std::FILE* maps = std::fopen("/proc/self/maps", "r");
  TIDAL_CHECK_RUNTIME(maps != nullptr, "register_host: cannot read /proc/self/maps");
  std::uintptr_t covered = lo;
  const std::uintptr_t end = lo + bytes;
  char line[512];
  while (covered < end && std::fgets(line, sizeof line, maps) != nullptr) {
    unsigned long from = 0;
    unsigned long to = 0;
    char perms[8] = {};
    if (std::sscanf(line, "%lx-%lx %7s", &from, &to, perms) != 3) continue;
    if (to <= covered) continue;
    if (from > covered || perms[0] != 'r' || perms[1] != 'w') break;
    covered = to;
  }
  std::fclose(maps);
  return covered >= end;
}


using Clock = std::chrono::steady_clock;

// Same alignment cudaMalloc guarantees, so code tested here keeps working there.
constexpr std::size_t kArenaAlignment = 256;

// First-fit allocator over one reserved range of address space. Pages are
// committed by the OS on first touch (MAP_NORESERVE), so a large simulated
// device costs host memory only for what is used. Freed blocks coalesce with
// their neighbours. Under AddressSanitizer every byte not handed out is
// poisoned, so a use after free() of simulated device memory is reported.
class SimArena {
 public:
  explicit SimArena(std::size_t bytes) : size_(bytes) {
    TIDAL_CHECK(bytes > 0, "simulated device: expected a positive capacity, got 0");
    void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    TIDAL_CHECK_WITH(OutOfMemoryError, base != MAP_FAILED,
                     "simulated device: could not reserve ", format_bytes(bytes),
                     " of address space for the arena: ", std::strerror(errno));
    base_ = static_cast<char*>(base);
    free_.emplace(0, bytes);
    TIDAL_POISON(base_, size_);
  }
  ~SimArena() {
    TIDAL_UNPOISON(base_, size_);
    ::munmap(base_, size_);
  }
  SimArena(const SimArena&) = delete;
  SimArena& operator=(const SimArena&) = delete;

  std::size_t size() const { return size_; }
  const char* base() const { return base_; }

  void* allocate(std::size_t bytes) {
    const std::size_t rounded = (bytes + kArenaAlignment - 1) / kArenaAlignment * kArenaAlignment;
    std::lock_guard<std::mutex> lock(mutex_);
    for (auto it = free_.begin(); it != free_.end(); ++it) {
      if (it->second < rounded) continue;
      const std::size_t offset = it->first;
      const std::size_t remaining = it->second - rounded;
      free_.erase(it);
      if (remaining > 0) free_.emplace(offset + rounded, remaining);
      used_.emplace(offset, rounded);
      TIDAL_UNPOISON(base_ + offset, bytes);
      return base_ + offset;
    }
    return nullptr;  // fragmented or full: the Device base reports it
  }

  void free(void* ptr) {
    const std::size_t offset = static_cast<std::size_t>(static_cast<char*>(ptr) - base_);
    std::lock_guard<std::mutex> lock(mutex_);
    auto used = used_.find(offset);
    TIDAL_INTERNAL_ASSERT(used != used_.end(), "arena free of unknown offset ", offset);
    std::size_t start = offset;
    std::size_t size = used->second;
    used_.erase(used);
    TIDAL_POISON(base_ + start, size);
    auto next = free_.lower_bound(start);
    if (next != free_.end() && next->first == start + size) {
      size += next->second;
      next = free_.erase(next);
    }
    if (next != free_.begin()) {
      auto prev = std::prev(next);
      if (prev->first + prev->second == start) {
        start = prev->first;
        size += prev->second;
        free_.erase(prev);
      }
    }
    free_.emplace(start, size);
  }

 private:
  const std::size_t size_;
  char* base_ = nullptr;
  std::mutex mutex_;
  std::map<std::size_t, std::size_t> free_;  // offset -> size, coalesced
  std::map<std::size_t, std::size_t> used_;  // offset -> rounded size
};

// The simulated PCIe link: one engine per direction, shared by all streams.
class CopyEngines {
 public:
  CopyEngines(double bandwidth, double latency) : bandwidth_(bandwidth), latency_(latency) {}

  // Runs memcpy(dst, src, bytes) as a transfer in direction `kind`: booked on
  // that direction's engine behind the transfers already booked there, and
  // finished no earlier than its transfer time after its start. The bytes are
  // moved as late as possible: the copy starts its estimated memcpy time
  // before the deadline (Note [Simulated copies land late]), so the simulated
  // bandwidth is reached even though the memcpy itself takes time.
  void transfer(CopyKind kind, void* dst, const void* src, std::size_t bytes) {
    const bool throttled = kind != CopyKind::kDeviceToDevice && (bandwidth_ > 0 || latency_ > 0);
    if (!throttled) {  // device-internal copies do not cross the link
      std::memcpy(dst, src, bytes);
      return;
    }
    const double seconds = latency_ + (bandwidth_ > 0 ? static_cast<double>(bytes) / bandwidth_ : 0);
    Clock::time_point deadline;
    double memcpy_rate;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto& free_at = kind == CopyKind::kHostToDevice ? h2d_free_at_ : d2h_free_at_;
      const Clock::time_point start = std::max(Clock::now(), free_at);
      deadline = start + to_duration(seconds);
      free_at = deadline;
      memcpy_rate = memcpy_bytes_per_s_;
    }
    std::this_thread::sleep_until(deadline - to_duration(static_cast<double>(bytes) / memcpy_rate));
    const Clock::time_point copy_start = Clock::now();
    std::memcpy(dst, src, bytes);
    const Clock::time_point copy_end = Clock::now();
    {
      std::lock_guard<std::mutex> lock(mutex_);
      const double took = std::chrono::duration<double>(copy_end - copy_start).count();
      if (took > 0 && bytes >= 4096) {
        memcpy_bytes_per_s_ = 0.8 * memcpy_bytes_per_s_ + 0.2 * (static_cast<double>(bytes) / took);
      }
      // A memcpy slower than the link keeps the engine busy until it is done.
      auto& free_at = kind == CopyKind::kHostToDevice ? h2d_free_at_ : d2h_free_at_;
      free_at = std::max(free_at, copy_end);
    }
    std::this_thread::sleep_until(deadline);
  }

 private:
  static Clock::duration to_duration(double seconds) {
    return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
  }

  const double bandwidth_;
  const double latency_;
  std::mutex mutex_;
  Clock::time_point h2d_free_at_{};
  Clock::time_point d2h_free_at_{};
  double memcpy_bytes_per_s_ = 4e9;  // running estimate, refined by every copy
};

// Shared by an event and the stream operations that complete or wait on it,
// so either may outlive the other.
struct EventState {
  std::mutex mutex;
  std::condition_variable cv;
  std::uint64_t recorded = 0;   // number of record() calls
  std::uint64_t completed = 0;  // highest record sequence that has run
  Clock::time_point completed_at{};

  void complete(std::uint64_t seq) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (seq > completed) {
        completed = seq;
        completed_at = Clock::now();
      }
    }
    cv.notify_all();
  }
  void wait_for(std::uint64_t seq) {
    std::unique_lock<std::mutex> lock(mutex);
    cv.wait(lock, [&] { return completed >= seq; });
  }
};

class SimDevice;

class SimStream final : public Stream {
 public:
  SimStream(std::shared_ptr<Device> device, std::string name);
  ~SimStream() override;

  void do_wait(const Event& event) override;
  void synchronize() override {
    std::unique_lock<std::mutex> lock(mutex_);
    const std::uint64_t target = issued_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
  }
  bool query() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_ == issued_;
  }

  void enqueue(std::function<void()> op) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(std::move(op));
      ++issued_;
    }
    work_cv_.notify_one();
  }

 private:
  void run() {
    for (;;) {
      std::function<void()> op;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
        if (queue_.empty()) return;  // stop_ and drained
        op = std::move(queue_.front());
        queue_.pop_front();
      }
      op();
      {
        std::lock_guard<std::mutex> lock(mutex_);
        ++done_;
      }
      done_cv_.notify_all();
    }
  }

  std::mutex mutex_;
  std::condition_variable work_cv_;
  std::condition_variable done_cv_;
  std::deque<std::function<void()>> queue_;
  std::uint64_t issued_ = 0;
  std::uint64_t done_ = 0;
  bool stop_ = false;
  std::thread worker_;  // last: starts after every member it uses exists
};

class SimEvent final : public Event {
 public:
  SimEvent(std::shared_ptr<Device> device, bool timing)
      : Event(std::move(device), timing), state_(std::make_shared<EventState>()) {}

  void do_record(Stream& stream) override {
    auto* sim = dynamic_cast<SimStream*>(&stream);
    TIDAL_INTERNAL_ASSERT(sim != nullptr, "stream of a simulated device is not a SimStream");
    std::uint64_t seq;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      seq = ++state_->recorded;
    }
    sim->enqueue([state = state_, seq] { state->complete(seq); });
  }
  bool query() const override {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->completed >= state_->recorded;
  }
  void synchronize() const override {
    std::uint64_t target;
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      target = state_->recorded;
    }
    state_->wait_for(target);
  }
  double do_elapsed_seconds_since(const Event& start) const override {
    const auto* other = dynamic_cast<const SimEvent*>(&start);
    TIDAL_INTERNAL_ASSERT(other != nullptr, "event of a simulated device is not a SimEvent");
    const auto end_time = completed_time("end");
    const auto start_time = other->completed_time("start");
    return std::chrono::duration<double>(end_time - start_time).count();
  }

  const std::shared_ptr<EventState>& state() const { return state_; }

 private:
  Clock::time_point completed_time(const char* role) const {
    std::lock_guard<std::mutex> lock(state_->mutex);
    TIDAL_CHECK(state_->recorded > 0 && state_->completed >= state_->recorded,
                "elapsed_seconds_since: the ", role, " event has not been recorded and completed");
    return state_->completed_at;
  }

  std::shared_ptr<EventState> state_;
};

class SimDevice final : public Device {
 public:
  explicit SimDevice(const SimDeviceOptions& options)
      : Device(DeviceBackend::kSimulated, options.capacity_bytes, options.capacity_bytes),
        options_(options),
        arena_(options.capacity_bytes),
        engines_(options.copy_bandwidth_bytes_per_s, options.copy_latency_s) {}

  DeviceInfo info() const override {
    DeviceInfo out;
    out.backend = DeviceBackend::kSimulated;
    out.name = "simulated device";
    out.ordinal = 0;
    out.total_memory_bytes = arena_.size();
    out.capacity_bytes = capacity();
    const std::size_t held = memory_stats().in_use_bytes;
    out.free_memory_bytes = out.capacity_bytes > held ? out.capacity_bytes - held : 0;
    out.pinned_host_memory = false;
    out.copy_bandwidth_bytes_per_s = options_.copy_bandwidth_bytes_per_s;
    out.copy_latency_s = options_.copy_latency_s;
    out.pin_bandwidth_bytes_per_s = options_.pin_bandwidth_bytes_per_s;
    return out;
  }

  void synchronize() override {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    for (SimStream* stream : streams_) stream->synchronize();
  }

  // Note [Simulated pinning follows cudaHostRegister]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // The simulated device pins nothing (register_host returns false), but it keeps
  // cudaHostRegister's rules so that a pinning bug fails here as it would on a GPU, not
  // first on the GPU machine: the range must be mapped read-write, must not be device
  // memory, and must not share a page with a live registration (CUDA pins whole pages and
  // answers cudaErrorHostMemoryAlreadyRegistered); unregistering a pointer that is not a
  // registration's start fails (cudaErrorHostMemoryNotRegistered).
  bool register_host(void* ptr, std::size_t bytes) override {
    TIDAL_CHECK(ptr != nullptr && bytes > 0, "register_host: expected a non-empty host range, got ",
                ptr, " + ", bytes, " bytes");
    const auto lo = reinterpret_cast<std::uintptr_t>(ptr);
    const auto arena = reinterpret_cast<std::uintptr_t>(arena_.base());
    TIDAL_CHECK(lo + bytes <= arena || arena + arena_.size() <= lo, "register_host: the range ", ptr,
                " + ", format_bytes(bytes),
                " is device memory of the simulated device (cudaHostRegister would fail with "
                "cudaErrorInvalidValue)");
    TIDAL_CHECK(range_mapped_read_write(lo, bytes), "register_host: the range ", ptr, " + ",
                format_bytes(bytes),
                " is not entirely mapped read-write (cudaHostRegister would fail with "
                "cudaErrorInvalidValue)");
    const std::uintptr_t page = page_size();
    const std::uintptr_t first = lo / page;
    const std::uintptr_t last = (lo + bytes - 1) / page;
    std::lock_guard<std::mutex> lock(registered_mutex_);
    // registered_: start -> bytes, non-overlapping at page granularity.
    auto next = registered_.lower_bound(first * page);
    if (next != registered_.begin()) {
      auto prev = std::prev(next);
      TIDAL_CHECK((prev->first + prev->second - 1) / page < first, "register_host: the range ", ptr,
                  " + ", format_bytes(bytes), " shares a page with the live registration ",
                  reinterpret_cast<void*>(prev->first), " + ", format_bytes(prev->second),
                  " (cudaHostRegister would fail with cudaErrorHostMemoryAlreadyRegistered)");
    }
    TIDAL_CHECK(next == registered_.end() || next->first / page > last, "register_host: the range ",
                ptr, " + ", format_bytes(bytes), " shares a page with the live registration ",
                reinterpret_cast<void*>(next->first), " + ", format_bytes(next->second),
                " (cudaHostRegister would fail with cudaErrorHostMemoryAlreadyRegistered)");
    registered_.emplace(lo, bytes);
    if (options_.pin_bandwidth_bytes_per_s > 0) {
      // What cudaHostRegister costs: time in proportion to the bytes.
      std::this_thread::sleep_for(
          std::chrono::duration<double>(static_cast<double>(bytes) / options_.pin_bandwidth_bytes_per_s));
    }
    return false;
  }
  // Note [Simulated pageable copies wait]
  // ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
  // cudaMemcpyAsync through pageable host memory returns only once the host
  // side is done with (staged through the driver's pinned buffer): the host
  // waits for the copy, and for the stream's work before it. The simulated
  // device charges that wait when it charges pinning (pin bandwidth set: the
  // profile of what a GPU pays for host memory), so choosing not to pin
  // shows its price. Without a pin bandwidth every copy stays asynchronous,
  // which Note [Simulated copies land late] relies on to expose a missing wait.
  bool host_registered(const void* ptr, std::size_t bytes) {
    const auto lo = reinterpret_cast<std::uintptr_t>(ptr);
    std::lock_guard<std::mutex> lock(registered_mutex_);
    auto it = registered_.upper_bound(lo);
    if (it == registered_.begin()) return false;
    --it;
    return lo >= it->first && lo + bytes <= it->first + it->second;
  }
  void unregister_host(void* ptr) override {
    std::lock_guard<std::mutex> lock(registered_mutex_);
    const auto it = registered_.find(reinterpret_cast<std::uintptr_t>(ptr));
    TIDAL_CHECK(it != registered_.end(), "unregister_host: ", ptr,
                " is not the start of a live registration with the simulated device "
                "(cudaHostUnregister would fail with cudaErrorHostMemoryNotRegistered)");
    registered_.erase(it);
  }

  void add_stream(SimStream* stream) {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    streams_.push_back(stream);
  }
  void remove_stream(SimStream* stream) {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    streams_.erase(std::remove(streams_.begin(), streams_.end(), stream), streams_.end());
  }

  CopyEngines& engines() { return engines_; }

 protected:
  void* do_allocate(std::size_t bytes) override { return arena_.allocate(bytes); }
  void do_free(void* ptr) override { arena_.free(ptr); }

  std::unique_ptr<Stream> do_create_stream(std::string name) override {
    return std::make_unique<SimStream>(shared_from_this(), std::move(name));
  }
  std::unique_ptr<Stream> do_wrap_external_stream(std::uintptr_t handle, std::string name) override {
    TIDAL_CHECK_SUPPORTED(false, "the simulated device has no external streams to wrap (stream '",
                          name, "', handle ", handle,
                          "): torch computes on the host there, so pass no compute stream");
  }
  std::unique_ptr<Event> do_create_event(bool enable_timing) override {
    return std::make_unique<SimEvent>(shared_from_this(), enable_timing);
  }
  void do_copy_async(void* dst, const void* src, std::size_t bytes, CopyKind kind,
                     Stream& stream) override {
    auto* sim = dynamic_cast<SimStream*>(&stream);
    TIDAL_INTERNAL_ASSERT(sim != nullptr, "stream of a simulated device is not a SimStream");
    // See Note [Simulated copies land late].
    sim->enqueue([this, dst, src, bytes, kind] { engines_.transfer(kind, dst, src, bytes); });
    // Note [Simulated pageable copies wait]: where pinning is charged, a copy
    // through host memory nobody registered makes the host wait for it.
    if (options_.pin_bandwidth_bytes_per_s > 0 && kind != CopyKind::kDeviceToDevice &&
        !host_registered(kind == CopyKind::kHostToDevice ? src : dst, bytes)) {
      sim->synchronize();
    }
  }

 private:
  const SimDeviceOptions options_;
  std::mutex registered_mutex_;
  std::map<std::uintptr_t, std::size_t> registered_;  // live register_host ranges
  SimArena arena_;
  CopyEngines engines_;
  std::mutex streams_mutex_;
  std::vector<SimStream*> streams_;
};

SimStream::SimStream(std::shared_ptr<Device> device, std::string name)
    : Stream(std::move(device), std::move(name)), worker_([this] { run(); }) {
  static_cast<SimDevice&>(this->device()).add_stream(this);
}

SimStream::~SimStream() {
  // Pending work completes before the stream goes (Note [Device layer contract]).
  static_cast<SimDevice&>(device()).remove_stream(this);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  work_cv_.notify_one();
  worker_.join();
}

void SimStream::do_wait(const Event& event) {
  const auto* sim = dynamic_cast<const SimEvent*>(&event);
  TIDAL_INTERNAL_ASSERT(sim != nullptr, "event of a simulated device is not a SimEvent");
  std::uint64_t target;
  {
    std::lock_guard<std::mutex> lock(sim->state()->mutex);
    target = sim->state()->recorded;
  }
  if (target == 0) return;  // never recorded: complete by definition
  enqueue([state = sim->state(), target] { state->wait_for(target); });
}

double env_double(const char* name, double fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  char* end = nullptr;
  const double parsed = std::strtod(value, &end);
  TIDAL_CHECK(end != value && *end == '\0' && parsed >= 0, name, "=\"", value,
              "\": expected a non-negative number");
  return parsed;
}

}  // namespace

SimDeviceOptions sim_device_options_from_env() {
  SimDeviceOptions options;
  if (const char* v = std::getenv("TIDAL_SIM_CAPACITY"); v != nullptr && *v != '\0') {
    options.capacity_bytes = parse_bytes(v);
  }
  if (const char* v = std::getenv("TIDAL_SIM_BANDWIDTH"); v != nullptr && *v != '\0') {
    options.copy_bandwidth_bytes_per_s = parse_bandwidth(v);
  }
  options.copy_latency_s = env_double("TIDAL_SIM_LATENCY_US", 0) * 1e-6;
  if (const char* v = std::getenv("TIDAL_SIM_PIN_BANDWIDTH"); v != nullptr && *v != '\0') {
    options.pin_bandwidth_bytes_per_s = parse_bandwidth(v);
  }
  return options;
}

std::shared_ptr<Device> make_sim_device(const SimDeviceOptions& options) {
  TIDAL_CHECK(options.copy_bandwidth_bytes_per_s >= 0,
              "simulated device: copy bandwidth must be >= 0 bytes/s (0 = unlimited), got ",
              options.copy_bandwidth_bytes_per_s);
  TIDAL_CHECK(options.copy_latency_s >= 0, "simulated device: copy latency must be >= 0 s, got ",
              options.copy_latency_s);
  TIDAL_CHECK(options.pin_bandwidth_bytes_per_s >= 0,
              "simulated device: pinning bandwidth must be >= 0 bytes/s (0 = free), got ",
              options.pin_bandwidth_bytes_per_s);
  return std::make_shared<SimDevice>(options);
}

}  // namespace tidal
