// A file of fixed-size slots on a disk, read and written with direct,
// asynchronous I/O: the storage under the third memory space (chunks on NVMe,
// issue 44). libtorch-free; the engine's use of it comes later.
//
// Note [Chunks on NVMe: the file]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk is a large, aligned, fixed-size block, which is what direct I/O
// wants: each slot of the file holds one, at an offset that is a multiple of
// the slot size (rounded up to 4 KiB). A read or write of a slot is split into
// requests of `request_bytes` (1 MiB, as DeepSpeed's aio handle uses), up to
// `threads` in flight at a time (on a drive, queue depth is what reaches its
// rate), issued on an O_DIRECT descriptor by one of two backends:
// * threads: a pool of `threads` threads, each issuing pread/pwrite, which
//   needs no kernel interface beyond POSIX;
// * io_uring (built where liburing is found, TIDAL_WITH_IO_URING): the
//   submitting thread queues the requests on a ring of `threads` entries and
//   one reaper thread takes the completions, resubmitting the rest of a short
//   transfer and feeding the ring from the queue; no thread per request
//   (whether that saves CPU depends on the drive and the request size:
//   benchmarks/nvme_bandwidth.py measures both, with their CPU time).
// kAuto takes io_uring where it is built and the kernel gives a ring
// (containers may forbid it), the threads otherwise; backend() says which.
// Submission returns at once with a ticket; wait() returns when every
// request of it has completed, or throws the first failure, naming the path,
// the slot, the bytes, errno's text and the bytes free on the file system.
//
// The file is made whole at creation (posix_fallocate of slots x slot
// bytes): a disk too small fails there, before anything trains, naming the
// bytes needed and free. It is named tidal-<pid>-<n>.slots and held with an
// exclusive flock for its life; the destructor closes and removes it, and an
// atexit handler removes the files of DirectFiles still alive at exit(). Files
// of a process that was killed are found by create() in the same folder (a
// tidal-*.slots file whose lock can be taken: its owner is gone), removed,
// and reported in removed_stale(). A file system without O_DIRECT (tmpfs)
// is refused unless `allow_buffered` is set, and then direct() is false (the
// caller warns: the page cache then holds a second copy of every slot).
//
// The first failure of any request is kept (failure()), whoever waits for its
// ticket or not: a write is waited for only when its block is next used, so
// the chunk scheduler asks failed() to learn of a failure at once (Note
// [Chunks on NVMe: after a failure] in disk_tier.h).
//
// Tests break the disk on purpose with fail_nth(): the nth read or write
// submitted from then on fails its first request with the errno given, with
// the message a real failure has; nothing reaches the file for it.
//
// Buffers given to read/write must be aligned to kDirectAlignment and
// their byte count a multiple of it (O_DIRECT's rule); AlignedBuffer makes
// such buffers. The caller keeps a buffer alive and untouched until its
// ticket is waited for.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace tidal {

constexpr std::size_t kDirectAlignment = 4096;

// A heap buffer aligned for direct I/O (not pinned; the device layer pins).
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  explicit AlignedBuffer(std::size_t bytes);
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  void* data() const { return data_; }
  std::size_t size() const { return size_; }

 private:
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

enum class DirectIoBackend { kAuto, kThreads, kIoUring };

// "auto", "threads", "io_uring"; ValueError naming them otherwise.
DirectIoBackend parse_direct_io_backend(const std::string& name);
// Whether this build has the io_uring backend.
bool io_uring_built();

struct DirectFileOptions {
  std::string dir;               // the folder (nvme_path)
  std::size_t slot_bytes = 0;    // bytes per slot (a chunk's), rounded up to 4 KiB
  std::size_t slots = 0;         // slots in the file at creation (grow() adds more)
  std::size_t request_bytes = std::size_t{1} << 20;  // one pread/pwrite
  int threads = 8;               // requests in flight at most
  bool allow_buffered = false;   // tmpfs/ramfs, or no O_DIRECT: go on (buffered I/O) instead of an error
  DirectIoBackend backend = DirectIoBackend::kThreads;  // kIoUring: an error where it cannot run
};

class DirectFile {
 public:
  using Ticket = std::uint64_t;

  explicit DirectFile(const DirectFileOptions& options);
  ~DirectFile();
  DirectFile(const DirectFile&) = delete;
  DirectFile& operator=(const DirectFile&) = delete;

