// The chunk scheduler's behaviour case by case on the simulated device:
// placement and moves, payload drops, misuse errors, budgets and their
// error text, OPT against LRU on a known sequence, waiting for copies, the
// trace life cycle, and memory returning to baseline.
#include "runtime/scheduler/chunk_scheduler.h"

#include <gtest/gtest.h>

#include <string>
#include <thread>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/memory/host_buffer.h"
#include "scheduler_test_util.h"

namespace tidal {
namespace {

using testing::has_pattern;
using testing::kKiB;
using testing::make_device;
using testing::make_store;
using testing::write_pattern;

constexpr MemorySpace kHost = MemorySpace::kHost;
constexpr MemorySpace kDev = MemorySpace::kDevice;
constexpr std::size_t kChunk = 4 * kKiB;  // 2048 fp16 elements
constexpr std::size_t kFull = 2048;       // a tensor that fills a chunk

TensorRef p16(TensorId t) { return {ChunkKind::kParam16, t}; }

ChunkSchedulerOptions no_prefetch(std::size_t device_budget) {
  ChunkSchedulerOptions options;
  options.device_budget_bytes = device_budget;
  options.prefetch = false;
  return options;
}

TEST(ChunkScheduler, AccessPlacesTheChunkAndMovesItBetweenSpaces) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({1000, 1000, kFull}, kChunk), device, no_prefetch(16 * kChunk));
  void* a = s.access(p16(0), kDev);
  EXPECT_TRUE(device->owns(a, 2000));
  EXPECT_EQ(s.store().state(p16(0)), TensorState::kCompute);
  write_pattern(a, 2000, 1);
  s.release(p16(0), TensorState::kHoldAfterFwd);
  EXPECT_EQ(s.store().state(p16(0)), TensorState::kHoldAfterFwd);

  void* b = s.access(p16(1), kDev);  // same chunk: a hit at the next aligned offset
  EXPECT_EQ(static_cast<char*>(b), static_cast<char*>(a) + 1024 * 2);
  write_pattern(b, 2000, 2);
  s.release(p16(1), TensorState::kHoldAfterFwd);

  void* a_host = s.access(p16(0), kHost);  // the chunk moves device -> host
  EXPECT_FALSE(device->owns(a_host, 1));
  EXPECT_TRUE(has_pattern(a_host, 2000, 1));
  EXPECT_EQ(s.store().chunk(s.store().chunk_of(p16(0))).space(), kHost);
  s.release(p16(0), TensorState::kHold);
  void* a_dev = s.access(p16(0), kDev);  // and back
  EXPECT_TRUE(device->owns(a_dev, 2000));
  EXPECT_TRUE(has_pattern(a_dev, 2000, 1));
  EXPECT_TRUE(has_pattern(static_cast<char*>(a_dev) + 2048, 2000, 2));
  s.release(p16(0), TensorState::kHold);

  const ChunkSchedulerStats st = s.stats();
  EXPECT_EQ(st.accesses, 4u);
  EXPECT_EQ(st.releases, 4u);
  EXPECT_EQ(st.materializations, 1u);
  EXPECT_EQ(st.hits, 1u);
  EXPECT_EQ(st.misses, 2u);
  EXPECT_EQ(st.moves_device_to_host, 1u);
  EXPECT_EQ(st.moves_host_to_device, 1u);
  EXPECT_EQ(st.bytes_device_to_host, kChunk);
  EXPECT_EQ(st.bytes_host_to_device, kChunk);
  EXPECT_EQ(st.evictions, 0u);
  EXPECT_EQ(st.resident_bytes[index_of(kDev)], kChunk);
  EXPECT_EQ(st.peak_resident_bytes[index_of(kDev)], kChunk);
  EXPECT_EQ(st.peak_resident_bytes[index_of(kHost)], kChunk);
  s.validate();
}

// Accesses tensor t in `space`, writes its pattern (write) or checks it,
// and releases it.
void use(ChunkScheduler& s, TensorId t, MemorySpace space, unsigned seed, bool write = false) {
  void* p = s.access(p16(t), space);
  if (write) {
    write_pattern(p, kChunk, seed);
  } else {
    EXPECT_TRUE(has_pattern(p, kChunk, seed)) << "tensor " << t;
  }
  s.release(p16(t), TensorState::kHold);
}

TEST(ChunkScheduler, AHostBlockIsPinnedAtItsSecondCrossingAndNothingElseIs) {
  // Note [Pinned at the second crossing]: pinning charged, as on a GPU.
  auto device = make_sim_device({.capacity_bytes = kKiB * kKiB, .pin_bandwidth_bytes_per_s = 1e12});
  ChunkScheduler s(make_store({kFull, kFull}, kChunk), device, no_prefetch(16 * kChunk));
  // t1's chunk is made on the host and used there (CPU Adam's states): it
  // never crosses, and nothing pins it.
  use(s, 1, kHost, 7, /*write=*/true);
  use(s, 0, kHost, 1, /*write=*/true);
  // The first step's copies are not counted: down and up, pageable.
  use(s, 0, kDev, 1);
  use(s, 0, kHost, 1);
  s.end_step();
  EXPECT_EQ(s.stats().host_pins, 0u);
  EXPECT_EQ(s.stats().pageable_copies, 2u);
  // Up once: a pageable copy, nothing pinned.
  use(s, 0, kDev, 1);
  EXPECT_EQ(s.stats().host_pins, 0u);
  EXPECT_EQ(s.stats().pageable_copies, 3u);
  // Down and up again and again: pinned at its second counted crossing,
  // once; the pinned block is the one it takes back each time.
  for (unsigned round = 0; round < 4; ++round) {
    use(s, 0, kHost, 10 + round, /*write=*/true);
    use(s, 0, kDev, 10 + round);
    const ChunkSchedulerStats st = s.stats();
    EXPECT_EQ(st.host_pins, 1u) << "round " << round;
    EXPECT_EQ(st.host_bytes_pinned, kChunk);
    EXPECT_EQ(st.pageable_copies, 3u);
  }
  // t1's chunk goes up once (a trip that does not repeat): pageable, and
  // its block is not pinned.
  use(s, 1, kDev, 7);
  const ChunkSchedulerStats st = s.stats();
  EXPECT_EQ(st.host_pins, 1u);
  EXPECT_EQ(st.pageable_copies, 4u);
  EXPECT_EQ(st.moves_device_to_host, 5u);
  EXPECT_EQ(st.moves_host_to_device, 7u);
  s.validate();
  // With pinning off nothing is pinned, and every copy is pageable.
  ChunkSchedulerOptions off = no_prefetch(16 * kChunk);
  off.pin_host_memory = false;
  ChunkScheduler unpinned(make_store({kFull}, kChunk), device, off);
  use(unpinned, 0, kHost, 2, /*write=*/true);  // (materialized on the host)
  unpinned.end_step();
  for (unsigned round = 0; round < 3; ++round) {
    use(unpinned, 0, kDev, 2);
    use(unpinned, 0, kHost, 2);
  }
  EXPECT_EQ(unpinned.stats().host_pins, 0u);
  EXPECT_EQ(unpinned.stats().pageable_copies, 6u);
}

