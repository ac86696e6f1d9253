// Payload memory of the chunk scheduler: host and device blocks, each with a
// fence event, and a cache of free blocks by size. Internal to the
// scheduler. See Note [Block fences].
//
// Note [Block fences]
// ~~~~~~~~~~~~~~~~~~~
// Every block owns one event, its fence, that completes when all
// asynchronous work issued on the block so far has run. Whoever issues work
// on a block first makes that work wait for the fence (Stream::wait, or the
// host blocks on it), then re-records the fence after the work. Because each
// new piece of work waits for the previous fence, the latest record implies
// all earlier ones, so one event per block is enough however many streams
// touch it (the copy streams, the compute stream). A block therefore goes
// back to the cache at once when its chunk moves away; the next user waits
// for its fence, and a block is only freed (returned to the device or the
// host allocator) after its fence completed.
//
// Why a cache: freeing a block first waits on the host for its fence (the
// memory may go to anyone once freed), while reusing one makes only the next
// work wait for it, on its stream. A new block also costs its backend's
// allocation: pinning a host block costs milliseconds per 64 MiB, and a
// device block comes from the device's memory provider (the engine's on a
// GPU is torch's caching allocator; without one, cudaMalloc, which
// synchronizes the device; runtime/device/device.h). So chunk moves reuse
// blocks of the same size (chunks are fixed-size, so nearly all blocks are).
// Cached blocks count against the budget of their memory space; the
// scheduler frees them before it evicts a chunk.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <vector>

#include "chunk/memory_space.h"
#include "runtime/device/device.h"
#include "runtime/memory/host_buffer.h"

namespace tidal {

// A disk read into or write out of a block still in flight (Note [Chunks on
// NVMe: the tier] in disk_tier.h). wait() rethrows a failure every time.
class PendingIo {
 public:
  virtual ~PendingIo() = default;
  virtual bool done() = 0;
  virtual void wait() = 0;
};

struct Block {
  MemorySpace space = MemorySpace::kNone;
  std::size_t bytes = 0;
  void* data = nullptr;
  HostBuffer host;      // set when space == kHost
  DeviceBuffer device;  // set when space == kDevice
  std::unique_ptr<Event> fence;
  // The fence may still be pending (it was recorded since it was last seen
  // complete). Lets the hot path skip event queries.
  bool maybe_pending = false;
  // The stream of the fence's latest record, or null.
  Stream* fenced_on = nullptr;
  // A host block's disk I/O in flight: one more piece of work on the block,
  // waited for on the host before any other (a stream cannot wait for it).
  std::shared_ptr<PendingIo> io;
  // A cached host block a chunk was copied up from: it still holds that
  // chunk's bytes as of the chunk's write count `image_version` (Note [A
  // clean chunk goes down without a copy] in chunk_scheduler.h); -1: none.
  std::int64_t image_of = -1;
  std::uint64_t image_version = 0;

  // Waits for the disk I/O; keeps it (and rethrows) when it failed.
  bool finish_io() {
    if (!io) return false;
    const bool pending = !io->done();
    io->wait();
    io.reset();
    return pending;
  }

  // Records the fence on `stream` after work issued there.
  void record_fence(Stream& stream) {
    fence->record(stream);
    maybe_pending = true;
    fenced_on = &stream;
  }
  // Makes work issued next on `stream` wait for the fence.
  void order_before(Stream& stream) {
    finish_io();
    if (maybe_pending && fenced_on != &stream) stream.wait(*fence);
  }
  // Blocks the calling thread until the fence completed. Returns whether it
  // had to wait.
  bool wait_on_host() {
    const bool io_pending = finish_io();
    if (!maybe_pending) return io_pending;
    const bool pending = !fence->query();
    if (pending) fence->synchronize();
    maybe_pending = false;
    fenced_on = nullptr;
    return pending || io_pending;
  }
  bool ready() const { return (!io || io->done()) && (!maybe_pending || fence->query()); }
};

using BlockPtr = std::unique_ptr<Block>;

class BlockPool {
 public:
  BlockPool(std::shared_ptr<Device> device, bool pin_host);
  ~BlockPool();
  BlockPool(const BlockPool&) = delete;
  BlockPool& operator=(const BlockPool&) = delete;

