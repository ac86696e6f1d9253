// The third memory space: chunks in a file on a disk (NVMe), below the host.
// Internal to the chunk scheduler, which decides what goes there; this type
// keeps where each chunk lives in the file and issues the I/O.
//
// Note [Chunks on NVMe: the tier]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// With a disk tier, a full host budget no longer ends training: when the
// host needs room and no host chunk can go up to the device (Note [One place
// per chunk] in chunk_scheduler.h), the scheduler writes a host chunk to the
// disk, chosen by the eviction policy (OPT from the trace: the chunk used
// last) among the lists allowed there (ChunkSchedulerOptions::disk_kinds:
// the fp32 master and Adam's moments by default, as DeepSpeed's
// offload_optimizer "nvme"; the 16-bit parameters too with offload_param).
// A chunk on disk is read back into a host block when it is accessed; one
// wanted on the device goes up through the host. Nothing computes on a disk
// chunk: its store payload is a token (a distinct address, never read).
//
// Each chunk gets a home in the file, as many 4 KiB pages as its capacity,
// and keeps it: a chunk never changes size, so the file is never fragmented.
// The engine gives every chunk of the allowed lists its home at start
// (ChunkScheduler::reserve_disk); a chunk registered later gets one at its
// first write. The file grows with posix_fallocate before any write, so a
// full disk fails there, before any chunk leaves the host, naming the path,
// the bytes needed and the bytes free; the NVMe budget bounds the homes in
// the same way.
//
// Writes are write-behind and reads can be issued ahead: a write leaves the
// chunk's host block in the pool with its I/O attached (Block::io), and
// whoever takes the block next waits for it (Note [Block fences] in
// block_pool.h: the I/O is one more piece of work on the block); a read is
// issued into a host block and the access that needs the chunk waits for it.
// The trace's prefetch issues reads of disk chunks ahead of their use (into
// host room made by writing chunks used later to disk), so CPU Adam sweeping
// chunks on disk finds the next ones read while it updates this one, and
// their writes run while it updates the next. A read of a chunk whose write
// is still in flight waits for the write first.
//
// Note [Chunks on NVMe: after a failure]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A read or write that fails (EIO, a drive gone) loses data tidal cannot get
// back: a failed read leaves a host block of unknown bytes, a failed write a
// home of unknown bytes whose host copy is already the pool's, and the step it
// happened in may have updated other chunks since. So the tier does not
// retry and does not go on: the file keeps its first failure (DirectFile::
// failure(), recorded when the request completes, whether or not anyone waits
// for it), and from then on the scheduler refuses every access with it
// (ChunkScheduler::check_disk), the engine every forward, backward and step.
// Recovery is a restart from the last checkpoint. What must hold meanwhile:
// the scheduler's state stays whole (validate() passes after any failure),
// so the error the user sees is the disk's, never an InternalError, and the
// engine can still be torn down, removing its file. The failure surfaces
// where a block with failed I/O is waited for (Block::finish_io), and every
// such wait comes before the operation changes anything (move() finishes
// both blocks' I/O before it detaches the chunk; a read that fails at issue
// gives its block back). A prefetch does not read or write a failed tier.
//
// Note [Chunks on NVMe: clean chunks]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk read from disk and not changed since still has its bytes in its
// home, so when it goes back to disk nothing is written: its host block goes
// back to the pool as for any move. With offload_param the 16-bit chunks are
// read in forward, which only reads them, and would otherwise be written
// back unchanged; backward (gradients land in the same slots) and the step
// (new 16-bit weights) change them. The scheduler keeps, per chunk, whether
// its home holds its payload's bytes (Slot::disk_current): set when the
// chunk is read from disk or written there, cleared by everything that may
// change its bytes: an access in AccessMode::kWrite (the default, so a caller
// that says nothing writes), an access of a FREE slot (its user fills it),
// mark_written() (a write the caller learnt of after a read access), and a
// payload dropped or made afresh. It fails closed: the only read accesses
// are those whose callers know they read (the hooks' attach of a module's
// parameters in forward and backward, and of an fp32 master that makes a
// weight), and those callers mark the chunk written when their reader wrote
// after all: a parameter whose version counter moved while attached, a
// gradient landing in an attached parameter, the engine writing a value
// through an attached parameter (hooks/module_hooks.cpp, Note [Writes to a
// parameter]). A flag set is only ever trusted for a chunk that still has
// its home, and moves between host and device copy the bytes exactly, so
// they keep it. ChunkSchedulerOptions::disk_skip_clean_writes turns the skip
// off (every chunk is written, as before), to measure what it saves.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <string>
#include <vector>

