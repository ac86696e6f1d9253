#include "hooks/cuda_room.h"

#include <atomic>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>

#include "hooks/torch_cuda_allocator.h"

#if defined(TIDAL_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif
#include "runtime/core/error.h"
#include "runtime/memory/caching_allocator_model.h"

namespace tidal::hooks {
namespace {

thread_local int t_chunk_blocks = 0;  // ChunkBlockScope depth
thread_local bool t_making_room = false;

// What the callback needs while armed; replaced whole, read under the mutex.
struct Armed {
  std::uint64_t token = 0;
  int ordinal = -1;
  std::size_t cap = 0;
  RoomMaker maker;
};

struct State {
  std::mutex mutex;  // guards armed, counts' strings and the token counter
  // Held while installing, never by the callback or the tracker: installing
  // takes torch's allocator locks, and the callback runs under them.
  std::mutex install_mutex;
  std::shared_ptr<const Armed> armed;
  std::uint64_t next_token = 1;
  std::atomic<int> tracked{-1};
  // The thread whose allocations may make room (set by the engine's hooks as
  // they run: forward on the script's thread, backward on autograd's).
  std::atomic<std::thread::id> room_thread{std::thread::id()};
  // The largest non-chunk request of the previous window and of this one
  // (roll_cuda_request_window at each step's end).
  std::atomic<std::size_t> largest{0};
  std::atomic<std::size_t> largest_before{0};
  std::atomic<std::uint64_t> misses{0}, made_room{0}, bytes_asked{0}, short_of_room{0}, errors{0};
  // CudaAllocatorTotals, written by the tracker under torch's allocator lock.
  std::atomic<std::int64_t> requested{0}, requested_peak{0}, reserved{0}, reserved_peak{0};
  std::string last_error;
  bool installed = false;
};

State& state() {
  // Leaked on purpose: torch may call the callback and the tracker while the
  // process exits.
  static State* s = new State;
  return *s;
}

#if defined(TIDAL_WITH_CUDA)
namespace cca = c10::cuda::CUDACachingAllocator;

constexpr std::size_t kAggregate = static_cast<std::size_t>(c10::CachingAllocator::StatType::AGGREGATE);
// Bounds the rounds of one miss: each round frees at least one chunk or
// activation, and torch's statistics are read again after each.
constexpr int kMaxRounds = 64;

cca::CUDAAllocator* g_allocator = nullptr;  // set once by install(), before the callback can run

bool make_room_on_miss() {
  State& s = state();
  std::shared_ptr<const Armed> armed;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    armed = s.armed;
  }
  if (armed == nullptr || t_chunk_blocks > 0 || t_making_room) return false;
  // Only on the thread running the engine's hooks (the scheduler is not
  // thread-safe), and only for a miss on the engine's device: evicting its
  // chunks makes no room on another GPU.
  if (std::this_thread::get_id() != s.room_thread.load(std::memory_order_relaxed)) return false;
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess || device != armed->ordinal) {
    (void)cudaGetLastError();
    return false;
  }
  s.misses.fetch_add(1, std::memory_order_relaxed);
  t_making_room = true;
  bool freed = false;
  try {
    for (int round = 0; round < kMaxRounds; ++round) {
      const auto stats = g_allocator->getDeviceStats(static_cast<c10::DeviceIndex>(armed->ordinal));
      AllocatorUse use;
      use.reserved = static_cast<std::size_t>(stats.reserved_bytes[kAggregate].current);
      use.allocated = static_cast<std::size_t>(stats.allocated_bytes[kAggregate].current);
      use.active = static_cast<std::size_t>(stats.active_bytes[kAggregate].current);
      use.inactive_split = static_cast<std::size_t>(stats.inactive_split_bytes[kAggregate].current);
      const std::size_t largest = std::max(s.largest.load(std::memory_order_relaxed),
                                           s.largest_before.load(std::memory_order_relaxed));
      const std::size_t need = room_to_make(use, armed->cap, largest);
      if (need == 0) break;
      if (!armed->maker(need)) {
        s.short_of_room.fetch_add(1, std::memory_order_relaxed);
        break;
      }
      if (!freed) s.made_room.fetch_add(1, std::memory_order_relaxed);
      s.bytes_asked.fetch_add(need, std::memory_order_relaxed);
      freed = true;
    }
  } catch (const std::exception& e) {
    s.errors.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.last_error = e.what();
  } catch (...) {
    s.errors.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(s.mutex);
    s.last_error = "unknown exception";
  }
  t_making_room = false;
  return freed;
}