TEST(ChunkScheduler, AllFreeChunksDropTheirPayload) {
  auto device = make_device(kKiB * kKiB);
  {
    ChunkScheduler s(make_store({100, 100}, kChunk), device, no_prefetch(4 * kChunk));
    s.access(p16(0), kDev);
    s.release(p16(0), TensorState::kHold);
    s.access(p16(1), kDev);
    s.release(p16(1), TensorState::kFree);  // t0 still holds data: the payload stays
    EXPECT_TRUE(s.store().chunk(0).has_payload());
    s.set_state(p16(0), TensorState::kFree);
    EXPECT_FALSE(s.store().chunk(0).has_payload());
    const ChunkSchedulerStats st = s.stats();
    EXPECT_EQ(st.payload_drops, 1u);
    EXPECT_EQ(st.resident_bytes[index_of(kDev)], 0u);
    EXPECT_EQ(st.held_bytes[index_of(kDev)], kChunk) << "the block stays cached for reuse";
    s.access(p16(1), kDev);  // a fresh payload from the cache
    EXPECT_EQ(s.stats().materializations, 2u);
    EXPECT_EQ(device->memory_stats().allocations, 1u);
    s.release(p16(1), TensorState::kHold);
    s.validate();
  }
  ChunkSchedulerOptions keep = no_prefetch(4 * kChunk);
  keep.drop_free_chunks = false;
  ChunkScheduler s(make_store({100}, kChunk), device, keep);
  s.access(p16(0), kDev);
  s.release(p16(0), TensorState::kFree);
  EXPECT_TRUE(s.store().chunk(0).has_payload());
  EXPECT_EQ(s.stats().payload_drops, 0u);
  s.validate();
}

TEST(ChunkScheduler, MisuseIsAnErrorThatChangesNothing) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({100, kFull}, kChunk), device, no_prefetch(4 * kChunk));
  try {
    s.release(p16(0), TensorState::kHold);
    FAIL() << "released a FREE tensor";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("'t0'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("FREE, not COMPUTE"), std::string::npos) << e.message();
  }
  s.access(p16(0), kDev);
  EXPECT_THROW(s.release(p16(0), TensorState::kCompute), ValueError);
  EXPECT_EQ(s.store().state(p16(0)), TensorState::kCompute);
  try {
    s.access(p16(0), kDev);
    FAIL() << "nested access accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("COMPUTE -> COMPUTE"), std::string::npos) << e.message();
  }
  EXPECT_EQ(s.stats().accesses, 1u);
  EXPECT_EQ(s.moment(), 0);
  EXPECT_THROW(s.set_state(p16(0), TensorState::kHold), ValueError);
  s.release(p16(0), TensorState::kHold);
  EXPECT_THROW(s.set_state(p16(0), TensorState::kCompute), ValueError);
  EXPECT_THROW(s.set_state(p16(0), TensorState::kHoldAfterBwd), ValueError);
  EXPECT_THROW(s.access(p16(1), MemorySpace::kNone), ValueError);
  EXPECT_THROW(s.access({ChunkKind::kParam16, 9}, kDev), IndexError);
  EXPECT_EQ(s.store().state(p16(0)), TensorState::kHold);
  s.validate();
}

TEST(ChunkScheduler, EvictsToStayWithinTheBudgetAndKeepsTheData) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store(std::vector<std::size_t>(6, kFull), kChunk), device,
                   no_prefetch(3 * kChunk));
  for (TensorId t = 0; t < 6; ++t) {
    write_pattern(s.access(p16(t), kDev), kFull * 2, 100 + t);
    s.release(p16(t), TensorState::kHold);
    const ChunkSchedulerStats st = s.stats();
    EXPECT_LE(st.resident_bytes[index_of(kDev)], 3 * kChunk);
    EXPECT_LE(st.held_bytes[index_of(kDev)], 3 * kChunk);
    s.validate();
  }
  EXPECT_EQ(s.stats().evictions, 3u);
  EXPECT_EQ(s.stats().peak_resident_bytes[index_of(kDev)], 3 * kChunk);
  EXPECT_LE(device->memory_stats().peak_in_use_bytes, 3 * kChunk);
  for (TensorId t = 0; t < 6; ++t) {
    EXPECT_TRUE(has_pattern(s.access(p16(t), kHost), kFull * 2, 100 + t)) << t;
    s.release(p16(t), TensorState::kHold);
  }
  s.validate();
}

