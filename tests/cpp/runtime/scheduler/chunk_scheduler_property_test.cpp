// Property tests over random seeds: random models (tensor sizes, oversize
// ones included), random access sequences and budgets, repeated steps and
// changing sequences. After every operation: validate() holds, the states
// are the ones the test expects, resident and held bytes stay within the
// budgets, and every byte a tensor held is still there after any number of
// moves. Errors happen exactly when the test's own model says nothing can
// make room.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/scheduler/chunk_scheduler.h"
#include "scheduler_test_util.h"
#include "tests/cpp/runtime/temp_dir.h"

namespace tidal {
namespace {

using testing::indexed_name;
using testing::kKiB;

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr TensorState kStates[] = {TensorState::kFree, TensorState::kHold,
                                   TensorState::kHoldAfterFwd, TensorState::kHoldAfterBwd};

// The transitions of Note [Chunk state machine], written out again here.
bool legal(TensorState from, TensorState to) {
  using S = TensorState;
  if (to == S::kFree) return true;
  if (from == S::kCompute) return to != S::kCompute;
  if (to == S::kCompute) return true;
  if (to == S::kHold) return from != S::kFree;
  return false;
}

// What the test knows about every slot, independently of the scheduler.
class Shadow {
 public:
  explicit Shadow(const ChunkStore& store) {
    for (ChunkKind kind : kAllChunkKinds) {
      for (TensorId t = 0; t < store.num_tensors(); ++t) {
        Slot slot;
        slot.bytes.resize(store.tensor_bytes({kind, t}));
        slots_.emplace(key({kind, t}), std::move(slot));
      }
    }
  }

  struct Slot {
    TensorState state = TensorState::kFree;
    std::vector<unsigned char> bytes;  // valid unless FREE
    void* compute_ptr = nullptr;       // the address access() returned
  };
  Slot& at(TensorRef ref) { return slots_.at(key(ref)); }
  std::map<std::uint64_t, Slot>& all() { return slots_; }
  static TensorRef ref_of(std::uint64_t key) {
    return {static_cast<ChunkKind>(key % kNumChunkKinds),
            static_cast<TensorId>(key / kNumChunkKinds)};
  }

 private:
  static std::uint64_t key(TensorRef ref) {
    return std::uint64_t{ref.tensor} * kNumChunkKinds + index_of(ref.kind);
  }
  std::map<std::uint64_t, Slot> slots_;
};

std::vector<std::size_t> random_sizes(std::mt19937& rng, std::size_t chunk_elements, int count,
                                      int oversize_percent) {
  std::vector<std::size_t> sizes;
  for (int i = 0; i < count; ++i) {
    const unsigned r = rng() % 100;
    if (static_cast<int>(r) < oversize_percent) {
      sizes.push_back(chunk_elements + 1 + rng() % (chunk_elements * 3 / 2));
    } else if (r < 20) {
      sizes.push_back(chunk_elements / 2 + rng() % (chunk_elements / 2) + 1);
    } else {
      sizes.push_back(1 + rng() % (chunk_elements / 3));
    }
  }
  return sizes;
}

// `count` tensors of random sizes (`oversize_percent` of them larger than a
// chunk), named p0, p1, ...; every third in a second pool (Note [Pools keep
// frozen tensors apart]): chunks whose tensors are not a contiguous run of ids.
void register_random(ChunkStore& store, std::mt19937& rng, int count, int oversize_percent) {
  const auto sizes = random_sizes(rng, store.chunk_elements(), count, oversize_percent);
  for (int i = 0; i < count; ++i) {
    store.register_tensor(indexed_name("p", i), sizes[i], static_cast<std::uint8_t>(i % 3 == 2));
  }
  store.take_warnings();
}

void fill_random(std::vector<unsigned char>& bytes, std::mt19937& rng) {
  for (auto& b : bytes) b = static_cast<unsigned char>(rng());
}

// Bytes of device-resident chunks pinned by a COMPUTE slot.
std::size_t pinned_device_bytes(const ChunkScheduler& s) {
  std::size_t bytes = 0;
  for (ChunkId id = 0; id < s.store().chunk_id_limit(); ++id) {
    const Chunk& chunk = s.store().chunk(id);
    if (chunk.space() == kDev && !chunk.movable()) bytes += chunk.capacity_bytes();
  }
  return bytes;
}

class Harness {
 public:
  Harness(ChunkScheduler& s, Stream* compute, std::mt19937& rng)
      : s_(s), compute_(compute), rng_(rng), shadow_(s.store()) {}

