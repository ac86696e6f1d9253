// The scheduler's block cache: what a trim keeps (Note [Host blocks for a
// steady step] in runtime/scheduler/chunk_scheduler.h).
#include <gtest/gtest.h>

#include <cstdint>
#include <map>
#include <vector>

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

TEST(BlockPool, AHostBlockIsMadePageableAndPinnedWhenACrossingAsks) {
  // Note [Pinned at the second crossing] in chunk_scheduler.h.
  for (const bool pin : {false, true}) {
    BlockPool pool(make_device(kKiB * kKiB), pin);
    BlockPtr block = pool.allocate(kHost, kSmall);
    EXPECT_FALSE(block->host.registered());  // made pageable
    EXPECT_FALSE(pool.prepare_crossing(*block, /*pin=*/false));
    EXPECT_FALSE(block->host.registered());
    EXPECT_EQ(pool.prepare_crossing(*block, /*pin=*/true), pin);  // only with pinning on
    EXPECT_EQ(block->host.registered(), pin);
    EXPECT_FALSE(pool.prepare_crossing(*block, /*pin=*/true));  // pinned once
    pool.give_back(std::move(block));
    pool.validate();
  }
}

TEST(BlockPool, TheHostCacheHandsOutPinnedOrUnpinnedBlocksAsAsked) {
  BlockPool pool(make_device(kKiB * kKiB), /*pin_host=*/true);
  BlockPtr pinned = pool.allocate(kHost, kSmall);
  pool.prepare_crossing(*pinned, /*pin=*/true);
  const void* pinned_data = pinned->data;
  // Given back first: the newest cached blocks are not pinned.
  pool.give_back(std::move(pinned));
  pool.give_back(pool.allocate(kHost, kSmall));
  pool.give_back(pool.allocate(kHost, kSmall));
  BlockPtr plain = pool.take_cached(kHost, kSmall, /*pinned=*/false);
  EXPECT_FALSE(plain->host.registered());
  EXPECT_EQ(pool.take_cached(kHost, kSmall, /*pinned=*/true)->data, pinned_data);
  // None pinned left: a block not pinned, rather than none.
  BlockPtr other = pool.take_cached(kHost, kSmall, /*pinned=*/true);
  ASSERT_NE(other, nullptr);
  EXPECT_FALSE(other->host.registered());
  // And a pinned one, where only pinned ones are left, to a chunk that does not ask.
  pool.give_back(std::move(other));
  BlockPtr again = pool.take_cached(kHost, kSmall);
  pool.prepare_crossing(*again, /*pin=*/true);
  pool.give_back(std::move(again));
  EXPECT_TRUE(pool.take_cached(kHost, kSmall, /*pinned=*/false)->host.registered());
  pool.validate();
}

TEST(BlockPool, ATrimFreesBlocksNotPinnedBeforePinnedOnes) {
  BlockPool pool(make_device(kKiB * kKiB), /*pin_host=*/true);
  BlockPtr pinned = pool.allocate(kHost, kLarge);  // the largest: what a trim took first
  pool.prepare_crossing(*pinned, /*pin=*/true);
  const void* pinned_data = pinned->data;
  pool.give_back(std::move(pinned));
  for (int i = 0; i < 2; ++i) pool.give_back(pool.allocate(kHost, kSmall));
  EXPECT_EQ(pool.trim_ready(kHost, 1), 2u);
  EXPECT_EQ(pool.cached_bytes(kHost), kLarge);
  EXPECT_TRUE(pool.trim_one(kHost));  // then the pinned one
  EXPECT_EQ(pool.cached_blocks(kHost), 0u);
  // trim_one alike.
  BlockPtr again = pool.allocate(kHost, kSmall);
  pool.prepare_crossing(*again, /*pin=*/true);
  pinned_data = again->data;
  pool.give_back(std::move(again));
  pool.give_back(pool.allocate(kHost, kSmall));
  EXPECT_TRUE(pool.trim_one(kHost));
  EXPECT_EQ(pool.take_cached(kHost, kSmall)->data, pinned_data);
  pool.validate();
}

