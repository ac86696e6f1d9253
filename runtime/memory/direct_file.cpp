#include "runtime/memory/direct_file.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <regex>
#include <set>
#include <utility>

#include "runtime/core/error.h"

#if defined(TIDAL_WITH_IO_URING)
#include <liburing.h>
#endif

namespace tidal {

#if defined(TIDAL_WITH_IO_URING)
struct DirectFile::Ring {
  io_uring ring{};
  unsigned depth = 0;
  unsigned in_flight = 0;
  bool stop_sent = false;
};
#else
struct DirectFile::Ring {
  unsigned depth = 0;
  unsigned in_flight = 0;
};
#endif

bool io_uring_built() {
#if defined(TIDAL_WITH_IO_URING)
  return true;
#else
  return false;
#endif
}

DirectIoBackend parse_direct_io_backend(const std::string& name) {
  if (name == "auto") return DirectIoBackend::kAuto;
  if (name == "threads") return DirectIoBackend::kThreads;
  if (name == "io_uring") return DirectIoBackend::kIoUring;
  TIDAL_THROW(ValueError, "NVMe I/O backend '", name, "': expected 'auto', 'threads' or 'io_uring'");
}

namespace {

std::size_t round_up(std::size_t bytes, std::size_t to) { return (bytes + to - 1) / to * to; }

std::string errno_text(int err) { return std::string(std::strerror(err)); }

std::atomic<unsigned> file_counter{0};

// Note [Chunks on NVMe: the file]: the files of live DirectFiles, removed at
// exit() even where a DirectFile is never destroyed (a Python object alive at
// interpreter exit). Leaked on purpose: it must outlive every static.
struct LiveFiles {
  std::mutex mutex;
  std::set<std::string> paths;
};
LiveFiles& live_files() {
  static LiveFiles* files = new LiveFiles;
  return *files;
}
void remove_live_files_at_exit() {
  LiveFiles& f = live_files();
  std::lock_guard<std::mutex> lock(f.mutex);
  for (const std::string& path : f.paths) ::unlink(path.c_str());
  f.paths.clear();
}
void register_live_file(const std::string& path) {
  static const bool registered = [] {
    std::atexit(remove_live_files_at_exit);
    return true;
  }();
  (void)registered;
  LiveFiles& f = live_files();
  std::lock_guard<std::mutex> lock(f.mutex);
  f.paths.insert(path);
}
void forget_live_file(const std::string& path) {
  LiveFiles& f = live_files();
  std::lock_guard<std::mutex> lock(f.mutex);
  f.paths.erase(path);
}

// Note [Chunks on NVMe: the file]: a tidal-*.slots file whose lock can be
// taken belongs to a process that is gone.
std::vector<std::string> remove_stale(const std::string& dir) {
  std::vector<std::string> removed;
  DIR* d = ::opendir(dir.c_str());
  if (d == nullptr) return removed;
  static const std::regex name(R"(tidal-[0-9]+-[0-9]+\.slots)");
  while (dirent* e = ::readdir(d)) {
    if (!std::regex_match(e->d_name, name)) continue;
    const std::string path = dir + "/" + e->d_name;
    const int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) continue;
    if (::flock(fd, LOCK_EX | LOCK_NB) == 0) {
      if (::unlink(path.c_str()) == 0) removed.push_back(path);
    }
    ::close(fd);
  }
  ::closedir(d);
  return removed;
}

}  // namespace