// Note [A clean chunk goes down without a copy]: six chunks written on the
// host go up three at a time for reading. Each leaves the device (evicted,
// or wanted on the host) by taking back the host block it came from: no
// byte crosses, and every byte reads back. A write access, mark_written, or
// the block going to another chunk makes the next move down copy.
TEST(ChunkScheduler, AChunkOnlyReadOnTheDeviceGoesDownWithoutACopy) {
  for (const bool skip : {true, false}) {
    SCOPED_TRACE(skip ? "skip_clean_copies" : "every move down copies");
    ChunkSchedulerOptions options = no_prefetch(3 * kChunk);
    options.skip_clean_copies = skip;
    ChunkScheduler s(make_store(std::vector<std::size_t>(6, kFull), kChunk), make_device(kKiB * kKiB), options);
    for (TensorId t = 0; t < 6; ++t) {
      write_pattern(s.access(p16(t), kHost), kFull * 2, 100 + t);
      s.release(p16(t), TensorState::kHold);
    }
    for (TensorId t = 0; t < 6; ++t) {
      EXPECT_TRUE(has_pattern(s.access(p16(t), kDev, AccessMode::kRead), kFull * 2, 100 + t)) << t;
      s.release(p16(t), TensorState::kHold);
      s.validate();
    }
    EXPECT_EQ(s.stats().evictions, 3u);
    for (TensorId t = 0; t < 6; ++t) {  // (3, 4 and 5 come down for it)
      EXPECT_TRUE(has_pattern(s.access(p16(t), kHost, AccessMode::kRead), kFull * 2, 100 + t)) << t;
      s.release(p16(t), TensorState::kHold);
    }
    s.validate();
    const ChunkSchedulerStats st = s.stats();
    EXPECT_EQ(st.moves_device_to_host, 6u);
    EXPECT_EQ(st.copies_down_skipped, skip ? 6u : 0u);
    EXPECT_EQ(st.bytes_down_skipped, skip ? 6 * kChunk : 0u);
    EXPECT_EQ(st.bytes_device_to_host, skip ? 0u : 6 * kChunk);
    EXPECT_EQ(st.bytes_host_to_device, 6 * kChunk);
  }
}

// Note [The weights' image instead of the restore] in hooks/gradient_sums.h:
// chunk 0 (two tensors) goes up for reading, its gradients are written on
// the device and come down by copy into another host block. The block it
// went up from is still cached with its write count then: the chunk takes it
// back at its last slot's release, and reads its weights again; the block
// of the gradients goes to the pool. Not for another write count, not while
// another slot is in use, not on the device, not with skip_clean_copies off.
// (A frozen chunk going up first leaves the host block the gradients come
// down into: not an image, the pool hands it out first. The fold's caller
// expects the image before the gradients land, as GradientSums does: Note
// [Images someone still wants] in chunk_scheduler.cpp.)
TEST(ChunkScheduler, AChunkWhoseGradientsCameDownTakesBackTheBlockItWentUpFrom) {
  for (const bool skip : {true, false}) {
    SCOPED_TRACE(skip ? "skip_clean_copies" : "every move down copies");
    ChunkSchedulerOptions options = no_prefetch(4 * kChunk);
    options.skip_clean_copies = skip;
    options.clean_copy_pools = 1u << 0;
    ChunkStore store({.chunk_bytes = kChunk});
    store.register_tensor("w0", kFull / 2, /*pool=*/0);
    store.register_tensor("w1", kFull / 2, /*pool=*/0);
    store.register_tensor("frozen", kFull, /*pool=*/1);
    ChunkScheduler s(std::move(store), make_device(kKiB * kKiB), options);
    const ChunkId chunk = s.store().chunk_of(p16(0));
    ASSERT_EQ(s.store().chunk_of(p16(1)), chunk);
    for (TensorId t = 0; t < 2; ++t) {
      write_pattern(s.access(p16(t), kHost), kFull, 100 + t);
      s.release(p16(t), TensorState::kHold);
    }
    write_pattern(s.access(p16(2), kHost), kFull * 2, 102);
    s.release(p16(2), TensorState::kHold);
    EXPECT_TRUE(has_pattern(s.access(p16(2), kDev, AccessMode::kRead), kFull * 2, 102));
    s.release(p16(2), TensorState::kHold);
    const std::uint64_t weights = s.write_count(chunk);
    for (TensorId t = 0; t < 2; ++t) {
      EXPECT_TRUE(has_pattern(s.access(p16(t), kDev, AccessMode::kRead), kFull, 100 + t)) << t;
      s.release(p16(t), TensorState::kHold);
    }
    EXPECT_FALSE(s.take_back_image(chunk, weights));  // (on the device)
    s.expect_image(chunk, weights);
    for (TensorId t = 0; t < 2; ++t) {  // the gradients
      write_pattern(s.access(p16(t), kDev), kFull, 200 + t);
      s.release(p16(t), TensorState::kHoldAfterBwd);
    }
    EXPECT_EQ(s.write_count(chunk), weights + 2);
    EXPECT_EQ(s.image_cached(chunk, weights), skip);
    EXPECT_FALSE(s.image_cached(chunk, weights + 2));
    // Both slots read on the host (a fold): the gradients came down.
    for (TensorId t = 0; t < 2; ++t) {
      EXPECT_TRUE(has_pattern(s.access(p16(t), kHost, AccessMode::kRead), kFull, 200 + t)) << t;
    }
    EXPECT_EQ(s.stats().bytes_device_to_host, kChunk);
    // Tensor 0's release leaves tensor 1 in use: nothing taken back.
    EXPECT_FALSE(s.release_taking_image(p16(0), TensorState::kHold, weights));
    EXPECT_FALSE(s.take_back_image(chunk, weights + 2));
    const bool taken = s.release_taking_image(p16(1), TensorState::kHold, weights);
    EXPECT_EQ(taken, skip);
    s.validate();
    for (TensorId t = 0; t < 2; ++t) {
      const int want = taken ? 100 + static_cast<int>(t) : 200 + static_cast<int>(t);
      EXPECT_TRUE(has_pattern(s.access(p16(t), kHost, AccessMode::kRead), kFull, want)) << t;
      s.release(p16(t), TensorState::kHold);
    }
    const ChunkSchedulerStats st = s.stats();
    EXPECT_EQ(st.images_taken_back, skip ? 1u : 0u);
    EXPECT_EQ(st.bytes_images_taken_back, skip ? kChunk : 0u);
    EXPECT_EQ(st.bytes_host_to_device, 2 * kChunk);
    EXPECT_EQ(st.bytes_device_to_host, kChunk);
    // The chunk's bytes changed: no block holds them as of any count now.
    EXPECT_FALSE(s.image_cached(chunk, weights));
    EXPECT_FALSE(s.take_back_image(chunk, weights));
    EXPECT_FALSE(s.take_back_image(chunk, s.write_count(chunk)));
    s.validate();
  }
}

