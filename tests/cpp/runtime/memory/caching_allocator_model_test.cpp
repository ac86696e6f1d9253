// CachingAllocatorModel against torch's CUDA caching allocator as
// c10/cuda/CUDACachingAllocator.cpp documents it (sizes rounded to 512 bytes;
// requests up to 1 MiB share 2 MiB segments, 1-10 MiB ones 20 MiB segments,
// larger ones get their size rounded to 2 MiB; best fit; a large block is
// split only when more than 1 MiB is left; freed blocks stay cached and merge
// with free neighbours of their segment; on a miss past the cap only whole
// free segments are given back). The figures in each case are worked out
// from those rules by hand. The GPU run checks the model against torch's own
// allocator (benchmarks/allocator_model_gpu.py).
#include "runtime/memory/caching_allocator_model.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <random>
#include <vector>

namespace tidal {
namespace {

constexpr std::size_t kMiB = std::size_t{1} << 20;
constexpr std::size_t kNoCap = ~std::size_t{0};

std::function<std::size_t()> cap_of(std::size_t bytes) {
  return [bytes] { return bytes; };
}

TEST(TorchCacheRules, RoundsAndSegmentsAsTorch) {
  EXPECT_EQ(torch_cache::round_size(1), 512u);
  EXPECT_EQ(torch_cache::round_size(512), 512u);
  EXPECT_EQ(torch_cache::round_size(513), 1024u);
  EXPECT_EQ(torch_cache::segment_size(512), 2 * kMiB);
  EXPECT_EQ(torch_cache::segment_size(kMiB), 2 * kMiB);
  EXPECT_EQ(torch_cache::segment_size(kMiB + 512), 20 * kMiB);
  EXPECT_EQ(torch_cache::segment_size(10 * kMiB - 512), 20 * kMiB);
  EXPECT_EQ(torch_cache::segment_size(10 * kMiB), 10 * kMiB);
  EXPECT_EQ(torch_cache::segment_size(64 * kMiB + 512), 66 * kMiB);
}

TEST(CachingAllocatorModel, SmallRequestsShareTwoMiBSegments) {
  CachingAllocatorModel m;
  const auto a = m.allocate(1000, cap_of(kNoCap), nullptr);
  const auto b = m.allocate(3000, cap_of(kNoCap), nullptr);
  ASSERT_NE(a, 0u);
  ASSERT_NE(b, 0u);
  EXPECT_EQ(m.segments(), 1u);
  EXPECT_EQ(m.use().reserved, 2 * kMiB);
  EXPECT_EQ(m.use().allocated, 1024u + 3072u);
  EXPECT_EQ(m.use().inactive_split, 2 * kMiB - 4096);
  m.free(a);
  m.free(b);
  EXPECT_EQ(m.use().allocated, 0u);
  EXPECT_EQ(m.use().reserved, 2 * kMiB);  // cached, not given back
  EXPECT_EQ(m.use().inactive_split, 0u);  // merged into one whole free segment
  m.validate();
  EXPECT_EQ(m.release_cached(), 2 * kMiB);
  EXPECT_EQ(m.use().reserved, 0u);
}

TEST(CachingAllocatorModel, ReservedHoldingTagsCountsWholeSegmentsOfOldBlocks) {
  CachingAllocatorModel m;
  // Tags 1 and 2 share a 2 MiB segment; tag 3 has a 20 MiB one; tag 5 shares it.
  const auto a = m.allocate(1000, cap_of(kNoCap), nullptr, 1);
  const auto b = m.allocate(1000, cap_of(kNoCap), nullptr, 2);
  const auto c = m.allocate(3 * kMiB, cap_of(kNoCap), nullptr, 3);
  const auto d = m.allocate(2 * kMiB, cap_of(kNoCap), nullptr, 5);
  EXPECT_EQ(m.segments(), 2u);
  EXPECT_EQ(m.reserved_holding_tags_up_to(0), 0u);
  EXPECT_EQ(m.reserved_holding_tags_up_to(1), 2 * kMiB);
  EXPECT_EQ(m.reserved_holding_tags_up_to(3), 22 * kMiB);
  m.free(c);  // the 20 MiB segment is held by tag 5 alone now
  EXPECT_EQ(m.reserved_holding_tags_up_to(4), 2 * kMiB);
  EXPECT_EQ(m.reserved_holding_tags_up_to(5), 22 * kMiB);
  m.free(a);
  EXPECT_EQ(m.reserved_holding_tags_up_to(1), 0u);
  EXPECT_EQ(m.reserved_holding_tags_up_to(2), 2 * kMiB);
  m.free(b);
  m.free(d);
  EXPECT_EQ(m.reserved_holding_tags_up_to(10), 0u);
  m.validate();
}

TEST(CachingAllocatorModel, MidSizedRequestsSplitTwentyMiB) {
  CachingAllocatorModel m;
  const auto a = m.allocate(5 * kMiB, cap_of(kNoCap), nullptr);
  EXPECT_EQ(m.use().reserved, 20 * kMiB);
  EXPECT_EQ(m.use().inactive_split, 15 * kMiB);
  const auto b = m.allocate(12 * kMiB, cap_of(kNoCap), nullptr);  // fits the 15 MiB left
  EXPECT_EQ(m.segments(), 1u);
  EXPECT_EQ(m.use().allocated, 17 * kMiB);
  EXPECT_EQ(m.use().inactive_split, 3 * kMiB);
  m.free(a);
  m.free(b);
  m.validate();
}

TEST(CachingAllocatorModel, LargeBlockKeepsARestOfOneMiBOrLess) {
  CachingAllocatorModel m;
  // 65 MiB + 1 byte: a 66 MiB segment whose rest (just under 1 MiB) is not split off.
  const auto a = m.allocate(65 * kMiB + 1, cap_of(kNoCap), nullptr);
  EXPECT_EQ(m.use().reserved, 66 * kMiB);
  EXPECT_EQ(m.use().allocated, 66 * kMiB);
  EXPECT_EQ(m.block_size(a), 66 * kMiB);
  m.free(a);
  // A 32 MiB request reuses the cached 66 MiB block and splits it (34 MiB left).
  const auto b = m.allocate(32 * kMiB, cap_of(kNoCap), nullptr);
  EXPECT_EQ(m.segments(), 1u);
  EXPECT_EQ(m.use().allocated, 32 * kMiB);
  EXPECT_EQ(m.use().inactive_split, 34 * kMiB);
  m.free(b);
  m.validate();
}

TEST(CachingAllocatorModel, BestFitTakesTheSmallestCachedBlock) {
  CachingAllocatorModel m;
  const auto big = m.allocate(40 * kMiB, cap_of(kNoCap), nullptr);
  const auto mid = m.allocate(24 * kMiB, cap_of(kNoCap), nullptr);
  m.free(big);
  m.free(mid);
  const auto c = m.allocate(22 * kMiB, cap_of(kNoCap), nullptr);  // into the 24 MiB one: 2 MiB left, split
  EXPECT_EQ(m.segments(), 2u);
  EXPECT_EQ(m.use().inactive_split, 2 * kMiB);
  m.free(c);
  m.validate();
}

// The H200's failure in miniature: allocated bytes plus the request fit the
// cap, but the reserved bytes do not, and no whole free segment is left to
// give back.
TEST(CachingAllocatorModel, FailsOnReservedButUnallocatedBytes) {
  CachingAllocatorModel m;
  const auto a = m.allocate(5 * kMiB, cap_of(40 * kMiB), nullptr);
  const auto b = m.allocate(5 * kMiB, cap_of(40 * kMiB), nullptr);
  m.free(a);  // a 5 MiB hole before b, 10 MiB free after it: all split
  EXPECT_EQ(m.use().allocated, 5 * kMiB);
  EXPECT_EQ(m.use().reserved, 20 * kMiB);
  EXPECT_EQ(m.use().inactive_split, 15 * kMiB);
  bool asked = false;
  const auto c = m.allocate(25 * kMiB, cap_of(40 * kMiB), [&] {
    asked = true;
    return false;
  });
  EXPECT_TRUE(asked);  // a miss asks before it reserves
  EXPECT_EQ(c, 0u);    // 5 allocated + 25 < 40, yet 20 reserved + a 26 MiB segment > 40
  EXPECT_NE(m.last_failure().find("segment of 27262976 bytes"), std::string::npos) << m.last_failure();
  EXPECT_EQ(m.use().reserved, 20 * kMiB);  // nothing whole to give back
  m.free(b);
  m.validate();
}

TEST(CachingAllocatorModel, MissGivesBackWholeFreeSegmentsBeforeFailing) {
  CachingAllocatorModel m;
  const auto a = m.allocate(40 * kMiB, cap_of(100 * kMiB), nullptr);
  const auto b = m.allocate(40 * kMiB, cap_of(100 * kMiB), nullptr);
  m.free(a);
  const auto c = m.allocate(50 * kMiB, cap_of(100 * kMiB), nullptr);
  ASSERT_NE(c, 0u);
  EXPECT_EQ(m.use().reserved, 90 * kMiB);  // a's segment was released for c's
  m.free(b);
  m.free(c);
  m.validate();
}

// A miss asks first; what it frees (here: the cap rises, as when a chunk
// leaves the simulated device) lets the new segment in.
TEST(CachingAllocatorModel, RoomMadeOnAMissLetsTheSegmentIn) {
  CachingAllocatorModel m;
  std::size_t cap = 30 * kMiB;
  const auto a = m.allocate(24 * kMiB, [&] { return cap; }, nullptr);
  ASSERT_NE(a, 0u);
  const auto b = m.allocate(24 * kMiB, [&] { return cap; }, [&] {
    cap += 24 * kMiB;
    return true;
  });
  ASSERT_NE(b, 0u);
  EXPECT_EQ(m.use().reserved, 48 * kMiB);
  m.free(a);
  m.free(b);
  m.validate();
}

TEST(RoomToMake, CountsWhatTorchCannotGiveBack) {
  AllocatorUse use;
  use.reserved = 60 * kMiB;
  use.allocated = use.active = 30 * kMiB;
  use.inactive_split = 10 * kMiB;  // 20 MiB are whole free segments: torch gives those back
  // The largest request, 25 MiB, needs a 26 MiB segment; 100 - 40 = 60 MiB can still be had.
  EXPECT_EQ(room_to_make(use, 100 * kMiB, 25 * kMiB), 0u);
  // Under a 60 MiB cap only 20 MiB can be had: 6 MiB must leave.
  EXPECT_EQ(room_to_make(use, 60 * kMiB, 25 * kMiB), 6 * kMiB);
  // A cap below what is stuck: the whole segment.
  EXPECT_EQ(room_to_make(use, 30 * kMiB, 25 * kMiB), 26 * kMiB);
  // Small requests still need a 2 MiB segment.
  EXPECT_EQ(room_to_make(use, 41 * kMiB, 100), kMiB);
}

// Random traffic: the counters always match the blocks, freed memory merges
// back, and the reserved bytes never pass the cap.
TEST(CachingAllocatorModel, RandomTrafficKeepsItsInvariants) {
  CachingAllocatorModel m;
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int> kind(0, 9);
  std::vector<CachingAllocatorModel::Handle> live;
  const std::size_t cap = 512 * kMiB;
  std::size_t failures = 0;
  for (int i = 0; i < 20000; ++i) {
    if (!live.empty() && kind(rng) < 4) {
      std::uniform_int_distribution<std::size_t> pick(0, live.size() - 1);
      const std::size_t j = pick(rng);
      m.free(live[j]);
      live[j] = live.back();
      live.pop_back();
    } else {
      const int k = kind(rng);
      std::size_t bytes = k < 5 ? std::uniform_int_distribution<std::size_t>(1, kMiB)(rng)
                          : k < 8 ? std::uniform_int_distribution<std::size_t>(kMiB, 10 * kMiB)(rng)
                                  : std::uniform_int_distribution<std::size_t>(10 * kMiB, 80 * kMiB)(rng);
      const auto h = m.allocate(bytes, cap_of(cap), nullptr);
      if (h == 0) {
        ++failures;
      } else {
        EXPECT_GE(m.block_size(h), bytes);
        live.push_back(h);
      }
    }
    ASSERT_LE(m.use().reserved, cap);
    ASSERT_LE(m.use().allocated + m.use().inactive_split, m.use().reserved);
    if (i % 997 == 0) m.validate();
  }
  EXPECT_GT(failures, 0u);  // the cap bound some requests
  for (auto h : live) m.free(h);
  m.validate();
  EXPECT_EQ(m.use().allocated, 0u);
  EXPECT_EQ(m.use().inactive_split, 0u);  // every segment merged back whole
  m.release_cached();
  EXPECT_EQ(m.use().reserved, 0u);
}

}  // namespace
}  // namespace tidal