AlignedBuffer::AlignedBuffer(std::size_t bytes) : size_(round_up(bytes, kDirectAlignment)) {
  if (size_ == 0) return;
  data_ = std::aligned_alloc(kDirectAlignment, size_);
  TIDAL_CHECK_WITH(OutOfMemoryError, data_ != nullptr, "AlignedBuffer: could not allocate ",
                   format_bytes(size_), " of host memory aligned to ", kDirectAlignment, " bytes");
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)), size_(std::exchange(other.size_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

std::uint64_t DirectFile::free_bytes(const std::string& dir) {
  struct statvfs s {};
  if (::statvfs(dir.c_str(), &s) != 0) return 0;
  return static_cast<std::uint64_t>(s.f_bavail) * s.f_frsize;
}

DirectFile::DirectFile(const DirectFileOptions& options)
    : slot_bytes_(round_up(options.slot_bytes, kDirectAlignment)),
      slots_(options.slots),
      request_bytes_(round_up(options.request_bytes, kDirectAlignment)) {
  TIDAL_CHECK(options.slot_bytes > 0, "DirectFile: expected slot_bytes > 0, got 0");
  TIDAL_CHECK(options.threads >= 1 && options.threads <= 1024, "DirectFile: expected 1 to 1024 threads, got ",
              options.threads);
  TIDAL_CHECK(options.request_bytes > 0, "DirectFile: expected request_bytes > 0, got 0");
  struct stat st {};
  TIDAL_CHECK(!options.dir.empty() && ::stat(options.dir.c_str(), &st) == 0 && S_ISDIR(st.st_mode),
              "DirectFile: the folder '", options.dir, "' does not exist or is not a folder (nvme_path must "
              "name an existing folder on the disk to use)");
  // A RAM-backed file system (tmpfs, ramfs) holds its files in host memory:
  // chunks "on disk" there would never leave RAM, whether or not the kernel
  // takes O_DIRECT on it (Linux 6.6 and later do on tmpfs).
  struct statfs fs {};
  if (::statfs(options.dir.c_str(), &fs) == 0 &&
      (fs.f_type == kTmpfsMagic || fs.f_type == kRamfsMagic)) {
    TIDAL_CHECK(options.allow_buffered, "DirectFile: the folder '", options.dir, "' is on ",
                fs.f_type == kTmpfsMagic ? "tmpfs" : "ramfs",
                ", whose files are host memory: chunks there would not leave RAM, so the tier would "
                "free none (the kernel may accept O_DIRECT on it, but no disk is behind it); name a "
                "folder on a disk, or allow it (tidal.nvme_allow_buffered)");
    memory_backed_ = true;
  }
  removed_stale_ = remove_stale(options.dir);
  path_ = detail::str_cat(options.dir, "/tidal-", ::getpid(), "-", file_counter.fetch_add(1), ".slots");
  fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0600);
  if (fd_ < 0 && errno == EINVAL) {
    // No O_DIRECT on this file system (tmpfs, some FUSE file systems).
    ::unlink(path_.c_str());
    TIDAL_CHECK(options.allow_buffered, "DirectFile: the file system of '", options.dir,
                "' does not support direct I/O (O_DIRECT: ", errno_text(EINVAL),
                "), as tmpfs does not; name a folder on a disk, or allow buffered I/O (the page cache "
                "then holds a second copy of every chunk)");
    direct_ = false;
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  }
  TIDAL_CHECK_RUNTIME(fd_ >= 0, "DirectFile: could not create '", path_, "': ", errno_text(errno));
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    ::close(fd_);
    ::unlink(path_.c_str());
    TIDAL_THROW(Error, "DirectFile: could not lock '", path_, "': ", errno_text(err));
  }
  register_live_file(path_);
  const std::size_t slots = slots_;
  slots_ = 0;
  try {
    reserve_to(slots, options.dir);
  } catch (...) {
    ::close(fd_);
    ::unlink(path_.c_str());
    throw;
  }
  if (options.backend != DirectIoBackend::kThreads &&
      start_ring(static_cast<unsigned>(options.threads), options.backend == DirectIoBackend::kIoUring)) {
    return;
  }
  threads_.reserve(static_cast<std::size_t>(options.threads));
  for (int i = 0; i < options.threads; ++i) threads_.emplace_back([this] { worker(); });
}

