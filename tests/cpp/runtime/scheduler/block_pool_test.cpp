// The scheduler's block cache: what a trim keeps (Note [Host blocks for a
// steady step] in runtime/scheduler/chunk_scheduler.h).
#include <gtest/gtest.h>

#include <map>

#include "runtime/scheduler/block_pool.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::kKiB;
using testing::make_device;

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr std::size_t kSmall = 4 * kKiB;
constexpr std::size_t kLarge = 16 * kKiB;  // a dedicated chunk's block

// Three small and two large free blocks in the cache.
void fill(BlockPool& pool) {
  for (int i = 0; i < 3; ++i) pool.give_back(pool.allocate(kHost, kSmall));
  for (int i = 0; i < 2; ++i) pool.give_back(pool.allocate(kHost, kLarge));
}

TEST(BlockPool, ATrimByCountFreesTheLargestFirst) {
  BlockPool pool(make_device(kKiB * kKiB), /*pin_host=*/false);
  fill(pool);
  EXPECT_EQ(pool.trim_ready(kHost, 2), 3u);
  EXPECT_EQ(pool.cached_blocks(kHost), 2u);
  EXPECT_FALSE(pool.has_cached(kHost, kLarge));
  EXPECT_EQ(pool.cached_bytes(kHost), 2 * kSmall);
  pool.validate();
}

TEST(BlockPool, ATrimBySizeKeepsTheBlocksEachSizeIsToKeep) {
  BlockPool pool(make_device(kKiB * kKiB), /*pin_host=*/false);
  fill(pool);
  // A step that takes both large blocks and one small one keeps them, though
  // the large are what a trim by count frees first.
  const std::map<std::size_t, std::size_t> keep{{kLarge, 2}, {kSmall, 1}};
  EXPECT_EQ(pool.trim_ready(kHost, 3, keep), 2u);
  EXPECT_EQ(pool.cached_bytes(kHost), 2 * kLarge + kSmall);
  // Room beyond the sizes' keeps (a floor of 4 blocks) keeps what is there.
  BlockPool floor(make_device(kKiB * kKiB), /*pin_host=*/false);
  fill(floor);
  EXPECT_EQ(floor.trim_ready(kHost, 4, keep), 1u);
  EXPECT_EQ(floor.cached_bytes(kHost), 2 * kLarge + 2 * kSmall);
  // A size the map does not name keeps none once the count is over.
  BlockPool none(make_device(kKiB * kKiB), /*pin_host=*/false);
  fill(none);
  EXPECT_EQ(none.trim_ready(kHost, 2, {{kLarge, 2}}), 3u);
  EXPECT_EQ(none.cached_bytes(kHost), 2 * kLarge);
  pool.validate();
  floor.validate();
  none.validate();
}

TEST(BlockPool, HandedOutBySizeCountsNewBlocksAndReusesAlike) {
  BlockPool pool(make_device(kKiB * kKiB), /*pin_host=*/false);
  fill(pool);
  BlockPtr reused = pool.take_cached(kHost, kLarge);
  ASSERT_NE(reused, nullptr);
  const auto& handed = pool.handed_out_by_size(kHost);
  EXPECT_EQ(handed.at(kSmall), 3u);
  EXPECT_EQ(handed.at(kLarge), 3u);
  EXPECT_EQ(pool.handed_out(kHost), 6u);
  pool.give_back(std::move(reused));
  pool.validate();
}

}  // namespace
}  // namespace tidal
