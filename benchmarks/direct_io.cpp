// DirectFile's read and write rates (Note [Chunks on NVMe: the file]): every
// slot written, then every slot read back (three in flight) and its stamps checked, `rounds` times; one
// JSON object on stdout. benchmarks/nvme_bandwidth.py runs it beside dd with
// oflag=direct / iflag=direct on the same folder, in the same run.
// The process's CPU seconds (user + system) over the writes and the reads
// are reported too: io_uring's claim is less CPU for the same rate.
//   tidal_bench_direct_io DIR [--slot-mib N] [--slots N] [--threads N] [--request-kib N] [--rounds N]
//                             [--backend threads|io_uring]
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/memory/direct_file.h"

static double cpu_seconds() {
  rusage u{};
  ::getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) * 1e-6;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s DIR [--slot-mib N] [--slots N] [--threads N] [--request-kib N] [--rounds N]\n",
                 argv[0]);
    return 2;
  }
  tidal::DirectFileOptions o;
  o.dir = argv[1];
  o.slot_bytes = std::size_t{64} << 20;
  o.slots = 16;
  o.threads = 8;
  int rounds = 3;
  for (int i = 2; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long v = std::atol(argv[i + 1]);
    if (k == "--backend") {
      try {
        o.backend = tidal::parse_direct_io_backend(argv[i + 1]);
      } catch (const tidal::Error& e) {
        std::fprintf(stderr, "%s\n", e.what());
        return 2;
      }
    } else if (k == "--slot-mib") o.slot_bytes = static_cast<std::size_t>(v) << 20;
    else if (k == "--slots") o.slots = static_cast<std::size_t>(v);
    else if (k == "--threads") o.threads = static_cast<int>(v);
    else if (k == "--request-kib") o.request_bytes = static_cast<std::size_t>(v) << 10;
    else if (k == "--rounds") rounds = static_cast<int>(v);
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  try {
    tidal::DirectFile f(o);
    std::vector<tidal::AlignedBuffer> bufs;
    for (std::size_t s = 0; s < o.slots; ++s) {
      bufs.emplace_back(o.slot_bytes);
      auto* p = static_cast<unsigned char*>(bufs.back().data());
      for (std::size_t i = 0; i < o.slot_bytes; i += 4096) p[i] = static_cast<unsigned char>(s + i / 4096);
    }
    std::vector<double> write_s, read_s, write_cpu, read_cpu;
    using clock = std::chrono::steady_clock;
    for (int r = 0; r < rounds; ++r) {
      double c0 = cpu_seconds();
      auto t0 = clock::now();
      std::vector<tidal::DirectFile::Ticket> t;
      for (std::size_t s = 0; s < o.slots; ++s) t.push_back(f.write(s, bufs[s].data(), o.slot_bytes));
      for (auto k : t) f.wait(k);
      write_s.push_back(std::chrono::duration<double>(clock::now() - t0).count());
      write_cpu.push_back(cpu_seconds() - c0);
      c0 = cpu_seconds();
      // Reads through a ring of four buffers, three in flight; each slot's
      // stamps (one byte per 4 KiB page) are checked as it lands.
      t0 = clock::now();
      constexpr std::size_t kRing = 4;
      std::vector<tidal::AlignedBuffer> ring;
      for (std::size_t k = 0; k < kRing; ++k) ring.emplace_back(o.slot_bytes);
      std::vector<tidal::DirectFile::Ticket> inflight(o.slots);
      std::size_t issued = 0;
      for (; issued < std::min(o.slots, kRing - 1); ++issued) {
        inflight[issued] = f.read(issued, ring[issued % kRing].data(), o.slot_bytes);
      }
      for (std::size_t s = 0; s < o.slots; ++s) {
        f.wait(inflight[s]);
        if (issued < o.slots) {
          inflight[issued] = f.read(issued, ring[issued % kRing].data(), o.slot_bytes);
          ++issued;
        }
        const auto* got = static_cast<const unsigned char*>(ring[s % kRing].data());
        for (std::size_t i = 0; i < o.slot_bytes; i += 4096) {
          if (got[i] != static_cast<unsigned char>(s + i / 4096)) {
            std::fprintf(stderr, "slot %zu read back differs at byte %zu\n", s, i);
            return 1;
          }
        }
      }
      read_s.push_back(std::chrono::duration<double>(clock::now() - t0).count());
      read_cpu.push_back(cpu_seconds() - c0);  // (includes checking the stamps)
    }
    const double bytes = static_cast<double>(o.slot_bytes) * static_cast<double>(o.slots);
    std::printf("{\"path\": \"%s\", \"direct\": %s, \"backend\": \"%s\", \"slot_bytes\": %zu, \"slots\": %zu, "
                "\"threads\": %d, \"request_bytes\": %zu, \"bytes\": %.0f, \"write_seconds\": [",
                f.path().c_str(), f.direct() ? "true" : "false", f.backend(), f.slot_bytes(), f.slots(), o.threads,
                o.request_bytes, bytes);
    for (std::size_t i = 0; i < write_s.size(); ++i) std::printf("%s%.6f", i ? ", " : "", write_s[i]);
    std::printf("], \"read_seconds\": [");
    for (std::size_t i = 0; i < read_s.size(); ++i) std::printf("%s%.6f", i ? ", " : "", read_s[i]);
    std::printf("], \"write_cpu_seconds\": [");
    for (std::size_t i = 0; i < write_cpu.size(); ++i) std::printf("%s%.6f", i ? ", " : "", write_cpu[i]);
    std::printf("], \"read_cpu_seconds\": [");
    for (std::size_t i = 0; i < read_cpu.size(); ++i) std::printf("%s%.6f", i ? ", " : "", read_cpu[i]);
    std::printf("]}\n");
  } catch (const tidal::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    return 1;
  }
  return 0;
}