bool DirectFile::start_ring(unsigned depth, bool required) {
#if defined(TIDAL_WITH_IO_URING)
  auto ring = std::make_unique<Ring>();
  const int err = ::io_uring_queue_init(depth, &ring->ring, 0);
  if (err < 0) {
    if (!required) return false;
    ::close(fd_);
    ::unlink(path_.c_str());
    TIDAL_THROW(Error, "DirectFile: io_uring_queue_init(", depth, ") failed for '", path_, "': ",
                errno_text(-err), " (io_uring may be disabled here: kernel.io_uring_disabled, or a "
                "container's seccomp profile); use the 'threads' backend");
  }
  ring->depth = depth;
  ring_ = std::move(ring);
  threads_.emplace_back([this] { reaper(); });
  return true;
#else
  if (required) {
    ::close(fd_);
    ::unlink(path_.c_str());
    TIDAL_THROW(ValueError, "DirectFile: the io_uring backend was asked for, but this build has no "
                "liburing (install liburing-dev and rebuild); use the 'threads' backend");
  }
  (void)depth;
  return false;
#endif
}

void DirectFile::pump_locked() {
#if defined(TIDAL_WITH_IO_URING)
  Ring& g = *ring_;
  bool any = false;
  while (g.in_flight < g.depth && !queue_.empty()) {
    io_uring_sqe* sqe = ::io_uring_get_sqe(&g.ring);
    if (sqe == nullptr) break;
    auto* r = new Request(queue_.front());
    queue_.pop_front();
    if (r->write) {
      ::io_uring_prep_write(sqe, fd_, r->buffer, static_cast<unsigned>(r->bytes), static_cast<__u64>(r->offset));
    } else {
      ::io_uring_prep_read(sqe, fd_, r->buffer, static_cast<unsigned>(r->bytes), static_cast<__u64>(r->offset));
    }
    ::io_uring_sqe_set_data(sqe, r);
    ++g.in_flight;
    any = true;
  }
  if (any) {
    // (Runs on the reaper thread too, so it reports instead of throwing: the
    // prepared entries stay on the ring and go with the next submit.)
    const int n = ::io_uring_submit(&g.ring);
    if (n < 0) {
      std::fprintf(stderr, "tidal: DirectFile: io_uring_submit on '%s' failed: %s\n", path_.c_str(),
                   std::strerror(-n));
    }
  }
#endif
}

void DirectFile::reaper() {
#if defined(TIDAL_WITH_IO_URING)
  Ring& g = *ring_;
  for (;;) {
    io_uring_cqe* cqe = nullptr;
    const int err = ::io_uring_wait_cqe(&g.ring, &cqe);
    if (err == -EINTR) continue;
    if (err < 0) {
      std::fprintf(stderr, "tidal: DirectFile: io_uring_wait_cqe on '%s' failed: %s\n", path_.c_str(),
                   std::strerror(-err));
      return;
    }
    auto* r = static_cast<Request*>(::io_uring_cqe_get_data(cqe));
    const int res = cqe->res;
    ::io_uring_cqe_seen(&g.ring, cqe);
    if (r == nullptr) return;  // the destructor's stop
    std::unique_ptr<Request> owned(r);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      --g.in_flight;
      if (res == -EINTR || res == -EAGAIN) {
        queue_.push_front(*r);
      } else if (res < 0) {
        finish_locked(*r, 0, describe_failure(*r, -res, 0));
      } else if (res == 0) {
        finish_locked(*r, 0, describe_failure(*r, 0, 0));
      } else if (static_cast<std::size_t>(res) < r->bytes) {
        // A short transfer: the rest goes again, counted when it lands.
        (r->write ? bytes_written_ : bytes_read_) += static_cast<std::size_t>(res);
        Request rest = *r;
        rest.offset += static_cast<std::size_t>(res);
        rest.buffer += res;
        rest.bytes -= static_cast<std::size_t>(res);
        queue_.push_front(rest);
      } else {
        finish_locked(*r, r->bytes, {});
      }
      pump_locked();
    }
    done_.notify_all();
  }
#endif
}