// Note [Images someone still wants] in chunk_scheduler.cpp: chunks 0 and 1
// go up for reading, leaving their host blocks cached as their images; 0 is
// then written on the device (its image stale), 1 gets its gradients after
// a fold expects its image. 0 coming down takes its own stale image's block,
// though 1's image is the newest cached block (what the pool handed out
// before); 1 coming down, every cached block being an image someone wants,
// takes a new one; the fold takes 1's image back. Once no one expects it,
// an image is handed out as any block.
TEST(ChunkScheduler, AChunkComingDownTakesAStaleImageOrANewBlockBeforeAnImageAFoldWants) {
  ChunkScheduler s(make_store({kFull, kFull, kFull}, kChunk), make_device(kKiB * kKiB),
                   no_prefetch(2 * kChunk));
  for (TensorId t = 0; t < 2; ++t) {
    write_pattern(s.access(p16(t), kHost), kFull * 2, 100 + t);
    s.release(p16(t), TensorState::kHold);
  }
  for (TensorId t = 0; t < 2; ++t) {
    EXPECT_TRUE(has_pattern(s.access(p16(t), kDev, AccessMode::kRead), kFull * 2, 100 + t));
    s.release(p16(t), TensorState::kHold);
  }
  const ChunkId c0 = s.store().chunk_of(p16(0)), c1 = s.store().chunk_of(p16(1));
  const std::uint64_t w0 = s.write_count(c0), w1 = s.write_count(c1);
  EXPECT_TRUE(s.image_cached(c0, w0) && s.image_cached(c1, w1));
  write_pattern(s.access(p16(0), kDev), kFull * 2, 200);
  s.release(p16(0), TensorState::kHold);
  s.expect_image(c1, w1);
  write_pattern(s.access(p16(1), kDev), kFull * 2, 201);  // the gradients
  s.release(p16(1), TensorState::kHoldAfterBwd);
  EXPECT_TRUE(has_pattern(s.access(p16(0), kHost, AccessMode::kRead), kFull * 2, 200));
  s.release(p16(0), TensorState::kHold);
  EXPECT_TRUE(s.image_cached(c1, w1));
  EXPECT_EQ(s.stats().host_block_allocations, 2u);  // (the two made at first)
  EXPECT_TRUE(has_pattern(s.access(p16(1), kHost, AccessMode::kRead), kFull * 2, 201));
  EXPECT_EQ(s.stats().blocks_for_images, 1u);
  EXPECT_EQ(s.stats().host_block_allocations, 3u);
  EXPECT_TRUE(s.release_taking_image(p16(1), TensorState::kHold, w1));
  s.forget_expected_image(c1);
  EXPECT_TRUE(has_pattern(s.access(p16(1), kHost, AccessMode::kRead), kFull * 2, 101));
  s.release(p16(1), TensorState::kHold);
  EXPECT_EQ(s.stats().bytes_device_to_host, 2 * kChunk);
  // 1 goes up again (its image cached, wanted while 1 is on the device and
  // unwritten) and is written: the image is stale, and no fold expects it.
  // Chunk 2, materializing on the host, takes a cached block, not a new one.
  EXPECT_TRUE(has_pattern(s.access(p16(1), kDev, AccessMode::kRead), kFull * 2, 101));
  s.release(p16(1), TensorState::kHold);
  write_pattern(s.access(p16(1), kDev), kFull * 2, 301);
  s.release(p16(1), TensorState::kHold);
  const std::uint64_t allocations = s.stats().host_block_allocations;
  write_pattern(s.access(p16(2), kHost), kFull * 2, 102);
  s.release(p16(2), TensorState::kHold);
  EXPECT_EQ(s.stats().host_block_allocations, allocations);
  EXPECT_EQ(s.stats().blocks_for_images, 1u);
  s.validate();
}

// Only the pools named in clean_copy_pools skip (the engine names the
// trainable one: a frozen chunk is its tensors' only copy).
TEST(ChunkScheduler, OnlyChunksOfTheNamedPoolsGoDownWithoutACopy) {
  ChunkStore store({.chunk_bytes = kChunk});
  store.register_tensor("trainable", kFull, /*pool=*/0);
  store.register_tensor("frozen", kFull, /*pool=*/1);
  ChunkSchedulerOptions options = no_prefetch(2 * kChunk);
  options.clean_copy_pools = 1u << 0;
  ChunkScheduler s(std::move(store), make_device(kKiB * kKiB), options);
  for (TensorId t = 0; t < 2; ++t) {
    write_pattern(s.access(p16(t), kHost), kFull * 2, 100 + t);
    s.release(p16(t), TensorState::kHold);
    EXPECT_TRUE(has_pattern(s.access(p16(t), kDev, AccessMode::kRead), kFull * 2, 100 + t));
    s.release(p16(t), TensorState::kHold);
    EXPECT_TRUE(has_pattern(s.access(p16(t), kHost, AccessMode::kRead), kFull * 2, 100 + t));
    s.release(p16(t), TensorState::kHold);
  }
  EXPECT_EQ(s.stats().copies_down_skipped, 1u);  // the trainable one
  EXPECT_EQ(s.stats().bytes_device_to_host, kChunk);
  s.validate();
}

