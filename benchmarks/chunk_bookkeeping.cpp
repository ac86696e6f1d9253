// Chunk scheduler benchmarks. Prints one JSON object; benchmarks/
// chunk_bookkeeping.py adds the machine description and writes the result
// file (see docs/benchmarks.md).
//
// Scenarios:
// * bookkeeping: ns per access()+release() pair with 10k tensors in 200
//   chunks, every chunk resident, so no data moves and the figure is the
//   scheduler's own bookkeeping: with the trace followed (OPT + prefetch
//   checks, the default) and without a trace (LRU). The peer in the same run
//   is the floor any scheduler pays: a loop that only flips a state byte and
//   computes the tensor's address. Also the same steps with half the chunks
//   fitting the budget ("with moves": bookkeeping plus real copies).
// * moves: chunk move bandwidth. Each step accesses N chunks on the device,
//   then the same N on the host (all fit the budget), so every access moves
//   its chunk and prefetch keeps the copy engine busy: bytes per second of
//   each phase. The peer in the same run copies N chunks each way with
//   nothing but copies: on CUDA a plain cudaMemcpyAsync loop on
//   cudaMallocHost memory, on the simulated device tidal's device layer.
// * prefetch: forward over N chunks and backward again with room for N/2,
//   a fixed compute time per access (a host spin standing in for kernels),
//   prefetch on vs off: seconds per step.
// On the simulated device the moves and prefetch figures check the
// scheduling logic at a configured link speed; they are not GPU claims.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "chunk/chunk_store.h"
#include "runtime/core/error.h"
#include "runtime/core/units.h"
#include "runtime/device/select.h"
#include "runtime/memory/host_buffer.h"
#include "runtime/scheduler/chunk_scheduler.h"

#if defined(TIDAL_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace {

// "t" + std::to_string(i) makes GCC 12 at -O3 warn falsely (-Wrestrict,
// GCC bug 105329); appending to a named string does not.
inline std::string indexed_name(const char* prefix, std::size_t i) {
  std::string name(prefix);
  name.append(std::to_string(i));
  return name;
}

using Clock = std::chrono::steady_clock;
using tidal::ChunkKind;
using tidal::MemorySpace;
using tidal::TensorState;

struct Args {
  std::string device = "sim";
  std::string scenarios = "bookkeeping,moves,prefetch";
  std::size_t tensors = 10000;
  std::size_t chunks = 200;
  std::size_t chunk_bytes = std::size_t{1} << 20;  // bookkeeping: size does not matter
  int samples = 30;
  int warmup = 3;
  // moves / prefetch
  std::size_t move_chunk_bytes = std::size_t{64} << 20;
  std::size_t move_chunks = 8;
  int move_steps = 5;
  double sim_bandwidth = 12e9;  // simulated link, bytes/s each way
  double compute_us = 0;        // prefetch: host spin per access; 0 = one chunk transfer time
};