// torch creates one of these per miss and calls Execute().
class RoomCallback final : public c10::FreeMemoryCallback {
 public:
  bool Execute() override { return make_room_on_miss(); }
};

void raise_to(std::atomic<std::int64_t>& peak, std::int64_t value) {
  std::int64_t seen = peak.load(std::memory_order_relaxed);
  while (value > seen && !peak.compare_exchange_weak(seen, value, std::memory_order_relaxed)) {
  }
}

void add(std::atomic<std::int64_t>& live, std::atomic<std::int64_t>& peak, std::int64_t delta) {
  const std::int64_t now = live.fetch_add(delta, std::memory_order_relaxed) + delta;
  if (delta > 0) raise_to(peak, now);
}

// The allocator's trace tracker (called under its lock, after each action).
void note_request(const cca::TraceEntry& entry) {
  State& s = state();
  const int ordinal = s.tracked.load(std::memory_order_relaxed);
  if (ordinal < 0 || entry.device_ != ordinal) return;
  const auto size = static_cast<std::int64_t>(entry.size_);
  using Action = cca::TraceEntry::Action;
  switch (entry.action_) {
    case Action::ALLOC: {
      add(s.requested, s.requested_peak, size);
      if (t_chunk_blocks > 0) break;
      std::size_t seen = s.largest.load(std::memory_order_relaxed);
      while (entry.size_ > seen &&
             !s.largest.compare_exchange_weak(seen, entry.size_, std::memory_order_relaxed)) {
      }
      break;
    }
    case Action::FREE_REQUESTED: add(s.requested, s.requested_peak, -size); break;
    case Action::SEGMENT_ALLOC:
    case Action::SEGMENT_MAP: add(s.reserved, s.reserved_peak, size); break;
    case Action::SEGMENT_FREE:
    case Action::SEGMENT_UNMAP: add(s.reserved, s.reserved_peak, -size); break;
    default: break;
  }
}

// The registry accessor returns a std::string-keyed registry, so its mangled
// name carries the cxx11 ABI tag; the untagged name is tried too.
constexpr const char* kRegistrySymbols[] = {"_ZN3c1031FreeCudaMemoryCallbacksRegistryB5cxx11Ev",
                                            "_ZN3c1031FreeCudaMemoryCallbacksRegistryEv"};
constexpr const char* kCallbackKey = "tidal_device_room";

void install() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.install_mutex);
  if (s.installed) return;
  cca::CUDAAllocator* allocator = find_torch_cuda_allocator();
  // The free-memory callbacks and the trace tracker are the native caching
  // allocator's (PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync has neither).
  const std::string backend = allocator->name();
  TIDAL_CHECK_SUPPORTED(backend == "native", "room on a CUDA cache miss needs torch's native caching "
                        "allocator; this process uses '", backend, "' (PYTORCH_CUDA_ALLOC_CONF backend)");
  using Registry = c10::Registry<std::string, std::unique_ptr<c10::FreeMemoryCallback>>;
  using Accessor = Registry* (*)();
  std::string why;
  void* symbol = nullptr;
  for (const char* name : kRegistrySymbols) {
    symbol = find_c10_cuda_symbol(name, &why);
    if (symbol != nullptr) break;
  }
  TIDAL_CHECK_SUPPORTED(symbol != nullptr, "room for activations on a cache miss: ", why);
  Registry* registry = reinterpret_cast<Accessor>(symbol)();
  TIDAL_CHECK_RUNTIME(registry != nullptr, "torch's FreeCudaMemoryCallbacksRegistry is null");
  g_allocator = allocator;
  // The tracker first (it may refuse); then the callback, which can do
  // nothing until an engine arms it. (Registering a key twice ends the
  // process: a second copy of this module in the process finds its key and
  // uses that copy's callback.)
  allocator->attachAllocatorTraceTracker(note_request);
  if (!registry->Has(kCallbackKey)) {
    registry->Register(kCallbackKey, [] { return std::unique_ptr<c10::FreeMemoryCallback>(new RoomCallback); });
  }
  s.installed = true;
}
#endif

}  // namespace