// (The host has room for four chunks' blocks: chunk 2's image is the only
// cached block when chunks 3 and 4 materialize; 3 takes a new block beside
// it, Note [Images someone still wants], and 4, finding no room for one,
// the image.)
TEST(ChunkScheduler, AChunkWrittenOnTheDeviceOrWhoseBlockWentElsewhereGoesDownWithACopy) {
  ChunkSchedulerOptions options = no_prefetch(2 * kChunk);
  options.host_budget_bytes = 4 * kChunk;
  ChunkScheduler s(make_store(std::vector<std::size_t>(6, kFull), kChunk), make_device(kKiB * kKiB),
                   options);
  for (TensorId t = 0; t < 3; ++t) {
    write_pattern(s.access(p16(t), kHost), kFull * 2, 100 + t);
    s.release(p16(t), TensorState::kHold);
  }
  // 0: written by a write access on the device; 1: read, then marked written.
  write_pattern(s.access(p16(0), kDev), kFull * 2, 200);
  s.release(p16(0), TensorState::kHold);
  void* p = s.access(p16(1), kDev, AccessMode::kRead);
  write_pattern(p, kFull * 2, 201);  // (a write its reader learnt of after the access)
  s.mark_written(p16(1));
  s.release(p16(1), TensorState::kHold);
  for (TensorId t : {0, 1}) {
    EXPECT_TRUE(has_pattern(s.access(p16(t), kHost, AccessMode::kRead), kFull * 2, 200 + t)) << t;
    s.release(p16(t), TensorState::kHold);
  }
  EXPECT_EQ(s.stats().copies_down_skipped, 0u);
  EXPECT_EQ(s.stats().bytes_device_to_host, 2 * kChunk);
  // 2 goes up for reading; its host block (the only one cached) then goes
  // to new chunk 4, which materializes on the host after 3. 2 must copy.
  EXPECT_TRUE(has_pattern(s.access(p16(2), kDev, AccessMode::kRead), kFull * 2, 102));
  s.release(p16(2), TensorState::kHold);
  for (TensorId t : {3, 4}) {
    write_pattern(s.access(p16(t), kHost), kFull * 2, 300 + t);
    s.release(p16(t), TensorState::kHold);
  }
  EXPECT_TRUE(has_pattern(s.access(p16(2), kHost, AccessMode::kRead), kFull * 2, 102));
  s.release(p16(2), TensorState::kHold);
  EXPECT_EQ(s.stats().copies_down_skipped, 0u);
  EXPECT_EQ(s.stats().bytes_device_to_host, 3 * kChunk);
  EXPECT_EQ(s.stats().blocks_for_images, 1u);
  for (TensorId t : {3, 4}) {
    EXPECT_TRUE(has_pattern(s.access(p16(t), kHost, AccessMode::kRead), kFull * 2, 300 + t)) << t;
    s.release(p16(t), TensorState::kHold);
  }
  s.validate();
}

TEST(ChunkScheduler, BudgetTooSmallErrorNamesTheChunkTheBudgetAndWhatIsPinned) {
  auto device = make_device(kKiB * kKiB);
  ChunkStore store({.chunk_bytes = kChunk});
  store.register_tensor("embed.weight", kFull);
  store.register_tensor("blocks.0.attn.qkv", kFull);
  store.register_tensor("blocks.0.mlp.fc", kFull);
  ChunkScheduler s(std::move(store), device, no_prefetch(2 * kChunk));
  s.access(p16(0), kDev);
  s.access(p16(1), kDev);
  try {
    s.access(p16(2), kDev);
    FAIL() << "access beyond the budget succeeded";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.message();
    const std::string c1 = std::to_string(make_chunk_id(ChunkKind::kParam16, 1));
    const std::string c2 = std::to_string(make_chunk_id(ChunkKind::kParam16, 2));
    for (const std::string& part :
         {"no room on device for chunk " + c2 + " (param16 #2",
          std::string("needed by tensor 'blocks.0.mlp.fc'"),
          std::string("device budget 8.00 KiB (8192 bytes)"),
          std::string("resident 8.00 KiB (8192 bytes) in 2 chunks"),
          std::string("nothing left to evict: pinned in COMPUTE:"),
          std::string("chunk 0 (param16 #0"), std::string("by 'embed.weight'"),
          "chunk " + c1 + " (param16 #1", std::string("by 'blocks.0.attn.qkv'"),
          std::string("Tip: raise the device budget to at least 12.00 KiB (12288 bytes)")}) {
      EXPECT_NE(msg.find(part), std::string::npos) << "missing \"" << part << "\" in: " << msg;
    }
  }
  EXPECT_EQ(s.store().state(p16(2)), TensorState::kFree);
  EXPECT_EQ(s.stats().accesses, 2u);
  s.validate();
  // Releasing one makes room: the other stays, the released one is evicted.
  s.release(p16(1), TensorState::kHoldAfterFwd);
  s.access(p16(2), kDev);
  EXPECT_EQ(s.store().chunk(s.store().chunk_of(p16(1))).space(), kHost);
  EXPECT_EQ(s.store().chunk(s.store().chunk_of(p16(0))).space(), kDev);
  s.validate();
}

TEST(ChunkScheduler, AChunkLargerThanTheBudgetSaysSo) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({2 * kFull}, kChunk), device, no_prefetch(6 * kKiB));
  try {
    s.access(p16(0), kDev);
    FAIL() << "access beyond the budget succeeded";
  } catch (const OutOfMemoryError& e) {
    EXPECT_NE(e.message().find("dedicated"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("the chunk alone (8.00 KiB (8192 bytes)) is larger than the budget"),
              std::string::npos)
        << e.message();
    EXPECT_NE(e.message().find("pinned in COMPUTE: nothing"), std::string::npos) << e.message();
  }
  s.validate();
}

TEST(ChunkScheduler, AChunkPinnedInTheOtherSpaceCannotMove) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({100, 100}, kChunk), device, no_prefetch(4 * kChunk));
  s.access(p16(0), kDev);
  try {
    s.access(p16(1), kHost);
    FAIL() << "moved a chunk with a COMPUTE tensor";
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("tensor 't1'"), std::string::npos) << e.message();
    EXPECT_NE(e.message().find("pinned there by COMPUTE tensors 't0'"), std::string::npos)
        << e.message();
  }
  EXPECT_EQ(s.store().state(p16(1)), TensorState::kFree);
  EXPECT_NO_THROW(s.access(p16(1), kDev));
  s.validate();
}