void DirectFile::finish_locked(const Request& r, std::size_t done, std::string error) {
  Pending& p = pending_[r.ticket];
  if (!error.empty() && first_failure_.empty()) {
    first_failure_ = error;
    failed_.store(true, std::memory_order_release);
  }
  if (!error.empty() && p.error.empty()) p.error = std::move(error);
  (r.write ? bytes_written_ : bytes_read_) += done;
  --p.left;
}

void DirectFile::reserve_to(std::size_t slots, const std::string& dir) {
  if (slots <= slots_) return;
  const std::size_t from = slot_bytes_ * slots_;
  const std::size_t total = slot_bytes_ * slots;
  const int err = ::posix_fallocate(fd_, static_cast<off_t>(from), static_cast<off_t>(total - from));
  if (err != 0) {
    TIDAL_THROW(OutOfMemoryError, "DirectFile: could not reserve ", format_bytes(total - from), " more (",
                format_bytes(total), " in all, ", slots, " slots of ", format_bytes(slot_bytes_), ") in '", path_,
                "': ", errno_text(err), "; the file system has ", format_bytes(free_bytes(dir)), " free");
  }
  std::lock_guard<std::mutex> lock(mutex_);
  slots_ = slots;
}

void DirectFile::grow(std::size_t slots) { reserve_to(slots, path_.substr(0, path_.rfind('/'))); }

bool DirectFile::done(Ticket ticket) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = pending_.find(ticket);
  TIDAL_CHECK(it != pending_.end(), "DirectFile::done: ticket ", ticket, " is not pending (waited for already?)");
  return it->second.left == 0;
}

DirectFile::~DirectFile() {
  {
    std::unique_lock<std::mutex> lock(mutex_);
    stopping_ = true;
#if defined(TIDAL_WITH_IO_URING)
    if (ring_) {
      // Every request lands before the file and the buffers go; then a NOP
      // without data tells the reaper to stop.
      done_.wait(lock, [this] { return queue_.empty() && ring_->in_flight == 0; });
      io_uring_sqe* sqe = ::io_uring_get_sqe(&ring_->ring);
      if (sqe != nullptr) {
        ::io_uring_prep_nop(sqe);
        ::io_uring_sqe_set_data(sqe, nullptr);
        ::io_uring_submit(&ring_->ring);
      }
    }
#endif
  }
  work_.notify_all();
  for (std::thread& t : threads_) t.join();
#if defined(TIDAL_WITH_IO_URING)
  if (ring_) ::io_uring_queue_exit(&ring_->ring);
#endif
  if (fd_ >= 0) ::close(fd_);
  if (!path_.empty()) {
    ::unlink(path_.c_str());
    forget_live_file(path_);
  }
}

DirectFile::Ticket DirectFile::write(std::size_t slot, const void* src, std::size_t bytes) {
  return submit(true, slot, const_cast<char*>(static_cast<const char*>(src)), bytes);
}

DirectFile::Ticket DirectFile::read(std::size_t slot, void* dst, std::size_t bytes) {
  return submit(false, slot, static_cast<char*>(dst), bytes);
}