Args parse_args(int argc, char** argv) {
  Args args;
  bool quick = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + arg);
      return argv[++i];
    };
    if (arg == "--device") {
      args.device = value();
    } else if (arg == "--scenarios") {
      args.scenarios = value();
    } else if (arg == "--tensors") {
      args.tensors = std::stoul(value());
    } else if (arg == "--chunks") {
      args.chunks = std::stoul(value());
    } else if (arg == "--chunk-bytes") {
      args.chunk_bytes = tidal::parse_bytes(value());
    } else if (arg == "--samples") {
      args.samples = std::stoi(value());
    } else if (arg == "--warmup") {
      args.warmup = std::stoi(value());
    } else if (arg == "--move-chunk-bytes") {
      args.move_chunk_bytes = tidal::parse_bytes(value());
    } else if (arg == "--move-chunks") {
      args.move_chunks = std::stoul(value());
    } else if (arg == "--move-steps") {
      args.move_steps = std::stoi(value());
    } else if (arg == "--sim-bandwidth") {
      args.sim_bandwidth = tidal::parse_bandwidth(value());
    } else if (arg == "--compute-us") {
      args.compute_us = std::stod(value());
    } else if (arg == "--quick") {
      quick = true;
    } else {
      throw std::invalid_argument(
          "unknown argument " + arg +
          "; expected --device sim|cuda|auto, --scenarios, --tensors, --chunks, --chunk-bytes, "
          "--samples, --warmup, --move-chunk-bytes, --move-chunks, --move-steps, --sim-bandwidth, "
          "--compute-us, --quick");
    }
  }
  if (quick) {
    // Same 10k tensors in 200 chunks, small chunks and few samples.
    args.chunk_bytes = std::size_t{64} << 10;
    args.samples = 3;
    args.warmup = 1;
    args.move_chunk_bytes = std::size_t{4} << 20;
    args.move_chunks = 6;
    args.move_steps = 2;
  }
  if (args.samples < 1 || args.warmup < 0 || args.tensors < args.chunks || args.chunks < 2 ||
      args.move_chunks < 2 || args.move_steps < 1) {
    throw std::invalid_argument(
        "need --samples >= 1, --warmup >= 0, --chunks >= 2, --tensors >= --chunks, "
        "--move-chunks >= 2, --move-steps >= 1");
  }
  return args;
}

struct Summary {
  std::vector<double> samples;
  double median = 0, min = 0, max = 0;
};

Summary summarize(std::vector<double> samples) {
  Summary s;
  s.samples = samples;
  std::sort(samples.begin(), samples.end());
  s.min = samples.front();
  s.max = samples.back();
  const std::size_t n = samples.size();
  s.median = n % 2 ? samples[n / 2] : 0.5 * (samples[n / 2 - 1] + samples[n / 2]);
  return s;
}

std::string json_number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.6g", v);
  return buf;
}

std::string json_summary(const Summary& s, const char* unit) {
  std::string out = "{\"unit\": \"" + std::string(unit) + "\", \"median\": " + json_number(s.median) +
                    ", \"min\": " + json_number(s.min) + ", \"max\": " + json_number(s.max) +
                    ", \"samples\": [";
  for (std::size_t i = 0; i < s.samples.size(); ++i) {
    out += (i ? ", " : "") + json_number(s.samples[i]);
  }
  return out + "]}";
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

void spin_for(double seconds) {
  const auto end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                      std::chrono::duration<double>(seconds));
  while (Clock::now() < end) {
  }
}

// ---- bookkeeping ------------------------------------------------------------

// Tensors of one size, tensors/chunks of them filling each chunk exactly:
// the chunk holds per_chunk * numel elements, numel a multiple of the
// alignment, with numel as large as --chunk-bytes allows.
std::size_t bookkeeping_chunk_bytes(const Args& args) {
  const std::size_t per_chunk = (args.tensors + args.chunks - 1) / args.chunks;
  const std::size_t numel = args.chunk_bytes / 2 / per_chunk / 32 * 32;
  if (numel == 0) throw std::invalid_argument("--chunk-bytes too small for that many tensors per chunk");
  return numel * per_chunk * 2;
}

tidal::ChunkStore bookkeeping_store(const Args& args) {
  tidal::ChunkStore store({.chunk_bytes = bookkeeping_chunk_bytes(args)});
  const std::size_t per_chunk = (args.tensors + args.chunks - 1) / args.chunks;
  const std::size_t numel = store.chunk_elements() / per_chunk;
  for (std::size_t i = 0; i < args.tensors; ++i) store.register_tensor(indexed_name("t", i), numel);
  if (store.num_chunks() != args.chunks) {
    throw std::runtime_error(std::string("layout gave ") + std::to_string(store.num_chunks()) + " chunks, wanted " +
                             std::to_string(args.chunks));
  }
  return store;
}

struct StepResult {
  double seconds = 0;
  std::size_t pairs = 0;
};