TEST(ChunkScheduler, AFullHostBudgetFailsTheEvictionWithAClearError) {
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions options = no_prefetch(kChunk);
  options.host_budget_bytes = kChunk;
  ChunkScheduler s(make_store({kFull, kFull, kFull}, kChunk), device, options);
  s.access(p16(0), kDev);
  s.release(p16(0), TensorState::kHold);
  s.access(p16(1), kDev);  // t0 goes to the host, which is now full
  s.release(p16(1), TensorState::kHold);
  try {
    s.access(p16(2), kDev);
    FAIL() << "host budget exceeded";
  } catch (const OutOfMemoryError& e) {
    const std::string msg = e.message();
    const std::string t0 = std::to_string(make_chunk_id(ChunkKind::kParam16, 1));
    const std::string t2 = std::to_string(make_chunk_id(ChunkKind::kParam16, 2));
    EXPECT_NE(msg.find("no room on host for chunk " + t0), std::string::npos) << msg;
    EXPECT_NE(msg.find("being evicted from the device to make room for chunk " + t2),
              std::string::npos)
        << msg;
    EXPECT_NE(msg.find("host budget 4.00 KiB"), std::string::npos) << msg;
    EXPECT_NE(msg.find("nowhere to be evicted to"), std::string::npos) << msg;
  }
  EXPECT_EQ(s.store().state(p16(2)), TensorState::kFree);
  EXPECT_LE(s.stats().held_bytes[index_of(kHost)], kChunk);
  s.validate();
}

// Step: A B C A with room for two chunks. In step 2, at B, OPT evicts A
// (next used at moment 3) and keeps C (moment 2); LRU evicts C, the least
// recently used, and then misses C right away.
TEST(ChunkScheduler, OptEvictsTheFarthestNextUseWhereLruEvictsTheOldest) {
  auto run = [](const char* policy, ChunkId* evicted_at_b) {
    auto device = make_device(kKiB * kKiB);
    ChunkSchedulerOptions options = no_prefetch(2 * kChunk);
    options.policy = make_eviction_policy(policy);
    ChunkScheduler s(make_store({kFull, kFull, kFull}, kChunk), device, options);
    const TensorId sequence[] = {0, 1, 2, 0};
    std::uint64_t misses_step2 = 0;
    for (int step = 0; step < 2; ++step) {
      s.reset_stats();
      for (int m = 0; m < 4; ++m) {
        s.access(p16(sequence[m]), kDev);
        if (step == 1 && m == 1) {
          *evicted_at_b = kNoChunk;
          for (TensorId t : {0u, 2u}) {
            if (s.store().chunk(s.store().chunk_of(p16(t))).space() == kHost) {
              *evicted_at_b = s.store().chunk_of(p16(t));
            }
          }
        }
        s.release(p16(sequence[m]), TensorState::kHold);
      }
      misses_step2 = s.stats().misses;
      s.end_step();
      s.validate();
    }
    return misses_step2;
  };
  ChunkId opt_victim = kNoChunk;
  ChunkId lru_victim = kNoChunk;
  const std::uint64_t opt_misses = run("opt", &opt_victim);
  const std::uint64_t lru_misses = run("lru", &lru_victim);
  EXPECT_EQ(opt_victim, make_chunk_id(ChunkKind::kParam16, 0));  // A
  EXPECT_EQ(lru_victim, make_chunk_id(ChunkKind::kParam16, 2));  // C
  EXPECT_EQ(opt_misses, 2u);
  EXPECT_EQ(lru_misses, 3u);
}

TEST(ChunkScheduler, AccessReturnsOnlyOnceTheCopyHasLanded) {
  // 4 KiB at 2 MB/s: each copy takes about 2 ms.
  auto device = make_device(kKiB * kKiB, 2e6);
  ChunkScheduler s(make_store({kFull}, kChunk), device, no_prefetch(4 * kChunk));
  write_pattern(s.access(p16(0), kHost), kFull * 2, 5);
  s.release(p16(0), TensorState::kHold);
  for (int round = 0; round < 3; ++round) {
    void* d = s.access(p16(0), kDev);
    EXPECT_TRUE(s.chunk_ready(s.store().chunk_of(p16(0))));
    EXPECT_TRUE(has_pattern(d, kFull * 2, 5 + round));
    write_pattern(d, kFull * 2, 6 + round);
    s.release(p16(0), TensorState::kHold);
    void* h = s.access(p16(0), kHost);
    EXPECT_TRUE(has_pattern(h, kFull * 2, 6 + round));
    s.release(p16(0), TensorState::kHold);
  }
  EXPECT_EQ(s.stats().misses, 6u);
  s.validate();
}

TEST(ChunkScheduler, APinThatDoesNotWaitHandsOverTheCopysFence) {
  // Note [A pin that does not wait]. 4 KiB at 20 kB/s: each copy takes about
  // 200 ms, far longer than an access that does not wait for it.
  auto device = make_device(kKiB * kKiB, 2e4);
  ChunkScheduler s(make_store({kFull}, kChunk), device, no_prefetch(4 * kChunk));
  const ChunkId id = s.store().chunk_of(p16(0));
  write_pattern(s.access(p16(0), kDev), kFull * 2, 31);
  s.release(p16(0), TensorState::kHold);
  const ChunkSchedulerStats before = s.stats();
  void* h = s.access(p16(0), kHost, AccessMode::kWrite, /*wait_for_copy=*/false);
  const Event* fence = s.copy_fence(id);
  ASSERT_NE(fence, nullptr);  // the copy down still runs
  bool landed = false;
  std::thread worker([&] {
    fence->synchronize();
    landed = has_pattern(h, kFull * 2, 31);
  });
  worker.join();
  EXPECT_TRUE(landed);
  EXPECT_EQ(s.copy_fence(id), nullptr);
  EXPECT_EQ(s.stats().copy_waits, before.copy_waits);
  s.release(p16(0), TensorState::kHold);
  // Waiting accesses count their waits and time: the copy up (no compute
  // stream here, so a device access waits on the host too) and the one down.
  write_pattern(s.access(p16(0), kDev), kFull * 2, 32);
  s.release(p16(0), TensorState::kHold);
  EXPECT_TRUE(has_pattern(s.access(p16(0), kHost), kFull * 2, 32));
  s.release(p16(0), TensorState::kHold);
  EXPECT_EQ(s.stats().copy_waits, before.copy_waits + 2);
  EXPECT_GT(s.stats().copy_wait_seconds, before.copy_wait_seconds);
  s.validate();
}