  // Writes `bytes` from `src` from the start of `slot` on (into the slots
  // after it when `bytes` is more than a slot); returns at once.
  Ticket write(std::size_t slot, const void* src, std::size_t bytes);
  // Reads `bytes` from the start of `slot` on into `dst`; returns at once.
  Ticket read(std::size_t slot, void* dst, std::size_t bytes);
  // Returns when the ticket's requests are done; throws the first failure.
  void wait(Ticket ticket);
  // Whether every request of the ticket has completed (wait() then returns
  // at once); never blocks.
  bool done(Ticket ticket) const;
  // Makes the file `slots` slots long (posix_fallocate), so a write there
  // cannot fail for want of space; throws naming the path, the bytes needed
  // and the bytes free when the file system cannot hold them. Never shrinks.
  void grow(std::size_t slots);
  // Waits for every ticket not yet waited for (their failures are thrown too).
  void wait_all();
  // Whether a request has failed since creation; never blocks.
  bool failed() const { return failed_.load(std::memory_order_acquire); }
  // The message of the first failed request, or "" when none failed.
  std::string failure() const;
  // Fault injection for tests: the `nth` (1 = the next) write (`write`) or
  // read submitted from now on fails its first request with `err` (EIO, ENOSPC,
  // ...). One fault per direction is armed at a time; nth 0 disarms it.
  void fail_nth(bool write, std::uint64_t nth, int err);

  const std::string& path() const { return path_; }
  std::size_t slot_bytes() const { return slot_bytes_; }
  std::size_t slots() const { return slots_; }
  bool direct() const { return direct_; }
  // The folder is on tmpfs or ramfs (allowed only with allow_buffered).
  bool memory_backed() const { return memory_backed_; }
  // "threads" or "io_uring": the backend issuing the requests.
  const char* backend() const { return ring_ ? "io_uring" : "threads"; }
  // Files of killed processes this one removed at creation.
  const std::vector<std::string>& removed_stale() const { return removed_stale_; }
  // Bytes read and written since creation (completed requests).
  std::uint64_t bytes_read() const;
  std::uint64_t bytes_written() const;

  // Free bytes of the file system holding `dir` (statvfs), for messages and budgets.
  static std::uint64_t free_bytes(const std::string& dir);

 private:
  struct Request {
    Ticket ticket;
    bool write;
    std::size_t offset;
    char* buffer;
    std::size_t bytes;
    std::size_t slot;
    int fail_errno;  // fail_nth: fail with this errno instead of reaching the file
  };
  struct Pending {
    std::size_t left = 0;
    std::string error;  // the first failure
  };

  struct Ring;  // io_uring's state (direct_file.cpp)
  Ticket submit(bool write, std::size_t slot, char* buffer, std::size_t bytes);
  void worker();
  // io_uring: moves queued requests onto the ring while it has room; mutex_ held.
  void pump_locked();
  void reaper();
  // A request finished (`done` bytes of it, `error` empty or the failure); mutex_ held.
  void finish_locked(const Request& r, std::size_t done, std::string error);
  bool start_ring(unsigned depth, bool required);
  std::string describe_failure(const Request& r, int err, long done) const;
  void reserve_to(std::size_t slots, const std::string& dir);

  std::string path_;
  std::size_t slot_bytes_ = 0;
  std::size_t slots_ = 0;
  std::size_t request_bytes_ = 0;
  int fd_ = -1;
  bool direct_ = true;
  bool memory_backed_ = false;
  static constexpr long kTmpfsMagic = 0x01021994;
  static constexpr long kRamfsMagic = 0x858458f6;
  std::vector<std::string> removed_stale_;

  mutable std::mutex mutex_;
  std::condition_variable work_;
  std::condition_variable done_;
  std::deque<Request> queue_;
  std::unordered_map<Ticket, Pending> pending_;
  Ticket next_ticket_ = 1;
  bool stopping_ = false;
  std::uint64_t bytes_read_ = 0;
  std::uint64_t bytes_written_ = 0;
  std::string first_failure_;
  std::atomic<bool> failed_{false};
  std::uint64_t submitted_[2] = {0, 0};   // tickets by direction (0 read, 1 write)
  std::uint64_t fail_at_[2] = {0, 0};     // fail_nth: the ticket number to fail, 0 none
  int fail_errno_[2] = {0, 0};
  std::vector<std::thread> threads_;
  std::unique_ptr<Ring> ring_;
};

}  // namespace tidal
