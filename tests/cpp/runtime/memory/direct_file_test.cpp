// DirectFile (Note [Chunks on NVMe: the file]): what is written to a slot
// reads back byte for byte, with many tickets in flight; files of a killed
// process are removed, a live one's are not; bad input names the value.
#include "runtime/memory/direct_file.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "runtime/core/error.h"
#include "tests/cpp/runtime/temp_dir.h"

namespace tidal {
namespace {

constexpr std::size_t kKiB = 1024;


bool exists(const std::string& path) {
  struct stat st {};
  return ::stat(path.c_str(), &st) == 0;
}

void fill(AlignedBuffer& b, unsigned seed) {
  std::mt19937 gen(seed);
  auto* p = static_cast<unsigned char*>(b.data());
  for (std::size_t i = 0; i < b.size(); ++i) p[i] = static_cast<unsigned char>(gen());
}

TEST(DirectFile, WhatIsWrittenReadsBackByteForByte) {
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = 256 * kKiB;
  o.slots = 6;
  o.request_bytes = 64 * kKiB;  // four requests per slot
  o.threads = 3;
  o.allow_buffered = true;
  std::string path;
  {
    DirectFile f(o);
    path = f.path();
    EXPECT_TRUE(exists(path));
    std::vector<AlignedBuffer> out, in;
    std::vector<DirectFile::Ticket> tickets;
    for (std::size_t s = 0; s < o.slots; ++s) {
      out.emplace_back(o.slot_bytes);
      fill(out.back(), static_cast<unsigned>(s + 1));
      tickets.push_back(f.write(s, out.back().data(), o.slot_bytes));
    }
    // Waited for in another order than submitted.
    for (std::size_t k = tickets.size(); k-- > 0;) f.wait(tickets[k]);
    EXPECT_EQ(f.bytes_written(), o.slots * o.slot_bytes);
    tickets.clear();
    for (std::size_t s = 0; s < o.slots; ++s) {
      in.emplace_back(o.slot_bytes);
      std::memset(in.back().data(), 0, o.slot_bytes);
      tickets.push_back(f.read(s, in.back().data(), o.slot_bytes));
    }
    f.wait_all();
    for (std::size_t s = 0; s < o.slots; ++s) {
      EXPECT_EQ(std::memcmp(in[s].data(), out[s].data(), o.slot_bytes), 0) << "slot " << s;
    }
    EXPECT_EQ(f.bytes_read(), o.slots * o.slot_bytes);
    // A partial slot (the first 8 KiB) overwrites only those bytes.
    AlignedBuffer part(8 * kKiB);
    fill(part, 99);
    f.wait(f.write(2, part.data(), part.size()));
    AlignedBuffer back(o.slot_bytes);
    f.wait(f.read(2, back.data(), o.slot_bytes));
    EXPECT_EQ(std::memcmp(back.data(), part.data(), part.size()), 0);
    EXPECT_EQ(std::memcmp(static_cast<char*>(back.data()) + part.size(),
                          static_cast<char*>(out[2].data()) + part.size(), o.slot_bytes - part.size()),
              0);
  }
  EXPECT_FALSE(exists(path)) << "the destructor removes the file";
}

TEST(DirectFile, ManyTicketsFromSeveralThreadsKeepTheirSlots) {
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = 64 * kKiB;
  o.slots = 16;
  o.request_bytes = 16 * kKiB;
  o.threads = 4;
  o.allow_buffered = true;
  DirectFile f(o);
  std::vector<AlignedBuffer> out(o.slots);
  std::vector<std::thread> writers;
  for (int w = 0; w < 4; ++w) {
    writers.emplace_back([&, w] {
      for (std::size_t s = static_cast<std::size_t>(w); s < o.slots; s += 4) {
        out[s] = AlignedBuffer(o.slot_bytes);
        fill(out[s], static_cast<unsigned>(100 + s));
        f.wait(f.write(s, out[s].data(), o.slot_bytes));
      }
    });
  }
  for (auto& t : writers) t.join();
  for (std::size_t s = 0; s < o.slots; ++s) {
    AlignedBuffer in(o.slot_bytes);
    f.wait(f.read(s, in.data(), o.slot_bytes));
    EXPECT_EQ(std::memcmp(in.data(), out[s].data(), o.slot_bytes), 0) << "slot " << s;
  }
}

TEST(DirectFile, FilesOfAGoneProcessAreRemovedALiveOnesAreNot) {
  testing::TempDir dir("tidal_direct_");
  const std::string gone = dir.path() + "/tidal-999999-0.slots";
  const std::string live = dir.path() + "/tidal-999998-0.slots";
  const std::string other = dir.path() + "/notes.txt";
  for (const std::string& p : {gone, live, other}) {
    const int fd = ::open(p.c_str(), O_RDWR | O_CREAT, 0600);
    ASSERT_GE(fd, 0);
    ::close(fd);
  }
  const int held = ::open(live.c_str(), O_RDWR);  // its owner holds the lock
  ASSERT_EQ(::flock(held, LOCK_EX | LOCK_NB), 0);
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = 4 * kKiB;
  o.slots = 1;
  o.allow_buffered = true;
  {
    DirectFile f(o);
    ASSERT_EQ(f.removed_stale().size(), 1u);
    EXPECT_EQ(f.removed_stale()[0], gone);
    EXPECT_FALSE(exists(gone));
    EXPECT_TRUE(exists(live));
    EXPECT_TRUE(exists(other));
  }
  ::close(held);
}

TEST(DirectFile, BadInputNamesTheValue) {
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path() + "/missing";
  o.slot_bytes = 4 * kKiB;
  o.slots = 2;
  o.allow_buffered = true;
  try {
    DirectFile f(o);
    FAIL() << "a missing folder was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("missing"), std::string::npos) << e.what();
  }
  o.dir = dir.path();
  DirectFile f(o);
  AlignedBuffer b(8 * kKiB);
  EXPECT_THROW(f.write(2, b.data(), 4 * kKiB), IndexError);
  EXPECT_THROW(f.write(1, b.data(), 8 * kKiB), ValueError);  // past the end of the file
  EXPECT_THROW(f.write(0, static_cast<char*>(b.data()) + 512, 4 * kKiB), ValueError);  // misaligned
  EXPECT_THROW(f.read(0, b.data(), 1000), ValueError);  // not a multiple of 4 KiB
  EXPECT_THROW(f.wait(12345), ValueError);
}

TEST(DirectFile, TheIoUringBackendReadsBackByteForByte) {
  if (!io_uring_built()) GTEST_SKIP() << "built without liburing";
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = 256 * kKiB;
  o.slots = 6;
  o.request_bytes = 64 * kKiB;  // 24 requests on a ring of 3: most wait in the queue
  o.threads = 3;
  o.allow_buffered = true;
  o.backend = DirectIoBackend::kIoUring;
  std::vector<AlignedBuffer> out;
  {
    DirectFile f(o);
    EXPECT_STREQ(f.backend(), "io_uring");
    std::vector<DirectFile::Ticket> tickets;
    for (std::size_t s = 0; s < o.slots; ++s) {
      out.emplace_back(o.slot_bytes);
      fill(out.back(), static_cast<unsigned>(s + 11));
      tickets.push_back(f.write(s, out.back().data(), o.slot_bytes));
    }
    for (std::size_t k = tickets.size(); k-- > 0;) f.wait(tickets[k]);
    EXPECT_EQ(f.bytes_written(), o.slots * o.slot_bytes);
    std::vector<AlignedBuffer> in;
    for (std::size_t s = 0; s < o.slots; ++s) {
      in.emplace_back(o.slot_bytes);
      std::memset(in.back().data(), 0, o.slot_bytes);
      f.read(s, in.back().data(), o.slot_bytes);
    }
    f.wait_all();
    for (std::size_t s = 0; s < o.slots; ++s) {
      EXPECT_EQ(std::memcmp(in[s].data(), out[s].data(), o.slot_bytes), 0) << "slot " << s;
    }
    EXPECT_EQ(f.bytes_read(), o.slots * o.slot_bytes);
    // Writes still in flight when the file goes: the destructor waits for them.
    for (std::size_t s = 0; s < o.slots; ++s) f.write(s, out[s].data(), o.slot_bytes);
  }
  // A reading past the end fails with the path, as with the threads.
  o.slots = 1;
  DirectFile g(o);
  AlignedBuffer b(o.slot_bytes);
  g.grow(2);
  const DirectFile::Ticket t = g.read(1, b.data(), o.slot_bytes);  // allocated, reads zeros
  g.wait(t);
  // The auto backend takes io_uring here too.
  o.backend = DirectIoBackend::kAuto;
  DirectFile h(o);
  EXPECT_STREQ(h.backend(), "io_uring");
  EXPECT_THROW(parse_direct_io_backend("aio"), ValueError);
}

TEST(DirectFile, GrowsAndARequestSpansSlots) {
  // The disk tier's use: page-sized slots, a chunk's home a run of them,
  // the file grown as homes are given.
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = 4 * kKiB;
  o.slots = 0;
  o.request_bytes = 8 * kKiB;
  o.allow_buffered = true;
  DirectFile f(o);
  EXPECT_EQ(f.slots(), 0u);
  AlignedBuffer out(24 * kKiB), in(24 * kKiB);
  fill(out, 7);
  EXPECT_THROW(f.write(0, out.data(), 24 * kKiB), IndexError);
  f.grow(2);
  f.grow(8);
  f.grow(3);  // never shrinks
  EXPECT_EQ(f.slots(), 8u);
  struct stat st {};
  ASSERT_EQ(::stat(f.path().c_str(), &st), 0);
  EXPECT_GE(static_cast<std::size_t>(st.st_size), 8 * 4 * kKiB);
  const DirectFile::Ticket w = f.write(2, out.data(), 24 * kKiB);  // slots 2..7
  f.wait(w);
  const DirectFile::Ticket r = f.read(2, in.data(), 24 * kKiB);
  f.wait(r);
  EXPECT_EQ(std::memcmp(in.data(), out.data(), 24 * kKiB), 0);
  const DirectFile::Ticket r2 = f.read(2, in.data(), 4 * kKiB);
  while (!f.done(r2)) {
  }
  f.wait(r2);
  EXPECT_THROW(f.done(r2), ValueError);  // waited for already
}

TEST(DirectFile, ADiskTooSmallFailsAtCreationNamingTheBytes) {
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = std::size_t{1} << 40;  // 1 TiB slots
  o.slots = 1u << 16;                   // 64 PiB in all
  o.allow_buffered = true;
  try {
    DirectFile f(o);
    FAIL() << "64 PiB was reserved";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("could not reserve"), std::string::npos) << m;
    EXPECT_NE(m.find("free"), std::string::npos) << m;
    EXPECT_NE(m.find(dir.path()), std::string::npos) << m;
  }
  // Nothing is left behind.
  const std::string cmd = "test -z \"$(ls -A '" + dir.path() + "')\"";
  EXPECT_EQ(std::system(cmd.c_str()), 0);
}

TEST(DirectFile, AFolderOnTmpfsIsRefusedUnlessAllowed) {
  // tmpfs refuses O_DIRECT on older kernels and accepts it on newer ones;
  // either way its files are host memory, so it is refused by its type.
  if (!exists("/dev/shm")) GTEST_SKIP() << "no /dev/shm on this machine: no tmpfs to try the refusal on";
  DirectFileOptions o;
  o.dir = "/dev/shm";
  o.slot_bytes = 4 * kKiB;
  o.slots = 1;
  try {
    DirectFile f(o);
    FAIL() << "a folder on tmpfs was accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("is on tmpfs, whose files are host memory"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("/dev/shm"), std::string::npos) << e.what();
    // Refused for being memory, whether or not the kernel takes O_DIRECT there.
    EXPECT_EQ(std::string(e.what()).find("has no direct"), std::string::npos) << e.what();
  }
  o.allow_buffered = true;
  DirectFile g(o);
  EXPECT_TRUE(g.memory_backed());
  AlignedBuffer b(4 * kKiB), c(4 * kKiB);
  fill(b, 7);
  g.wait(g.write(0, b.data(), b.size()));
  g.wait(g.read(0, c.data(), c.size()));
  EXPECT_EQ(std::memcmp(b.data(), c.data(), b.size()), 0);
}

TEST(DirectFile, AnInjectedFailureIsTheNthTicketsAndIsKeptAsTheFirst) {
  // fail_nth (for the tests of what a broken disk does to the layers above):
  // the nth read or write from then on fails with the errno given and the
  // message a real failure has; the tickets before and after it are served;
  // failure() keeps the first failure whether or not its ticket is waited for.
  testing::TempDir dir("tidal_direct_");
  DirectFileOptions o;
  o.dir = dir.path();
  o.slot_bytes = 16 * kKiB;
  o.slots = 4;
  o.request_bytes = 4 * kKiB;  // four requests per slot
  o.threads = 2;
  o.allow_buffered = true;
  DirectFile f(o);
  EXPECT_FALSE(f.failed());
  EXPECT_EQ(f.failure(), "");
  std::vector<AlignedBuffer> out;
  for (std::size_t s = 0; s < 3; ++s) {
    out.emplace_back(o.slot_bytes);
    fill(out.back(), static_cast<unsigned>(s + 11));
  }
  f.fail_nth(/*write=*/true, 2, EIO);
  const DirectFile::Ticket w0 = f.write(0, out[0].data(), o.slot_bytes);
  const DirectFile::Ticket w1 = f.write(1, out[1].data(), o.slot_bytes);  // the 2nd write: fails
  const DirectFile::Ticket w2 = f.write(2, out[2].data(), o.slot_bytes);
  EXPECT_TRUE(f.failed());  // known before anyone waits
  const std::string first = f.failure();
  EXPECT_NE(first.find("writing 4096 bytes at offset 16384 (slot 1) of '" + f.path() + "' failed: "),
            std::string::npos) << first;
  EXPECT_NE(first.find(std::strerror(EIO)), std::string::npos) << first;
  f.wait(w0);
  f.wait(w2);
  try {
    f.wait(w1);
    FAIL() << "the injected write failure was not reported";
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find(first), 0u) << e.what();
  }
  // A read: the 1st from now fails with ENOSPC's text; the next one is served.
  f.fail_nth(/*write=*/false, 1, ENOSPC);
  AlignedBuffer in(o.slot_bytes);
  EXPECT_THROW(f.wait(f.read(0, in.data(), o.slot_bytes)), Error);
  f.wait(f.read(0, in.data(), o.slot_bytes));
  EXPECT_EQ(std::memcmp(in.data(), out[0].data(), o.slot_bytes), 0);
  f.wait(f.read(2, in.data(), o.slot_bytes));
  EXPECT_EQ(std::memcmp(in.data(), out[2].data(), o.slot_bytes), 0);
  EXPECT_EQ(f.failure(), first);  // the first stays the first
  // Disarmed: nth 0.
  f.fail_nth(/*write=*/false, 1, EIO);
  f.fail_nth(/*write=*/false, 0, 0);
  f.wait(f.read(0, in.data(), o.slot_bytes));
  EXPECT_THROW(f.fail_nth(/*write=*/true, 1, 0), ValueError);
}

}  // namespace
}  // namespace tidal