TEST(ChunkScheduler, AComputeStreamWaitsForCopiesInsteadOfTheHost) {
  auto device = make_device(kKiB * kKiB, 1e6);  // 4 KiB take about 4 ms
  auto compute = device->create_stream("compute");
  ChunkSchedulerOptions options = no_prefetch(4 * kChunk);
  options.compute_stream = compute.get();
  ChunkScheduler s(make_store({kFull, kFull}, kChunk), device, options);
  write_pattern(s.access(p16(0), kHost), kFull * 2, 21);
  s.release(p16(0), TensorState::kHold);
  void* d = s.access(p16(0), kDev);
  // Device work runs on `compute`; the host may look once it synchronized.
  compute->synchronize();
  EXPECT_TRUE(has_pattern(d, kFull * 2, 21));
  write_pattern(d, kFull * 2, 22);
  s.release(p16(0), TensorState::kHold);
  // The copy back waits for the compute stream's record at the release.
  EXPECT_TRUE(has_pattern(s.access(p16(0), kHost), kFull * 2, 22));
  s.release(p16(0), TensorState::kHold);
  s.validate();
}

TEST(ChunkScheduler, SetBudgetShrinksByEvictingAndRefusesBelowWhatIsPinned) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store(std::vector<std::size_t>(4, kFull), kChunk), device,
                   no_prefetch(4 * kChunk));
  for (TensorId t = 0; t < 4; ++t) {
    write_pattern(s.access(p16(t), kDev), kFull * 2, 40 + t);
    s.release(p16(t), TensorState::kHold);
  }
  s.set_budget(kDev, 2 * kChunk);
  EXPECT_EQ(s.budget(kDev), 2 * kChunk);
  EXPECT_EQ(s.stats().evictions, 2u);
  EXPECT_LE(s.stats().held_bytes[index_of(kDev)], 2 * kChunk);
  s.access(p16(2), kDev);
  s.access(p16(3), kDev);
  EXPECT_THROW(s.set_budget(kDev, kChunk), OutOfMemoryError);
  EXPECT_EQ(s.budget(kDev), 2 * kChunk) << "a failed shrink keeps the old budget";
  s.release(p16(2), TensorState::kHold);
  s.release(p16(3), TensorState::kHold);
  for (TensorId t = 0; t < 4; ++t) {
    EXPECT_TRUE(has_pattern(s.access(p16(t), kHost), kFull * 2, 40 + t));
    s.release(p16(t), TensorState::kHold);
  }
  EXPECT_THROW(s.set_budget(MemorySpace::kNone, 0), ValueError);
  s.validate();
}

TEST(ChunkScheduler, ALoweringThatFreesWhenNeededLeavesTheCopiesRunningAndTheChunksWithinIt) {
  // Note [Blocks leaving over a lowered budget]. 4 KiB at 10 kB/s: each copy
  // takes about 400 ms, far longer than a lowering that does not wait.
  constexpr std::size_t kDevIndex = index_of(kDev);
  auto fill = [](ChunkScheduler& s) {
    for (TensorId t = 0; t < 4; ++t) {
      write_pattern(s.access(p16(t), kDev), kFull * 2, 50 + t);
      s.release(p16(t), TensorState::kHold);
    }
  };
  auto on_host = [](const ChunkScheduler& s) {
    std::vector<ChunkId> ids;
    for (TensorId t = 0; t < 4; ++t) {
      const ChunkId id = s.store().chunk_of(p16(t));
      if (s.store().chunk(id).space() == kHost) ids.push_back(id);
    }
    return ids;
  };
  // Freeing at once (set_budget's default) waits for the copies down.
  {
    ChunkScheduler s(make_store(std::vector<std::size_t>(4, kFull), kChunk), make_device(kKiB * kKiB, 1e4),
                     no_prefetch(4 * kChunk));
    fill(s);
    s.set_budget(kDev, 2 * kChunk);
    EXPECT_EQ(s.stats().evictions, 2u);
    EXPECT_EQ(s.stats().block_waits, 2u);
    EXPECT_EQ(s.stats().held_bytes[kDevIndex], 2 * kChunk);
    s.validate();
  }
  ChunkScheduler s(make_store(std::vector<std::size_t>(4, kFull), kChunk), make_device(kKiB * kKiB, 1e4),
                   no_prefetch(4 * kChunk));
  fill(s);
  s.set_budget(kDev, 2 * kChunk, BlockFrees::kWhenNeeded);
  // The chunks left; their blocks stay, over the budget, while they are copied out of.
  const std::vector<ChunkId> left = on_host(s);
  ASSERT_EQ(left.size(), 2u);
  for (ChunkId id : left) EXPECT_NE(s.copy_fence(id), nullptr) << "chunk " << id << "'s copy down waited for";
  EXPECT_EQ(s.stats().block_waits, 0u);
  EXPECT_EQ(s.stats().resident_bytes[kDevIndex], 2 * kChunk);
  EXPECT_EQ(s.stats().held_bytes[kDevIndex], 4 * kChunk);
  EXPECT_EQ(s.stats().bytes_left_leaving, 2 * kChunk);
  s.validate();
  // A chunk coming up takes a leaving block only in place of a chunk that
  // leaves: the resident bytes stay within the budget, and nothing waits for
  // a block (the access waits for its own copy: no compute stream here).
  const TensorId back = left[0] == s.store().chunk_of(p16(0)) ? 0 : 1;
  EXPECT_TRUE(has_pattern(s.access(p16(back), kDev), kFull * 2, 50 + back));
  s.release(p16(back), TensorState::kHold);
  EXPECT_EQ(s.stats().evictions, 3u);
  EXPECT_EQ(s.stats().resident_bytes[kDevIndex], 2 * kChunk);
  EXPECT_EQ(s.stats().held_bytes[kDevIndex], 4 * kChunk);
  EXPECT_EQ(s.stats().block_waits, 0u);
  s.validate();
  // Whoever needs the room frees the leaving blocks, one at a time, until
  // the held bytes are within the budget.
  EXPECT_TRUE(s.free_leaving_block(kDev));
  EXPECT_EQ(s.stats().held_bytes[kDevIndex], 3 * kChunk);
  EXPECT_TRUE(s.free_leaving_block(kDev));
  EXPECT_EQ(s.stats().held_bytes[kDevIndex], 2 * kChunk);
  EXPECT_FALSE(s.free_leaving_block(kDev));
  for (TensorId t = 0; t < 4; ++t) {
    EXPECT_TRUE(has_pattern(s.access(p16(t), kHost), kFull * 2, 50 + t));
    s.release(p16(t), TensorState::kHold);
  }
  s.validate();
}