// One forward (in order) and backward (reversed) pass over every tensor.
StepResult scheduler_step(tidal::ChunkScheduler& s, std::size_t tensors) {
  const auto start = Clock::now();
  for (std::size_t t = 0; t < tensors; ++t) {
    const tidal::TensorRef ref{ChunkKind::kParam16, static_cast<tidal::TensorId>(t)};
    s.access(ref, MemorySpace::kDevice);
    s.release(ref, TensorState::kHoldAfterFwd);
  }
  for (std::size_t t = tensors; t-- > 0;) {
    const tidal::TensorRef ref{ChunkKind::kParam16, static_cast<tidal::TensorId>(t)};
    s.access(ref, MemorySpace::kDevice);
    s.release(ref, TensorState::kHoldAfterBwd);
  }
  s.end_step();
  return {seconds_since(start), 2 * tensors};
}

Summary measure_scheduler(const Args& args, std::shared_ptr<tidal::Device> device, bool use_trace,
                          std::size_t budget_chunks, tidal::ChunkSchedulerStats* stats_out) {
  tidal::ChunkSchedulerOptions options;
  options.use_trace = use_trace;
  options.prefetch = use_trace;
  options.device_budget_bytes = budget_chunks * bookkeeping_chunk_bytes(args);
  tidal::ChunkScheduler s(bookkeeping_store(args), std::move(device), options);
  scheduler_step(s, args.tensors);  // creates the payloads, records the trace
  for (int i = 0; i < args.warmup; ++i) scheduler_step(s, args.tensors);
  s.reset_stats();
  std::vector<double> ns;
  for (int i = 0; i < args.samples; ++i) {
    const StepResult r = scheduler_step(s, args.tensors);
    ns.push_back(r.seconds * 1e9 / static_cast<double>(r.pairs));
  }
  if (stats_out) *stats_out = s.stats();
  return summarize(ns);
}

// The floor: the same loop with a state byte and an address per tensor.
Summary measure_floor(const Args& args) {
  const tidal::ChunkStore store = bookkeeping_store(args);
  std::vector<std::uint8_t> state(args.tensors, 0);
  std::vector<char*> base(args.chunks);
  std::vector<char> arena(args.chunks * 64);
  for (std::size_t c = 0; c < args.chunks; ++c) base[c] = arena.data() + 64 * c;
  std::vector<std::uint32_t> chunk_of(args.tensors);
  std::vector<std::size_t> offset(args.tensors);
  for (std::size_t t = 0; t < args.tensors; ++t) {
    chunk_of[t] = store.placement(static_cast<tidal::TensorId>(t)).chunk;
    offset[t] = store.placement(static_cast<tidal::TensorId>(t)).offset % 64;
  }
  volatile std::uintptr_t sink = 0;
  auto step = [&] {
    const auto start = Clock::now();
    for (int pass = 0; pass < 2; ++pass) {
      for (std::size_t k = 0; k < args.tensors; ++k) {
        const std::size_t t = pass == 0 ? k : args.tensors - 1 - k;
        state[t] = 1;
        sink = sink + reinterpret_cast<std::uintptr_t>(base[chunk_of[t]] + offset[t]);
        state[t] = static_cast<std::uint8_t>(3 + pass);
      }
    }
    return seconds_since(start) * 1e9 / static_cast<double>(2 * args.tensors);
  };
  for (int i = 0; i < args.warmup + 1; ++i) step();
  std::vector<double> ns;
  for (int i = 0; i < args.samples; ++i) ns.push_back(step());
  return summarize(ns);
}

