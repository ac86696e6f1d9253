// The policies on hand-made contexts: OPT picks the farthest next use, LRU
// the least recent use, and OPT falls back to LRU without a trace.
#include "runtime/scheduler/eviction_policy.h"

#include <gtest/gtest.h>

#include <vector>

#include "runtime/core/error.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

constexpr MemorySpace kDev = MemorySpace::kDevice;
using testing::indexed_name;

class EvictionPolicyTest : public ::testing::Test {
 protected:
  ChunkStore store_{ChunkStoreOptions{.chunk_bytes = 1024}};
  // Chunk ids 0..7 are chunks 0 and 1 of the four lists; use param16 ones.
  std::vector<std::uint64_t> last_use_ = std::vector<std::uint64_t>(16, 0);
  void SetUp() override {
    for (int i = 0; i < 4; ++i) store_.register_tensor(indexed_name("t", i), 512);
  }
  static ChunkId c(ChunkIndex i) { return make_chunk_id(ChunkKind::kParam16, i); }
};

TEST_F(EvictionPolicyTest, OptPicksTheFarthestNextUse) {
  // Step: c0 c1 c2 c3 c1 c0; at moment 3 the next uses are c0:5, c1:4, c2:8 (next step).
  const AccessTrace trace({{c(0), kDev}, {c(1), kDev}, {c(2), kDev}, {c(3), kDev},
                           {c(1), kDev}, {c(0), kDev}});
  last_use_[c(0)] = 1;
  last_use_[c(1)] = 2;
  last_use_[c(2)] = 3;
  const EvictionContext context(store_, &trace, 3, last_use_);
  OptPolicy opt;
  const std::vector<ChunkId> candidates = {c(0), c(1), c(2)};
  EXPECT_EQ(opt.choose_victim(context, kDev, candidates), c(2));
  // LRU would have taken c0, the least recently used.
  LruPolicy lru;
  EXPECT_EQ(lru.choose_victim(context, kDev, candidates), c(0));
  // Among two candidates the farther of them.
  const std::vector<ChunkId> two = {c(1), c(0)};
  EXPECT_EQ(opt.choose_victim(context, kDev, two), c(0));
}

TEST_F(EvictionPolicyTest, OptTakesChunksOutsideTheTraceFirstAndBreaksTiesByRecency) {
  const AccessTrace trace({{c(0), kDev}, {c(1), kDev}});
  last_use_[c(2)] = 9;
  last_use_[c(3)] = 4;
  const EvictionContext context(store_, &trace, 0, last_use_);
  OptPolicy opt;
  const std::vector<ChunkId> candidates = {c(1), c(2), c(3)};
  EXPECT_EQ(opt.choose_victim(context, kDev, candidates), c(3));  // never used; older than c2
}

TEST_F(EvictionPolicyTest, OptWithoutTraceIsLru) {
  last_use_[c(0)] = 7;
  last_use_[c(1)] = 3;
  last_use_[c(2)] = 5;
  const EvictionContext context(store_, nullptr, 10, last_use_);
  EXPECT_FALSE(context.has_trace());
  OptPolicy opt;
  const std::vector<ChunkId> candidates = {c(0), c(1), c(2)};
  EXPECT_EQ(opt.choose_victim(context, kDev, candidates), c(1));
}

TEST(EvictionPolicy, MadeByName) {
  EXPECT_STREQ(make_eviction_policy("opt")->name(), "opt");
  EXPECT_STREQ(make_eviction_policy("lru")->name(), "lru");
  try {
    make_eviction_policy("fifo");
    FAIL() << "unknown policy accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("'fifo'"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace tidal