ChunkBlockScope::ChunkBlockScope() { ++t_chunk_blocks; }
ChunkBlockScope::~ChunkBlockScope() { --t_chunk_blocks; }
bool ChunkBlockScope::active() { return t_chunk_blocks > 0; }

void track_cuda_requests(int ordinal) {
#if defined(TIDAL_WITH_CUDA)
  TIDAL_CHECK(ordinal >= 0, "expected a CUDA device ordinal >= 0, got ", ordinal);
  install();
  State& s = state();
  if (s.tracked.load(std::memory_order_relaxed) == ordinal) return;
  // From torch's statistics now on; the tracker keeps them from here.
  const auto stats = g_allocator->getDeviceStats(static_cast<c10::DeviceIndex>(ordinal));
  const auto requested = static_cast<std::int64_t>(stats.requested_bytes[kAggregate].current);
  const auto reserved = static_cast<std::int64_t>(stats.reserved_bytes[kAggregate].current);
  s.requested = requested;
  s.requested_peak = requested;
  s.reserved = reserved;
  s.reserved_peak = reserved;
  s.tracked.store(ordinal, std::memory_order_relaxed);
#else
  (void)ordinal;
  TIDAL_THROW(NotImplementedError, "room on a CUDA cache miss: tidal was built without the CUDA backend");
#endif
}

std::uint64_t arm_cuda_room(int ordinal, std::size_t cap, RoomMaker maker) {
  track_cuda_requests(ordinal);
  TIDAL_CHECK(cap > 0, "room on a CUDA cache miss: expected a cap > 0 bytes");
  TIDAL_CHECK(maker != nullptr, "room on a CUDA cache miss: expected a room maker");
  State& s = state();
  auto armed = std::make_shared<Armed>();
  armed->ordinal = ordinal;
  armed->cap = cap;
  armed->maker = std::move(maker);
  std::lock_guard<std::mutex> lock(s.mutex);
  armed->token = s.next_token++;
  s.armed = std::move(armed);
  return s.armed->token;
}

std::uint64_t armed_cuda_room() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.armed == nullptr ? 0 : s.armed->token;
}

void set_cuda_room_thread() { state().room_thread.store(std::this_thread::get_id(), std::memory_order_relaxed); }

void roll_cuda_request_window() {
  State& s = state();
  s.largest_before.store(s.largest.exchange(0, std::memory_order_relaxed), std::memory_order_relaxed);
}

void disarm_cuda_room(std::uint64_t token) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.armed != nullptr && s.armed->token == token) s.armed.reset();
}

CudaRoomCounts cuda_room_counts() {
  State& s = state();
  CudaRoomCounts c;
  c.misses = s.misses.load(std::memory_order_relaxed);
  c.made_room = s.made_room.load(std::memory_order_relaxed);
  c.bytes_asked = s.bytes_asked.load(std::memory_order_relaxed);
  c.short_of_room = s.short_of_room.load(std::memory_order_relaxed);
  c.errors = s.errors.load(std::memory_order_relaxed);
  c.largest_request = std::max(s.largest.load(std::memory_order_relaxed),
                               s.largest_before.load(std::memory_order_relaxed));
  std::lock_guard<std::mutex> lock(s.mutex);
  c.last_error = s.last_error;
  return c;
}

CudaAllocatorTotals cuda_allocator_totals() {
  State& s = state();
  return {s.requested.load(std::memory_order_relaxed), s.requested_peak.load(std::memory_order_relaxed),
          s.reserved.load(std::memory_order_relaxed), s.reserved_peak.load(std::memory_order_relaxed)};
}

void reset_cuda_allocator_peaks() {
  State& s = state();
  s.requested_peak = s.requested.load(std::memory_order_relaxed);
  s.reserved_peak = s.reserved.load(std::memory_order_relaxed);
}

void reset_cuda_room_counts() {
  State& s = state();
  s.misses = 0;
  s.made_room = 0;
  s.bytes_asked = 0;
  s.short_of_room = 0;
  s.errors = 0;
  s.largest = 0;
  s.largest_before = 0;
  std::lock_guard<std::mutex> lock(s.mutex);
  s.last_error.clear();
}

}  // namespace tidal::hooks