DirectFile::Ticket DirectFile::submit(bool write, std::size_t slot, char* buffer, std::size_t bytes) {
  const char* what = write ? "write" : "read";
  std::unique_lock<std::mutex> lock(mutex_);
  TIDAL_CHECK_INDEX(slot < slots_, "DirectFile::", what, ": slot ", slot, " of a file of ", slots_, " slots");
  TIDAL_CHECK(bytes > 0 && bytes <= (slots_ - slot) * slot_bytes_, "DirectFile::", what, ": expected 1 to ",
              (slots_ - slot) * slot_bytes_, " bytes (slot ", slot, " to the end of the file), got ", bytes);
  TIDAL_CHECK(reinterpret_cast<std::uintptr_t>(buffer) % kDirectAlignment == 0 && bytes % kDirectAlignment == 0,
              "DirectFile::", what, ": direct I/O needs a buffer aligned to ", kDirectAlignment,
              " bytes and a multiple of it in size; got address ", static_cast<const void*>(buffer), " and ",
              bytes, " bytes (use AlignedBuffer)");
  const Ticket ticket = next_ticket_++;
  Pending& p = pending_[ticket];
  const std::size_t base = slot * slot_bytes_;
  int fail = 0;
  if (++submitted_[write] == fail_at_[write]) {
    fail = fail_errno_[write];
    fail_at_[write] = 0;
  }
  for (std::size_t off = 0; off < bytes; off += request_bytes_) {
    const std::size_t n = std::min(request_bytes_, bytes - off);
    ++p.left;
    const Request r{ticket, write, base + off, buffer + off, n, slot, off == 0 ? fail : 0};
    if (r.fail_errno != 0) {
      finish_locked(r, 0, describe_failure(r, r.fail_errno, 0));  // as the drive would answer
    } else {
      queue_.push_back(r);
    }
  }
  if (ring_) {
    pump_locked();
    return ticket;
  }
  lock.unlock();
  work_.notify_all();
  return ticket;
}

std::string DirectFile::describe_failure(const Request& r, int err, long done) const {
  const char* what = r.write ? "writing" : "reading";
  std::string cause = err != 0 ? errno_text(err) : detail::str_cat("the file ended after ", done, " bytes");
  return detail::str_cat("DirectFile: ", what, " ", r.bytes, " bytes at offset ", r.offset, " (slot ", r.slot,
                         ") of '", path_, "' failed: ", cause, "; the file system has ",
                         format_bytes(free_bytes(path_.substr(0, path_.rfind('/')))), " free");
}

void DirectFile::worker() {
  for (;;) {
    Request r{};
    {
      std::unique_lock<std::mutex> lock(mutex_);
      work_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // (stopping, nothing left)
      r = queue_.front();
      queue_.pop_front();
    }
    std::string error;
    std::size_t done = 0;
    while (done < r.bytes) {
      const off_t at = static_cast<off_t>(r.offset + done);
      const ssize_t n = r.write ? ::pwrite(fd_, r.buffer + done, r.bytes - done, at)
                                : ::pread(fd_, r.buffer + done, r.bytes - done, at);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        error = describe_failure(r, n < 0 ? errno : 0, static_cast<long>(done));
        break;
      }
      done += static_cast<std::size_t>(n);
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      finish_locked(r, done, std::move(error));
    }
    done_.notify_all();
  }
}

void DirectFile::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lock(mutex_);
  TIDAL_CHECK(pending_.count(ticket) == 1, "DirectFile::wait: ticket ", ticket,
              " is not pending (waited for already?)");
  // (Looked up each time: a submit while this waits may rehash the map.)
  done_.wait(lock, [&] { return pending_.find(ticket)->second.left == 0; });
  auto it = pending_.find(ticket);
  std::string error = std::move(it->second.error);
  pending_.erase(it);
  lock.unlock();
  TIDAL_CHECK_RUNTIME(error.empty(), error);
}

void DirectFile::wait_all() {
  std::vector<Ticket> tickets;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [t, p] : pending_) tickets.push_back(t);
  }
  std::string first;
  for (Ticket t : tickets) {
    try {
      wait(t);
    } catch (const Error& e) {
      if (first.empty()) first = e.what();
    }
  }
  TIDAL_CHECK_RUNTIME(first.empty(), first);
}

std::string DirectFile::failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return first_failure_;
}

void DirectFile::fail_nth(bool write, std::uint64_t nth, int err) {
  TIDAL_CHECK(nth == 0 || err > 0, "DirectFile::fail_nth: expected an errno > 0, got ", err);
  std::lock_guard<std::mutex> lock(mutex_);
  fail_at_[write] = nth == 0 ? 0 : submitted_[write] + nth;
  fail_errno_[write] = err;
}

std::uint64_t DirectFile::bytes_read() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_read_;
}

std::uint64_t DirectFile::bytes_written() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return bytes_written_;
}

}  // namespace tidal