  // Access with the outcome predicted from the test's own view.
  void access(TensorRef ref, MemorySpace space, bool mutate) {
    Shadow::Slot& slot = shadow_.at(ref);
    ASSERT_NE(slot.state, TensorState::kCompute);
    const ChunkId id = s_.store().chunk_of(ref);
    const Chunk& chunk = s_.store().chunk(id);
    enum { kOk, kPinned, kNoRoom } expected = kOk;
    if (chunk.space() != space) {
      if (chunk.has_payload() && !chunk.movable()) {
        expected = kPinned;
      } else if (space == kDev &&
                 pinned_device_bytes(s_) + chunk.capacity_bytes() > s_.budget(kDev)) {
        expected = kNoRoom;
      }
    }
    const auto before = s_.stats();
    void* ptr = nullptr;
    try {
      ptr = s_.access(ref, space);
    } catch (const OutOfMemoryError& e) {
      EXPECT_EQ(expected, kNoRoom) << "unexpected OutOfMemoryError: " << e.what();
      EXPECT_NE(e.message().find("no room on device"), std::string::npos) << e.message();
      EXPECT_EQ(s_.stats().accesses, before.accesses);
      EXPECT_EQ(s_.store().state(ref), slot.state);
      ++no_room_;
      return;
    } catch (const ValueError& e) {
      EXPECT_EQ(expected, kPinned) << "unexpected ValueError: " << e.what();
      EXPECT_NE(e.message().find("pinned there by COMPUTE"), std::string::npos) << e.message();
      EXPECT_EQ(s_.store().state(ref), slot.state);
      ++pinned_;
      return;
    }
    EXPECT_EQ(expected, kOk) << "access succeeded where the test expected an error";
    EXPECT_EQ(ptr, s_.store().tensor_data(ref));
    EXPECT_EQ(chunk.space(), space);
    if (compute_ != nullptr && space == kDev) compute_->synchronize();  // "kernels" run there
    if (slot.state != TensorState::kFree) {
      // Byte-exact after whatever moves happened since the last write.
      EXPECT_EQ(std::memcmp(ptr, slot.bytes.data(), slot.bytes.size()), 0)
          << to_string(ref.kind) << " tensor " << ref.tensor << " lost its data";
    }
    if (slot.state == TensorState::kFree || mutate) {
      fill_random(slot.bytes, rng_);
      std::memcpy(ptr, slot.bytes.data(), slot.bytes.size());
    }
    slot.state = TensorState::kCompute;
    slot.compute_ptr = ptr;
  }

  void release(TensorRef ref, TensorState to) {
    Shadow::Slot& slot = shadow_.at(ref);
    ASSERT_EQ(slot.state, TensorState::kCompute);
    // Still where access() put it: a COMPUTE chunk never moves.
    EXPECT_EQ(s_.store().tensor_data(ref), slot.compute_ptr);
    EXPECT_EQ(std::memcmp(slot.compute_ptr, slot.bytes.data(), slot.bytes.size()), 0);
    if (to == TensorState::kCompute) {
      EXPECT_THROW(s_.release(ref, to), ValueError);
      return;
    }
    s_.release(ref, to);
    slot.state = to;
    slot.compute_ptr = nullptr;
  }