std::string run_bookkeeping(const Args& args, const std::shared_ptr<tidal::Device>& device) {
  tidal::ChunkSchedulerStats traced_stats, lru_stats, moving_stats;
  const Summary traced = measure_scheduler(args, device, true, args.chunks, &traced_stats);
  const Summary lru = measure_scheduler(args, device, false, args.chunks, &lru_stats);
  const Summary moving = measure_scheduler(args, device, true, args.chunks / 2, &moving_stats);
  const Summary floor = measure_floor(args);
  // Sanity: with every chunk resident nothing may move, and every timed
  // step must have followed the trace.
  if (traced_stats.moves_host_to_device + traced_stats.moves_device_to_host != 0 ||
      traced_stats.trace_divergences != 0 || traced_stats.misses != 0 ||
      lru_stats.misses != 0 || moving_stats.accesses != 2 * args.tensors * args.samples) {
    throw std::runtime_error("bookkeeping sanity check failed: a resident run moved chunks, "
                             "departed from its trace, or an access went missing");
  }
  const double moves_per_step = static_cast<double>(moving_stats.moves_host_to_device +
                                                    moving_stats.moves_device_to_host) /
                                args.samples;
  std::string out = "{\n    \"tensors\": " + std::to_string(args.tensors) +
                    ", \"chunks\": " + std::to_string(args.chunks) +
                    ", \"chunk_bytes\": " + std::to_string(bookkeeping_chunk_bytes(args)) +
                    ", \"pairs_per_sample\": " + std::to_string(2 * args.tensors) + ",\n";
  out += "    \"resident_trace_opt_prefetch\": " + json_summary(traced, "ns per access+release") + ",\n";
  out += "    \"resident_no_trace_lru\": " + json_summary(lru, "ns per access+release") + ",\n";
  out += "    \"half_budget_with_moves\": " + json_summary(moving, "ns per access+release") +
         ", \"half_budget_moves_per_step\": " + json_number(moves_per_step) +
         ", \"half_budget_prefetch_hits\": " + std::to_string(moving_stats.prefetch_hits) +
         ", \"half_budget_misses\": " + std::to_string(moving_stats.misses) + ",\n";
  out += "    \"peer_floor\": " + json_summary(floor, "ns per access+release") +
         ", \"peer\": \"state byte + address per tensor, nothing else\",\n";
  out += "    \"hit_check\": {\"resident_trace_hits\": " +
         std::to_string(traced_stats.hits + traced_stats.prefetch_hits) +
         ", \"resident_trace_moves\": " +
         std::to_string(traced_stats.moves_host_to_device + traced_stats.moves_device_to_host) +
         ", \"resident_trace_followed_steps\": " +
         std::to_string(traced_stats.steps - traced_stats.trace_divergences) + "},\n";
  out += "    \"ratio_resident_trace_over_floor\": " + json_number(traced.median / floor.median) + "\n  }";
  return out;
}

// ---- moves and prefetch ----------------------------------------------------

struct CycleResult {
  double seconds_per_step = 0;
  tidal::ChunkSchedulerStats stats;
};

// Forward over N chunks and backward again, with room for N/2 of them: the
// trace of a training step whose parameters do not fit the device.
CycleResult run_cycle(const Args& args, const std::shared_ptr<tidal::Device>& device, bool prefetch,
                      double compute_s) {
  tidal::ChunkStore store({.chunk_bytes = args.move_chunk_bytes});
  for (std::size_t i = 0; i < args.move_chunks; ++i) {
    store.register_tensor(indexed_name("c", i), store.chunk_elements());
  }
  tidal::ChunkSchedulerOptions options;
  options.device_budget_bytes = args.move_chunks / 2 * args.move_chunk_bytes;
  options.prefetch = prefetch;
  options.prefetch_depth = 2;
  tidal::ChunkScheduler s(std::move(store), device, options);
  auto use = [&](std::size_t t, TensorState after) {
    const tidal::TensorRef ref{ChunkKind::kParam16, static_cast<tidal::TensorId>(t)};
    s.access(ref, MemorySpace::kDevice);
    if (compute_s > 0) spin_for(compute_s);
    s.release(ref, after);
  };
  auto step = [&] {
    for (std::size_t t = 0; t < args.move_chunks; ++t) use(t, TensorState::kHoldAfterFwd);
    for (std::size_t t = args.move_chunks; t-- > 0;) use(t, TensorState::kHoldAfterBwd);
    s.end_step();
  };
  step();  // creates payloads, records the trace
  step();  // reaches the steady state
  s.device().synchronize();
  s.reset_stats();
  const auto start = Clock::now();
  for (int i = 0; i < args.move_steps; ++i) step();
  s.device().synchronize();
  const double seconds = seconds_since(start);
  CycleResult r;
  r.stats = s.stats();
  r.seconds_per_step = seconds / args.move_steps;
  return r;
}

