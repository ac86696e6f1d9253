#include "runtime/scheduler/disk_tier.h"

#include <utility>

#include "runtime/core/error.h"

namespace tidal {
namespace {

std::size_t pages_of(std::size_t bytes) { return (bytes + kDirectAlignment - 1) / kDirectAlignment; }

// One read or write of the file. wait() may be called any number of times:
// the first waits for the file's ticket, later ones repeat its outcome (a
// failed write throws wherever its block is next used).
class FileIo final : public PendingIo {
 public:
  FileIo(std::shared_ptr<DirectFile> file, DirectFile::Ticket ticket)
      : file_(std::move(file)), ticket_(ticket) {}
  ~FileIo() override {
    if (finished_) return;
    try {
      file_->wait(ticket_);  // never leave requests on freed memory
    } catch (...) {
    }
  }
  bool done() override { return finished_ || file_->done(ticket_); }
  void wait() override {
    if (!finished_) {
      finished_ = true;
      try {
        file_->wait(ticket_);
      } catch (const Error& e) {
        error_ = e.what();
      }
    }
    TIDAL_CHECK_RUNTIME(error_.empty(), error_);
  }

 private:
  std::shared_ptr<DirectFile> file_;
  DirectFile::Ticket ticket_;
  bool finished_ = false;
  std::string error_;
};

}  // namespace

DiskTier::DiskTier(const DiskTierOptions& options) : dir_(options.dir) {
  DirectFileOptions f;
  f.dir = options.dir;
  f.slot_bytes = kDirectAlignment;  // a slot is a page; a chunk's home is a run of them
  f.slots = 0;
  f.request_bytes = options.request_bytes;
  f.threads = options.threads;
  f.allow_buffered = options.allow_buffered;
  f.backend = options.backend;
  file_ = std::make_shared<DirectFile>(f);
  if (options.budget_bytes > 0) {
    budget_ = options.budget_bytes;
  } else {
    const std::uint64_t free = DirectFile::free_bytes(options.dir);
    budget_ = static_cast<std::size_t>(free - free / 10);
  }
}

// Pending I/O keeps the file open (FileIo holds it) and waits for itself
// when it goes; the file's destructor drains its queue before it closes.
DiskTier::~DiskTier() = default;

void DiskTier::ensure_home(ChunkId id, std::size_t bytes, const std::string& what) {
  if (homes_.size() <= id) {
    homes_.resize(id + 1);
    last_write_.resize(id + 1);
  }
  Home& home = homes_[id];
  if (home.assigned) {
    TIDAL_INTERNAL_ASSERT(pages_of(bytes) <= home.pages, "chunk ", id, " of ", bytes, " bytes outgrew its home of ",
                          home.pages, " pages");
    return;
  }
  const std::size_t pages = pages_of(bytes);
  const std::size_t need = (pages_ + pages) * kDirectAlignment;
  TIDAL_CHECK_WITH(::tidal::OutOfMemoryError, need <= budget_, "no room on disk for ", what, ": the NVMe budget is ", format_bytes(budget_),
                  ", ", format_bytes(held_bytes()), " of it hold other chunks and this one needs ",
                  format_bytes(pages * kDirectAlignment), " more (file '", path(), "', ",
                  format_bytes(DirectFile::free_bytes(dir_)),
                  " free on its file system). Tip: raise the NVMe budget or the host budget");
  file_->grow(pages_ + pages);  // throws naming the bytes free
  home.page = pages_;
  home.pages = pages;
  home.assigned = true;
  pages_ += pages;
}

std::shared_ptr<PendingIo> DiskTier::write(ChunkId id, const void* src, std::size_t bytes) {
  TIDAL_INTERNAL_ASSERT(id < homes_.size() && homes_[id].assigned, "write of chunk ", id, " without a home");
  const Home& home = homes_[id];
  const std::size_t n = pages_of(bytes) * kDirectAlignment;
  TIDAL_INTERNAL_ASSERT(n <= home.pages * kDirectAlignment, "write past the home of chunk ", id);
  auto io = std::make_shared<FileIo>(file_, file_->write(home.page, src, n));
  last_write_[id] = io;
  return io;
}

std::shared_ptr<PendingIo> DiskTier::read(ChunkId id, void* dst, std::size_t bytes) {
  TIDAL_INTERNAL_ASSERT(id < homes_.size() && homes_[id].assigned, "read of chunk ", id, " without a home");
  if (last_write_[id]) {
    last_write_[id]->wait();  // the home holds the chunk once its write landed
    last_write_[id].reset();
  }
  const Home& home = homes_[id];
  const std::size_t n = pages_of(bytes) * kDirectAlignment;
  return std::make_shared<FileIo>(file_, file_->read(home.page, dst, n));
}

void* DiskTier::token(ChunkId id) {
  while (tokens_.size() <= id) tokens_.push_back(0);
  return &tokens_[id];
}


}  // namespace tidal