#include "chunk/chunk_id.h"
#include "runtime/memory/direct_file.h"
#include "runtime/scheduler/block_pool.h"

namespace tidal {

struct DiskTierOptions {
  std::string dir;                                  // nvme_path: an existing folder on the disk
  std::size_t budget_bytes = 0;                     // 0: the file system's free space less 10%
  int threads = 8;                                  // I/O requests in flight
  std::size_t request_bytes = std::size_t{1} << 20; // bytes per pread/pwrite
  bool allow_buffered = false;                      // a folder without O_DIRECT (tmpfs): buffered I/O
  DirectIoBackend backend = DirectIoBackend::kThreads;  // see Note [Chunks on NVMe: the file]
};

class DiskTier {
 public:
  explicit DiskTier(const DiskTierOptions& options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  // Gives chunk `id` (of `bytes`) its home if it has none: grows the file.
  // Throws OutOfMemoryError naming the path, the bytes needed, the budget
  // and the bytes free when the budget or the file system cannot hold it;
  // nothing changes then. `what` describes the chunk for the message.
  void ensure_home(ChunkId id, std::size_t bytes, const std::string& what);
  // Writes `bytes` from `src` (aligned to kDirectAlignment, whole pages
  // readable) to the home of `id` (ensure_home first); returns at once.
  std::shared_ptr<PendingIo> write(ChunkId id, const void* src, std::size_t bytes);
  // Reads the home of `id` into `dst`; returns at once. Waits for a write
  // of `id` still in flight first.
  std::shared_ptr<PendingIo> read(ChunkId id, void* dst, std::size_t bytes);
  // The store payload of a chunk on disk: a distinct, stable address.
  void* token(ChunkId id);

  bool has_home(ChunkId id) const { return id < homes_.size() && homes_[id].assigned; }
  // Bytes of the home of a chunk of `capacity_bytes` (whole pages).
  static std::size_t home_bytes(std::size_t capacity_bytes) {
    return (capacity_bytes + kDirectAlignment - 1) / kDirectAlignment * kDirectAlignment;
  }
  const std::string& dir() const { return dir_; }
  // Bytes of all homes (the file's size).
  std::size_t held_bytes() const { return pages_ * kDirectAlignment; }
  std::size_t budget_bytes() const { return budget_; }
  const std::string& path() const { return file_->path(); }
  bool direct() const { return file_->direct(); }
  bool memory_backed() const { return file_->memory_backed(); }
  const char* backend() const { return file_->backend(); }
  const std::vector<std::string>& removed_stale() const { return file_->removed_stale(); }
  std::uint64_t bytes_read() const { return file_->bytes_read(); }
  std::uint64_t bytes_written() const { return file_->bytes_written(); }
  // Note [Chunks on NVMe: after a failure]: whether an I/O request failed, and
  // the first failure's message (path, offset, bytes, errno's text).
  bool failed() const { return file_->failed(); }
  std::string failure() const { return file_->failure(); }
  // Fault injection for tests (DirectFile::fail_nth): the nth read or write
  // from now fails with `err`.
  void fail_nth(bool write, std::uint64_t nth, int err) { file_->fail_nth(write, nth, err); }

 private:
  struct Home {
    std::size_t page = 0;
    std::size_t pages = 0;
    bool assigned = false;
  };
  std::shared_ptr<DirectFile> file_;
  std::string dir_;
  std::size_t budget_ = 0;
  std::size_t pages_ = 0;                                 // pages of homes given
  std::vector<Home> homes_;                               // by ChunkId
  std::vector<std::shared_ptr<PendingIo>> last_write_;    // by ChunkId
  std::deque<char> tokens_;                               // by ChunkId; a deque keeps addresses
};

}  // namespace tidal