struct PhaseRates {
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
};

// N chunks to the device, then the same N back to the host, `move_steps`
// times; each phase timed on its own.
PhaseRates run_pingpong(const Args& args, const std::shared_ptr<tidal::Device>& device,
                        tidal::ChunkSchedulerStats* stats_out) {
  tidal::ChunkStore store({.chunk_bytes = args.move_chunk_bytes});
  for (std::size_t i = 0; i < args.move_chunks; ++i) {
    store.register_tensor(indexed_name("c", i), store.chunk_elements());
  }
  tidal::ChunkSchedulerOptions options;
  options.device_budget_bytes = args.move_chunks * args.move_chunk_bytes;
  options.prefetch_depth = 2;
  tidal::ChunkScheduler s(std::move(store), device, options);
  double h2d_seconds = 0, d2h_seconds = 0;
  auto phase = [&](MemorySpace space) {
    const auto start = Clock::now();
    for (std::size_t t = 0; t < args.move_chunks; ++t) {
      const tidal::TensorRef ref{ChunkKind::kParam16, static_cast<tidal::TensorId>(t)};
      s.access(ref, space);
      s.release(ref, TensorState::kHold);
    }
    return seconds_since(start);
  };
  for (int i = 0; i < 2; ++i) {  // creates payloads, records the trace, warms up
    phase(MemorySpace::kDevice);
    phase(MemorySpace::kHost);
    s.end_step();
  }
  s.reset_stats();
  for (int i = 0; i < args.move_steps; ++i) {
    h2d_seconds += phase(MemorySpace::kDevice);
    d2h_seconds += phase(MemorySpace::kHost);
    s.end_step();
  }
  s.device().synchronize();
  *stats_out = s.stats();
  PhaseRates r;
  r.h2d_bytes_per_s = static_cast<double>(stats_out->bytes_host_to_device) / h2d_seconds;
  r.d2h_bytes_per_s = static_cast<double>(stats_out->bytes_device_to_host) / d2h_seconds;
  return r;
}

struct PeerResult {
  PhaseRates rates;
  std::string name;
};

// `copies` chunk copies host to device, then as many back, one stream.
PeerResult device_layer_peer(const Args& args, tidal::Device& device, std::size_t copies) {
  const std::size_t bytes = args.move_chunk_bytes;
  tidal::HostBuffer host(bytes, device.shared_from_this());
  tidal::DeviceBuffer dev = device.allocate(bytes);
  std::memset(host.data(), 1, bytes);
  auto stream = device.create_stream("peer");
  auto run = [&](tidal::CopyKind kind) {
    const bool h2d = kind == tidal::CopyKind::kHostToDevice;
    const auto start = Clock::now();
    for (std::size_t i = 0; i < copies; ++i) {
      device.copy_async(h2d ? dev.data() : host.data(), h2d ? host.data() : dev.data(), bytes, kind,
                        *stream);
    }
    stream->synchronize();
    return static_cast<double>(bytes * copies) / seconds_since(start);
  };
  run(tidal::CopyKind::kHostToDevice);  // warm-up: first touch of every page
  PeerResult r;
  r.rates.h2d_bytes_per_s = run(tidal::CopyKind::kHostToDevice);
  r.rates.d2h_bytes_per_s = run(tidal::CopyKind::kDeviceToHost);
  r.name = "tidal device layer copy_async loop on one stream";
  return r;
}