TEST(ChunkScheduler, TraceIsAdoptedFollowedAndReplacedWhenTheStepChanges) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({kFull, kFull, kFull}, kChunk), device, no_prefetch(8 * kChunk));
  auto step = [&](std::vector<TensorId> order) {
    for (TensorId t : order) {
      s.access(p16(t), kDev);
      s.release(p16(t), TensorState::kHold);
    }
    const bool followed = s.following_trace();
    s.end_step();
    s.validate();
    return followed;
  };
  EXPECT_FALSE(step({0, 1, 2}));  // recorded
  EXPECT_EQ(s.stats().trace_adoptions, 1u);
  ASSERT_EQ(s.trace().size(), 3u);
  EXPECT_EQ(s.trace().entries()[1], (TraceEntry{make_chunk_id(ChunkKind::kParam16, 1), kDev}));
  EXPECT_TRUE(step({0, 1, 2}));  // followed to the end
  EXPECT_EQ(s.stats().trace_divergences, 0u);
  EXPECT_EQ(s.stats().trace_adoptions, 1u);
  EXPECT_FALSE(step({0, 2, 1}));  // departs at moment 1
  EXPECT_EQ(s.stats().trace_divergences, 1u);
  EXPECT_EQ(s.stats().trace_adoptions, 2u);
  EXPECT_EQ(s.trace().entries()[1].chunk, make_chunk_id(ChunkKind::kParam16, 2));
  EXPECT_TRUE(step({0, 2, 1}));
  step({0, 2});  // ends early: a departure too
  EXPECT_EQ(s.stats().trace_divergences, 2u);
  EXPECT_EQ(s.trace().size(), 2u);
  EXPECT_EQ(s.stats().steps, 5u);
}

TEST(ChunkScheduler, WithoutTraceNothingIsRecorded) {
  auto device = make_device(kKiB * kKiB);
  ChunkSchedulerOptions options = no_prefetch(8 * kChunk);
  options.use_trace = false;
  ChunkScheduler s(make_store({kFull, kFull}, kChunk), device, options);
  for (int step = 0; step < 2; ++step) {
    for (TensorId t : {0u, 1u}) {
      s.access(p16(t), kDev);
      s.release(p16(t), TensorState::kHold);
    }
    s.end_step();
  }
  EXPECT_TRUE(s.trace().empty());
  EXPECT_EQ(s.stats().trace_adoptions, 0u);
  s.validate();
}

TEST(ChunkScheduler, TensorsRegisteredWhileRunningGetChunks) {
  auto device = make_device(kKiB * kKiB);
  ChunkScheduler s(make_store({1000}, kChunk), device, no_prefetch(8 * kChunk));
  write_pattern(s.access(p16(0), kDev), 2000, 9);
  const TensorId late = s.register_tensor("late", 1000);  // joins the open chunk
  const TensorId later = s.register_tensor("later", kFull);  // a new chunk
  EXPECT_TRUE(s.take_warnings().empty());
  std::vector<std::string> warnings;
  s.set_warning_handler([&](const std::string& message) { warnings.push_back(message); });
  s.register_tensor("huge", 3 * kFull);
  ASSERT_EQ(warnings.size(), 1u);
  EXPECT_NE(warnings[0].find("'huge'"), std::string::npos) << warnings[0];
  EXPECT_EQ(s.store().placement(late).chunk, 0u);
  EXPECT_EQ(s.store().placement(later).chunk, 1u);
  write_pattern(s.access(p16(late), kDev), 2000, 10);
  write_pattern(s.access({ChunkKind::kVariance, later}, kHost), kFull * 4, 11);
  s.release(p16(0), TensorState::kHold);
  s.release(p16(late), TensorState::kHold);
  s.release({ChunkKind::kVariance, later}, TensorState::kHold);
  EXPECT_TRUE(has_pattern(s.access(p16(late), kHost), 2000, 10));
  EXPECT_TRUE(has_pattern(s.store().tensor_data(p16(0)), 2000, 9));
  s.release(p16(late), TensorState::kHold);
  s.validate();
}

TEST(ChunkScheduler, MemoryReturnsToBaselineWhenTheSchedulerGoes) {
  auto device = make_device(kKiB * kKiB, 50e6);
  const HostMemoryStats host_before = host_memory_stats();
  {
    ChunkSchedulerOptions options;
    options.device_budget_bytes = 2 * kChunk;
    ChunkScheduler s(make_store(std::vector<std::size_t>(5, kFull), kChunk), device, options);
    for (int step = 0; step < 3; ++step) {
      for (TensorId t = 0; t < 5; ++t) {
        s.access(p16(t), kDev);
        s.release(p16(t), TensorState::kHold);
      }
      s.end_step();
    }
    EXPECT_GT(device->memory_stats().in_use_bytes, 0u);
    EXPECT_GT(host_memory_stats().allocated_bytes, host_before.allocated_bytes);
    // Goes with prefetches still in flight.
  }
  EXPECT_EQ(device->memory_stats().in_use_bytes, 0u);
  EXPECT_EQ(device->memory_stats().live_allocations, 0u);
  EXPECT_EQ(host_memory_stats().allocated_bytes, host_before.allocated_bytes);
  EXPECT_EQ(host_memory_stats().live_buffers, host_before.live_buffers);
}

TEST(ChunkScheduler, RejectsAStoreThatAlreadyHasPayloads) {
  ChunkStore store({.chunk_bytes = kChunk});
  store.register_tensor("w", 10);
  std::vector<unsigned char> bytes(kChunk);
  store.set_payload(0, bytes.data(), kHost);
  EXPECT_THROW(ChunkScheduler(std::move(store), make_device(kKiB * kKiB)), ValueError);
  EXPECT_THROW(ChunkScheduler(ChunkStore{}, nullptr), ValueError);
}

}  // namespace
}  // namespace tidal