  void set_state(TensorRef ref, TensorState to) {
    Shadow::Slot& slot = shadow_.at(ref);
    if (slot.state == TensorState::kCompute || to == TensorState::kCompute ||
        !legal(slot.state, to)) {
      EXPECT_THROW(s_.set_state(ref, to), ValueError);
      return;
    }
    s_.set_state(ref, to);
    slot.state = to;
  }

  void set_budget(std::size_t bytes) {
    const bool fits = pinned_device_bytes(s_) <= bytes;
    const std::size_t old = s_.budget(kDev);
    if (fits) {
      s_.set_budget(kDev, bytes);
      EXPECT_EQ(s_.budget(kDev), bytes);
    } else {
      EXPECT_THROW(s_.set_budget(kDev, bytes), OutOfMemoryError);
      EXPECT_EQ(s_.budget(kDev), old);
    }
  }

  // After every operation.
  void check() {
    s_.validate();
    const ChunkSchedulerStats st = s_.stats();
    for (MemorySpace space : {kHost, kDev}) {
      const std::size_t i = index_of(space);
      EXPECT_LE(st.resident_bytes[i], st.budget_bytes[i]);
      EXPECT_LE(st.held_bytes[i], st.budget_bytes[i]);
      EXPECT_LE(st.peak_resident_bytes[i], max_budget_[i]);
    }
    max_budget_[index_of(kDev)] = std::max(max_budget_[index_of(kDev)], s_.budget(kDev));
    max_budget_[index_of(kHost)] = std::max(max_budget_[index_of(kHost)], s_.budget(kHost));
    EXPECT_EQ(st.hits + st.prefetch_hits + st.misses + st.materializations, st.accesses);
    EXPECT_LE(s_.device().memory_stats().in_use_bytes, st.held_bytes[index_of(kDev)]);
    for (auto& [key, slot] : shadow_.all()) {
      const TensorRef ref = Shadow::ref_of(key);
      ASSERT_EQ(s_.store().state(ref), slot.state)
          << to_string(ref.kind) << " tensor " << ref.tensor;
      if (slot.state == TensorState::kCompute) {
        EXPECT_EQ(s_.store().tensor_data(ref), slot.compute_ptr);
      }
    }
  }

  // Releases everything, then reads every slot that holds data on the host.
  void verify_all() {
    for (auto& [key, slot] : shadow_.all()) {
      if (slot.state == TensorState::kCompute) release(Shadow::ref_of(key), TensorState::kHold);
    }
    for (auto& [key, slot] : shadow_.all()) {
      if (slot.state == TensorState::kFree) continue;
      const TensorRef ref = Shadow::ref_of(key);
      const TensorState was = slot.state;
      access(ref, kHost, /*mutate=*/false);
      release(ref, was == TensorState::kHold || was == TensorState::kHoldAfterFwd ||
                           was == TensorState::kHoldAfterBwd
                       ? was
                       : TensorState::kHold);
    }
    check();
  }

  Shadow& shadow() { return shadow_; }
  std::vector<TensorRef> in_use() {
    std::vector<TensorRef> out;
    for (auto& [key, slot] : shadow_.all()) {
      if (slot.state == TensorState::kCompute) out.push_back(Shadow::ref_of(key));
    }
    return out;
  }
  int no_room() const { return no_room_; }
  int pinned() const { return pinned_; }
  void set_initial_budgets() {
    max_budget_[index_of(kDev)] = s_.budget(kDev);
    max_budget_[index_of(kHost)] = s_.budget(kHost);
  }