TEST(BlockPool, ACachedBlockWhoseCopyIsDoneGoesFirstElseTheOldest) {
  // Note [A cached block whose copy is done] in block_pool.cpp: three device
  // blocks given back while their copies out are queued on one stream of a
  // slow link (each 4 KiB copy about 4 ms), oldest first.
  constexpr MemorySpace kDevice = MemorySpace::kDevice;
  auto device = make_device(kKiB * kKiB, /*bandwidth=*/1e6);
  BlockPool pool(device, /*pin_host=*/false);
  auto stream = device->create_stream("d2h");
  HostBuffer host(3 * kSmall);
  std::vector<const void*> order;
  for (int i = 0; i < 3; ++i) {
    BlockPtr block = pool.allocate(kDevice, kSmall);
    device->copy_async(static_cast<char*>(host.data()) + i * kSmall, block->data, kSmall,
                       CopyKind::kDeviceToHost, *stream);
    block->record_fence(*stream);
    order.push_back(block->data);
    pool.give_back(std::move(block));
  }
  // None done: the oldest, whose copy lands first (the newest would wait for all three).
  BlockPtr first = pool.take_cached(kDevice, kSmall);
  EXPECT_EQ(first->data, order[0]);
  EXPECT_FALSE(first->ready());
  stream->synchronize();
  // All done: the newest, as before.
  EXPECT_EQ(pool.take_cached(kDevice, kSmall)->data, order[2]);
  // One done, one not: the done one, though older than a block given back since.
  BlockPtr last = pool.take_cached(kDevice, kSmall);
  EXPECT_EQ(last->data, order[1]);
  device->copy_async(host.data(), first->data, kSmall, CopyKind::kDeviceToHost, *stream);
  first->record_fence(*stream);
  pool.give_back(std::move(last));   // done
  pool.give_back(std::move(first));  // its copy queued: the newest
  EXPECT_EQ(pool.take_cached(kDevice, kSmall)->data, order[1]);
  stream->synchronize();
  pool.validate();
}

// Note [Images someone still wants] in chunk_scheduler.cpp: of cached host
// blocks tagged as chunks' images, those whose image nobody wants are handed
// out and freed before those whose image is wanted, whatever their age; with
// no predicate set every image is wanted (blocks holding none go first).
TEST(BlockPool, ABlockWhoseImageNobodyWantsGoesBeforeOneWhoseImageIsWanted) {
  const auto tagged = [](BlockPool& pool) {
    std::vector<const void*> data;
    for (std::int64_t chunk = 0; chunk < 3; ++chunk) {
      BlockPtr block = pool.allocate(kHost, kSmall);
      block->image_of = chunk;
      block->image_version = 7;
      data.push_back(block->data);
      pool.give_back(std::move(block));
    }
    return data;  // chunk 2's is the newest
  };
  const auto wanted = [](std::int64_t chunk, std::uint64_t version) { return chunk != 1 && version == 7; };
  BlockPool pool(make_device(kKiB * kKiB), /*pin_host=*/false);
  const auto data = tagged(pool);
  EXPECT_FALSE(pool.has_cached_without_wanted_image(kHost, kSmall));  // (none set: every image is wanted)
  pool.set_image_wanted(wanted);
  EXPECT_TRUE(pool.has_cached_without_wanted_image(kHost, kSmall));
  BlockPtr stale = pool.take_cached(kHost, kSmall);
  EXPECT_EQ(stale->data, data[1]);
  EXPECT_EQ(stale->image_of, -1);  // handed out: no image any more
  EXPECT_FALSE(pool.has_cached_without_wanted_image(kHost, kSmall));
  EXPECT_TRUE(pool.has_image(kSmall, 0, 7) && pool.has_image(kSmall, 2, 7));
  // Only wanted ones left: the newest of them rather than none.
  EXPECT_EQ(pool.take_cached(kHost, kSmall)->data, data[2]);
  pool.give_back(std::move(stale));
  EXPECT_TRUE(pool.has_cached_without_wanted_image(kHost, kSmall));  // (a block holding none)
  pool.validate();

  // A trim frees the unwanted image first, then the wanted ones; trim_one alike.
  BlockPool trimmed(make_device(kKiB * kKiB), /*pin_host=*/false);
  const auto kept = tagged(trimmed);
  trimmed.set_image_wanted(wanted);
  EXPECT_EQ(trimmed.trim_ready(kHost, 2), 1u);
  EXPECT_FALSE(trimmed.has_image(kSmall, 1, 7));
  EXPECT_TRUE(trimmed.has_image(kSmall, 0, 7) && trimmed.has_image(kSmall, 2, 7));
  trimmed.set_image_wanted([](std::int64_t chunk, std::uint64_t) { return chunk == 0; });
  EXPECT_TRUE(trimmed.trim_one(kHost));
  EXPECT_TRUE(trimmed.has_image(kSmall, 0, 7));
  EXPECT_FALSE(trimmed.has_image(kSmall, 2, 7));
  EXPECT_EQ(kept.size(), 3u);
  trimmed.validate();

  // Blocks holding no wanted image go before one pinned as asked.
  BlockPool pinning(make_device(kKiB * kKiB), /*pin_host=*/true);
  BlockPtr image = pinning.allocate(kHost, kSmall);
  pinning.prepare_crossing(*image, /*pin=*/true);
  image->image_of = 0;
  image->image_version = 7;
  pinning.give_back(std::move(image));
  pinning.give_back(pinning.allocate(kHost, kSmall));
  pinning.set_image_wanted(wanted);
  BlockPtr plain = pinning.take_cached(kHost, kSmall, /*pinned=*/true);
  EXPECT_FALSE(plain->host.registered());
  EXPECT_TRUE(pinning.has_image(kSmall, 0, 7));
  pinning.give_back(std::move(plain));
  pinning.validate();
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