#if defined(TIDAL_WITH_CUDA)
void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// The peer the issue names: plain cudaMemcpyAsync on cudaMallocHost memory.
PeerResult cuda_peer(const Args& args, std::size_t copies) {
  const std::size_t bytes = args.move_chunk_bytes;
  void* host = nullptr;
  void* dev = nullptr;
  cudaStream_t stream = nullptr;
  cuda_check(cudaMallocHost(&host, bytes), "cudaMallocHost");
  cuda_check(cudaMalloc(&dev, bytes), "cudaMalloc");
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  std::memset(host, 1, bytes);
  auto run = [&](bool h2d) {
    const auto start = Clock::now();
    for (std::size_t i = 0; i < copies; ++i) {
      cuda_check(cudaMemcpyAsync(h2d ? dev : host, h2d ? host : dev, bytes,
                                 h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync");
    }
    cuda_check(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    return static_cast<double>(bytes * copies) / seconds_since(start);
  };
  run(true);  // warm-up
  PeerResult r;
  r.rates.h2d_bytes_per_s = run(true);
  r.rates.d2h_bytes_per_s = run(false);
  cudaStreamDestroy(stream);
  cudaFree(dev);
  cudaFreeHost(host);
  r.name = "cudaMemcpyAsync loop on cudaMallocHost memory, one stream";
  return r;
}
#endif

std::string run_moves(const Args& args, const std::shared_ptr<tidal::Device>& device) {
  std::vector<double> h2d, d2h, peer_h2d, peer_d2h;
  std::string peer_name;
  tidal::ChunkSchedulerStats stats;
  for (int sample = 0; sample < std::max(3, args.samples / 10); ++sample) {
    const PhaseRates ours = run_pingpong(args, device, &stats);
    h2d.push_back(ours.h2d_bytes_per_s);
    d2h.push_back(ours.d2h_bytes_per_s);
    const std::size_t copies = args.move_chunks * args.move_steps;
    PeerResult peer;
#if defined(TIDAL_WITH_CUDA)
    if (device->backend() == tidal::DeviceBackend::kCuda) peer = cuda_peer(args, copies);
#endif
    if (peer.name.empty()) peer = device_layer_peer(args, *device, copies);
    peer_name = peer.name;
    peer_h2d.push_back(peer.rates.h2d_bytes_per_s);
    peer_d2h.push_back(peer.rates.d2h_bytes_per_s);
  }
  const Summary a = summarize(h2d), b = summarize(d2h), pa = summarize(peer_h2d), pb = summarize(peer_d2h);
  std::string out = "{\n    \"chunk_bytes\": " + std::to_string(args.move_chunk_bytes) +
                    ", \"chunks\": " + std::to_string(args.move_chunks) +
                    ", \"steps_per_sample\": " + std::to_string(args.move_steps) +
                    ", \"moves_h2d_per_sample\": " + std::to_string(stats.moves_host_to_device) +
                    ", \"moves_d2h_per_sample\": " + std::to_string(stats.moves_device_to_host) +
                    ", \"prefetch_hits_per_sample\": " + std::to_string(stats.prefetch_hits) +
                    ", \"misses_per_sample\": " + std::to_string(stats.misses) + ",\n";
  out += "    \"tidal_h2d\": " + json_summary(a, "bytes/s") + ",\n";
  out += "    \"tidal_d2h\": " + json_summary(b, "bytes/s") + ",\n";
  out += "    \"peer_h2d\": " + json_summary(pa, "bytes/s") + ",\n";
  out += "    \"peer_d2h\": " + json_summary(pb, "bytes/s") + ",\n";
  out += "    \"peer\": \"" + peer_name + "\",\n";
  out += "    \"ratio_h2d\": " + json_number(a.median / pa.median) +
         ", \"ratio_d2h\": " + json_number(b.median / pb.median) + "\n  }";
  return out;
}

std::string run_prefetch(const Args& args, const std::shared_ptr<tidal::Device>& device) {
  // One chunk's transfer time per access unless told otherwise: the case
  // where prefetch can hide every copy.
  double bandwidth = device->info().copy_bandwidth_bytes_per_s;
  if (bandwidth <= 0) bandwidth = 25e9;  // CUDA: about PCIe 4 x16 each way
  const double compute_s =
      args.compute_us > 0 ? args.compute_us * 1e-6 : static_cast<double>(args.move_chunk_bytes) / bandwidth;
  std::vector<double> on, off;
  tidal::ChunkSchedulerStats on_stats, off_stats;
  for (int sample = 0; sample < std::max(3, args.samples / 10); ++sample) {
    CycleResult a = run_cycle(args, device, true, compute_s);
    CycleResult b = run_cycle(args, device, false, compute_s);
    on.push_back(a.seconds_per_step);
    off.push_back(b.seconds_per_step);
    on_stats = a.stats;
    off_stats = b.stats;
  }
  const Summary a = summarize(on), b = summarize(off);
  std::string out = "{\n    \"compute_seconds_per_access\": " + json_number(compute_s) +
                    ", \"chunk_bytes\": " + std::to_string(args.move_chunk_bytes) +
                    ", \"chunks\": " + std::to_string(args.move_chunks) +
                    ", \"budget_chunks\": " + std::to_string(args.move_chunks / 2) + ",\n";
  out += "    \"prefetch_on\": " + json_summary(a, "seconds per step") +
         ", \"prefetch_on_hits\": " + std::to_string(on_stats.prefetch_hits) +
         ", \"prefetch_on_misses\": " + std::to_string(on_stats.misses) + ",\n";
  out += "    \"prefetch_off\": " + json_summary(b, "seconds per step") +
         ", \"prefetch_off_misses\": " + std::to_string(off_stats.misses) + ",\n";
  out += "    \"speedup_on_over_off\": " + json_number(b.median / a.median) + "\n  }";
  return out;
}

int run(const Args& args) {
  tidal::SimDeviceOptions sim;
  sim.copy_bandwidth_bytes_per_s = args.sim_bandwidth;
  const std::size_t book_bytes = args.chunks * bookkeeping_chunk_bytes(args);
  const std::size_t move_bytes = (args.move_chunks / 2 + 2) * args.move_chunk_bytes;
  sim.capacity_bytes = std::max(book_bytes, move_bytes) + (std::size_t{64} << 20);
  auto device = tidal::create_device(tidal::parse_device_kind(args.device), sim);
  const tidal::DeviceInfo info = device->info();
  // The bookkeeping figure must not include simulated link time: it runs on
  // an unlimited simulated link (only its "with moves" line moves data).
  std::shared_ptr<tidal::Device> book_device = device;
  if (info.backend == tidal::DeviceBackend::kSimulated) {
    tidal::SimDeviceOptions unlimited = sim;
    unlimited.copy_bandwidth_bytes_per_s = 0;
    unlimited.capacity_bytes = book_bytes + (std::size_t{64} << 20);
    book_device = tidal::make_sim_device(unlimited);
  }
  std::string scenarios;
  auto want = [&](const char* name) { return args.scenarios.find(name) != std::string::npos; };
  if (want("bookkeeping")) scenarios += "  \"bookkeeping\": " + run_bookkeeping(args, book_device);
  if (want("moves")) scenarios += std::string(scenarios.empty() ? "" : ",\n") + "  \"moves\": " + run_moves(args, device);
  if (want("prefetch")) {
    scenarios += std::string(scenarios.empty() ? "" : ",\n") + "  \"prefetch\": " + run_prefetch(args, device);
  }
#if defined(NDEBUG)
  const bool ndebug = true;
#else
  const bool ndebug = false;
#endif
#if defined(TIDAL_DEBUG_FULL)
  const bool debug_full = true;
#else
  const bool debug_full = false;
#endif
  std::printf(
      "{\n  \"build\": {\"ndebug\": %s, \"tidal_debug_full\": %s},\n"
      "  \"device\": {\"backend\": \"%s\", \"name\": \"%s\", \"memory_bytes\": %zu, "
      "\"pinned_host_memory\": %s, \"sim_copy_bandwidth_bytes_per_s\": %s},\n"
      "  \"simulated\": %s,\n%s\n}\n",
      ndebug ? "true" : "false", debug_full ? "true" : "false",
      tidal::to_string(info.backend), info.name.c_str(), info.total_memory_bytes,
      info.pinned_host_memory ? "true" : "false", json_number(info.copy_bandwidth_bytes_per_s).c_str(),
      info.backend == tidal::DeviceBackend::kSimulated ? "true" : "false", scenarios.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tidal_bench_chunk_bookkeeping: %s\n", e.what());
    return 2;
  }
}