 private:
  ChunkScheduler& s_;
  Stream* compute_;
  std::mt19937& rng_;
  Shadow shadow_;
  std::array<std::size_t, kNumMemorySpaces> max_budget_{};
  int no_room_ = 0;
  int pinned_ = 0;
};

std::size_t largest_chunk(const ChunkStore& store) {
  std::size_t bytes = 0;
  for (ChunkId id = 0; id < store.chunk_id_limit(); ++id) {
    bytes = std::max(bytes, store.chunk(id).capacity_bytes());
  }
  return bytes;
}

TEST(ChunkSchedulerProperty, RandomOperationsKeepEveryInvariant) {
  int errors_seen = 0;
  for (unsigned seed = 0; seed < 24; ++seed) {
    SCOPED_TRACE(indexed_name("seed ", seed));
    std::mt19937 rng(seed);
    const std::size_t chunk_bytes = (std::size_t{4} << (rng() % 3)) * kKiB;
    const DType dtype = rng() % 2 ? DType::kFloat16 : DType::kBFloat16;
    ChunkStore store({.chunk_bytes = chunk_bytes, .param_dtype = dtype});
    const int count = 4 + static_cast<int>(rng() % 36);
    register_random(store, rng, count, 5);
    const std::size_t biggest = largest_chunk(store);
    const std::size_t budget = biggest * (1 + rng() % 4) + (rng() % 2 ? chunk_bytes : 0);
    const double bandwidth = rng() % 4 == 0 ? 100e6 : 0;
    auto device = testing::make_device(4 * budget + kKiB * kKiB, bandwidth);
    std::unique_ptr<Stream> compute;
    ChunkSchedulerOptions options;
    options.device_budget_bytes = budget;
    options.policy = make_eviction_policy(rng() % 3 ? "opt" : "lru");
    options.use_trace = rng() % 5 != 0;
    options.prefetch = rng() % 3 != 0;
    options.prefetch_depth = 1 + rng() % 4;
    options.drop_free_chunks = rng() % 2;
    if (rng() % 4 == 0) {
      compute = device->create_stream("compute");
      options.compute_stream = compute.get();
    }
    ChunkScheduler s(std::move(store), device, options);
    Harness h(s, compute.get(), rng);
    h.set_initial_budgets();
    const int tensors = count;
    for (int op = 0; op < 400; ++op) {
      const unsigned r = rng() % 100;
      const TensorRef ref{rng() % 2 ? ChunkKind::kParam16 : kAllChunkKinds[rng() % 4],
                          static_cast<TensorId>(rng() % tensors)};
      if (r < 3) {
        s.end_step();
      } else if (r < 6) {
        // Mostly workable budgets, sometimes one below what is pinned.
        h.set_budget(rng() % 4 ? biggest * (1 + rng() % 4) : biggest / 2);
      } else if (r < 14) {
        if (h.shadow().at(ref).state != TensorState::kCompute) {
          h.set_state(ref, rng() % 8 == 0 ? TensorState::kCompute : kStates[rng() % 4]);
        }
      } else {
        // A handful of slots in use at once, as while a module runs.
        const std::vector<TensorRef> in_use = h.in_use();
        if (h.shadow().at(ref).state == TensorState::kCompute) {
          h.release(ref, rng() % 20 == 0 ? TensorState::kCompute : kStates[rng() % 4]);
        } else if (!in_use.empty() && in_use.size() > rng() % 6) {
          h.release(in_use[rng() % in_use.size()], kStates[rng() % 4]);
        } else {
          h.access(ref, rng() % 10 < 7 ? kDev : kHost, /*mutate=*/rng() % 2);
        }
      }
      h.check();
      if (::testing::Test::HasFatalFailure()) return;
    }
    h.verify_all();
    errors_seen += h.no_room() + h.pinned();
  }
  // The error paths were exercised, not only the easy ones.
  EXPECT_GT(errors_seen, 0);
}

// A training-like program: groups of parameters (modules) used forward on
// the device, backward in reverse, then the optimizer on the host over all
// four lists. Each round repeats the program for some steps, then the
// program changes (a dynamic graph). Every group fits the budget, so no
// access may fail.
TEST(ChunkSchedulerProperty, RepeatedAndChangingStepsKeepDataAndBudget) {
  for (unsigned seed = 100; seed < 116; ++seed) {
    SCOPED_TRACE(indexed_name("seed ", seed));
    std::mt19937 rng(seed);
    const std::size_t chunk_bytes = (std::size_t{4} << (rng() % 3)) * kKiB;
    ChunkStore store({.chunk_bytes = chunk_bytes});
    const int count = 6 + static_cast<int>(rng() % 30);
    register_random(store, rng, count, 3);
    std::size_t biggest16 = 0;
    for (const Chunk& chunk : store.list(ChunkKind::kParam16)) {
      biggest16 = std::max(biggest16, chunk.capacity_bytes());
    }
    const std::size_t budget = biggest16 * (2 + rng() % 3);
    // Groups of consecutive tensors whose param16 chunks fit the budget at once.
    std::vector<std::vector<TensorId>> groups;
    {
      std::set<ChunkIndex> chunks;
      std::size_t bytes = 0;
      for (TensorId t = 0; t < static_cast<TensorId>(count); ++t) {
        const ChunkIndex c = store.placement(t).chunk;
        const std::size_t add = chunks.count(c) ? 0 : store.list(ChunkKind::kParam16)[c].capacity_bytes();
        if (groups.empty() || bytes + add > budget || rng() % 3 == 0) {
          groups.emplace_back();
          chunks.clear();
          bytes = 0;
        }
        if (!chunks.count(c)) bytes += store.list(ChunkKind::kParam16)[c].capacity_bytes();
        chunks.insert(c);
        groups.back().push_back(t);
      }
    }
    const double bandwidth = seed % 5 == 0 ? 50e6 : 0;
    auto device = testing::make_device(4 * budget + kKiB * kKiB, bandwidth);
    ChunkSchedulerOptions options;
    options.device_budget_bytes = budget;
    options.prefetch = rng() % 4 != 0;
    options.prefetch_depth = 1 + rng() % 4;
    ChunkScheduler s(std::move(store), device, options);
    Harness h(s, nullptr, rng);
    h.set_initial_budgets();

    std::vector<std::size_t> program(groups.size());
    for (std::size_t i = 0; i < program.size(); ++i) program[i] = i;
    auto run_step = [&] {
      for (std::size_t g : program) {
        for (TensorId t : groups[g]) h.access({ChunkKind::kParam16, t}, kDev, false);
        h.check();
        for (TensorId t : groups[g]) h.release({ChunkKind::kParam16, t}, TensorState::kHoldAfterFwd);
        h.check();
      }
      for (auto g = program.rbegin(); g != program.rend(); ++g) {
        for (TensorId t : groups[*g]) h.access({ChunkKind::kParam16, t}, kDev, /*mutate=*/true);
        h.check();
        for (TensorId t : groups[*g]) h.release({ChunkKind::kParam16, t}, TensorState::kHoldAfterBwd);
        h.check();
      }
      for (std::size_t g : program) {
        for (TensorId t : groups[g]) {
          for (ChunkKind kind : kAllChunkKinds) h.access({kind, t}, kHost, /*mutate=*/true);
          for (ChunkKind kind : kAllChunkKinds) h.release({kind, t}, TensorState::kHold);
          h.check();
        }
      }
    };
    for (int round = 0; round < 3; ++round) {
      for (int step = 0; step < 3; ++step) {
        run_step();
        if (::testing::Test::HasFatalFailure()) return;
        if (step > 0) {
          EXPECT_TRUE(s.following_trace()) << "round " << round << " step " << step
                                           << ": an unchanged step departed from its trace";
        }
        s.end_step();
        h.check();
      }
      // The graph changes: another module order, or one module skipped.
      if (rng() % 2 && program.size() > 1) {
        program.erase(program.begin() + rng() % program.size());
      } else {
        std::shuffle(program.begin(), program.end(), rng);
      }
    }
    EXPECT_EQ(h.no_room(), 0);
    EXPECT_EQ(h.pinned(), 0);
    EXPECT_GE(s.stats().trace_adoptions, 1u);
    h.verify_all();
  }
}

// The training-like program with the disk tier under a host budget of a few
// chunks (Note [Chunks on NVMe: the tier]): every list may go to disk, so the
// optimizer's sweep over all five lists cycles the states through the file.
// No access may fail, and every byte survives any number of trips.
TEST(ChunkSchedulerProperty, TheDiskTierKeepsDataUnderASmallHostBudget) {
  const testing::TempDir folder("tidal_property_disk_");
  const std::string& dir = folder.path();
  for (unsigned seed = 200; seed < 212; ++seed) {
    SCOPED_TRACE(indexed_name("seed ", seed));
    std::mt19937 rng(seed);
    const std::size_t chunk_bytes = (std::size_t{4} << (rng() % 3)) * kKiB;
    ChunkStore store({.chunk_bytes = chunk_bytes});
    const int count = 6 + static_cast<int>(rng() % 30);
    register_random(store, rng, count, 3);
    const std::size_t biggest = largest_chunk(store);
    std::size_t biggest16 = 0;
    for (const Chunk& chunk : store.list(ChunkKind::kParam16)) {
      biggest16 = std::max(biggest16, chunk.capacity_bytes());
    }
    const std::size_t device_budget = biggest16 * 2;
    auto device = testing::make_device(4 * device_budget + kKiB * kKiB, seed % 3 == 0 ? 50e6 : 0);
    ChunkSchedulerOptions options;
    options.device_budget_bytes = device_budget;
    // One tensor's five slots at once, the swap room and a chunk more.
    options.host_budget_bytes = biggest * (7 + rng() % 4);
    options.host_eviction_reserve_bytes = rng() % 2 ? 2 * biggest : 0;
    options.prefetch = rng() % 4 != 0;
    options.prefetch_depth = 1 + rng() % 4;
    options.policy = make_eviction_policy(rng() % 3 ? "opt" : "lru");
    options.disk_path = dir;
    options.disk_threads = 1 + static_cast<int>(rng() % 4);
    options.disk_request_bytes = kDirectAlignment * (1 + rng() % 3);
    options.disk_kinds = ChunkSchedulerOptions::disk_kind_bits(
        {ChunkKind::kParam16, ChunkKind::kParam32, ChunkKind::kMomentum, ChunkKind::kVariance,
         ChunkKind::kGradAccum});
    ChunkScheduler s(std::move(store), device, options);
    Harness h(s, nullptr, rng);
    h.set_initial_budgets();
    std::vector<TensorId> order(static_cast<std::size_t>(count));
    for (int i = 0; i < count; ++i) order[static_cast<std::size_t>(i)] = static_cast<TensorId>(i);
    for (int step = 0; step < 4; ++step) {
      for (TensorId t : order) {
        h.access({ChunkKind::kParam16, t}, kDev, false);
        h.release({ChunkKind::kParam16, t}, TensorState::kHoldAfterFwd);
      }
      h.check();
      for (auto t = order.rbegin(); t != order.rend(); ++t) {
        h.access({ChunkKind::kParam16, *t}, kDev, /*mutate=*/true);
        h.release({ChunkKind::kParam16, *t}, TensorState::kHoldAfterBwd);
      }
      h.check();
      for (TensorId t : order) {
        for (ChunkKind kind : kAllChunkKinds) h.access({kind, t}, kHost, /*mutate=*/true);
        for (ChunkKind kind : kAllChunkKinds) h.release({kind, t}, TensorState::kHold);
        h.check();
        if (::testing::Test::HasFatalFailure()) return;
      }
      s.end_step();
      h.check();
      if (step == 1) std::shuffle(order.begin(), order.end(), rng);  // the graph changes once
    }
    EXPECT_EQ(h.no_room(), 0);
    EXPECT_EQ(h.pinned(), 0);
    const ChunkSchedulerStats st = s.stats();
    EXPECT_GT(st.moves_host_to_disk, 0u);
    EXPECT_GT(st.moves_disk_to_host, 0u);
    h.verify_all();
  }
}

}  // namespace
}  // namespace tidal