  // A cached block of exactly `bytes` in `space`, or null: the newest whose
  // copies are done, else the oldest (Note [A cached block whose copy is
  // done] in block_pool.cpp). On the host, of those, one holding no wanted
  // image (set_image_wanted) first; then a pinned one first when `pinned`,
  // else one not pinned first, so the pinned blocks stay with the chunks
  // that cross again and again (Note [Pinned at the second crossing] in
  // chunk_scheduler.h). A block handed out holds no chunk's image any more.
  BlockPtr take_cached(MemorySpace space, std::size_t bytes, bool pinned = false);
  // Which images someone may still take back (take_image): an image of
  // chunk `chunk` as of write count `version` for which this returns false
  // is handed out and freed as a block holding none. Unset: every image is
  // wanted. See Note [Images someone still wants] in chunk_scheduler.cpp.
  void set_image_wanted(std::function<bool(std::int64_t chunk, std::uint64_t version)> wanted) {
    image_wanted_ = std::move(wanted);
  }
  // The cached host block of `bytes` that holds chunk `chunk`'s bytes as of
  // write count `version` (Block::image_of), taken out of the cache; null if
  // none is cached.
  BlockPtr take_image(std::size_t bytes, std::int64_t chunk, std::uint64_t version);
  // Whether take_image(bytes, chunk, version) would find one.
  bool has_image(std::size_t bytes, std::int64_t chunk, std::uint64_t version) const;
  bool has_cached(MemorySpace space, std::size_t bytes) const;
  // Whether a cached block of `bytes` in `space` holds no wanted image.
  bool has_cached_without_wanted_image(MemorySpace space, std::size_t bytes) const;
  // A new block. Throws OutOfMemoryError when the space has no memory left.
  // A host block is made pageable (Note [Pinned at the second crossing]).
  BlockPtr allocate(MemorySpace space, std::size_t bytes);
  // A copy over the link through `host_block` follows: pins the block when
  // `pin` and pin_host are on and it is not pinned yet. Returns whether it
  // pinned now.
  bool prepare_crossing(Block& host_block, bool pin);
  // Puts a block no chunk uses any more into the cache.
  void give_back(BlockPtr block);
  // Frees one cached block of `space`: the largest whose fence has
  // completed (one holding no wanted image first), else the oldest of the
  // largest size after waiting for its fence (counted in trim_waits()).
  // Returns false when the cache of that space is empty.
  bool trim_one(MemorySpace space);
  // The same without the wait: false when no cached block's fence has
  // completed.
  bool trim_one_ready(MemorySpace space);
  void trim_all(MemorySpace space);
  // Frees cached blocks of `space` whose fences have completed (largest
  // first) until at most `keep_blocks` stay cached; never waits, so blocks
  // still being copied from stay for a later call; blocks holding a wanted
  // image go after the others. Returns the number freed.
  // Only blocks beyond what `keep_by_size` keeps of their size go (a size it
  // does not name keeps none).
  std::size_t trim_ready(MemorySpace space, std::size_t keep_blocks,
                         const std::map<std::size_t, std::size_t>& keep_by_size = {});

  // Bytes of all live blocks of `space` (in use by chunks + cached).
  std::size_t held_bytes(MemorySpace space) const { return held_[index_of(space)]; }
  std::size_t cached_bytes(MemorySpace space) const { return cached_[index_of(space)]; }
  std::size_t cached_blocks(MemorySpace space) const { return cached_count_[index_of(space)]; }
  // Blocks allocated in `space` so far, and their bytes.
  std::uint64_t allocations(MemorySpace space) const { return allocations_[index_of(space)]; }
  std::uint64_t allocated_bytes(MemorySpace space) const { return allocated_bytes_[index_of(space)]; }
  // Blocks of `space` handed out: allocated, or taken from the cache.
  std::uint64_t handed_out(MemorySpace space) const {
    return allocations_[index_of(space)] + reuses_[index_of(space)];
  }
  // The same, by block size.
  const std::map<std::size_t, std::uint64_t>& handed_out_by_size(MemorySpace space) const {
    return handed_by_size_[index_of(space)];
  }
  // trim_one calls that blocked the calling thread on a copy still running,
  // and the seconds they blocked it.
  std::uint64_t trim_waits() const { return trim_waits_; }
  double trim_wait_seconds() const { return trim_wait_seconds_; }

  // InternalError unless the cache's byte counts add up.
  void validate() const;

 private:
  // Takes block `i` of the cache bucket `it` of `space` out, for a new user.
  BlockPtr take_at(MemorySpace space, std::map<std::size_t, std::vector<BlockPtr>>::iterator it,
                   std::size_t i);
  // Whether `block` holds an image someone may still take back.
  bool holds_wanted_image(const Block& block) const {
    return block.image_of >= 0 && (!image_wanted_ || image_wanted_(block.image_of, block.image_version));
  }
  // The order trim_one_ready and trim_ready free blocks in, kTrimPasses
  // passes: not pinned before pinned (Note [Pinned at the second crossing]
  // in chunk_scheduler.h), and of each, those holding no wanted image first.
  static constexpr int kTrimPasses = 4;
  bool trimmed_in_pass(const Block& block, int pass) const {
    return block.host.registered() == (pass >= 2) && holds_wanted_image(block) == (pass % 2 == 1);
  }
  // The byte counts of a block just taken out of the cache to be freed.
  void forget_cached(const Block& block);

  std::shared_ptr<Device> device_;
  bool pin_host_;
  std::function<bool(std::int64_t, std::uint64_t)> image_wanted_;
  std::array<std::map<std::size_t, std::vector<BlockPtr>>, kNumMemorySpaces> cache_;
  std::array<std::size_t, kNumMemorySpaces> held_{};
  std::array<std::size_t, kNumMemorySpaces> cached_{};
  std::array<std::size_t, kNumMemorySpaces> cached_count_{};
  std::array<std::uint64_t, kNumMemorySpaces> allocations_{};
  std::array<std::uint64_t, kNumMemorySpaces> allocated_bytes_{};
  std::array<std::uint64_t, kNumMemorySpaces> reuses_{};
  std::array<std::map<std::size_t, std::uint64_t>, kNumMemorySpaces> handed_by_size_;
  std::uint64_t trim_waits_ = 0;
  double trim_wait_seconds_ = 0;
};

}  // namespace tidal
