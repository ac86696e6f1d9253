// Host<->device copy bandwidth for chunk-sized transfers: tidal's device layer
// against a peer in the same run. On CUDA the peer is a plain
// cudaMemcpyAsync loop on cudaMallocHost memory (the limit chunk traffic can
// reach); on the simulated device it is a plain memcpy loop (the cost of the
// simulation itself). Prints one JSON object; benchmarks/device_bandwidth.py
// adds the machine description and writes the result file.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "runtime/core/error.h"
#include "runtime/core/units.h"
#include "runtime/device/select.h"
#include "runtime/memory/host_buffer.h"

#if defined(TIDAL_WITH_CUDA)
#include <cuda_runtime_api.h>
#endif

namespace {

using tidal::CopyKind;

struct Args {
  std::string device = "auto";
  std::size_t bytes = std::size_t{64} << 20;
  int iters = 20;     // copies per sample
  int samples = 7;    // timed repetitions
  int warmup = 2;
};

Args parse_args(int argc, char** argv) {
  Args args;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) throw std::invalid_argument("missing value after " + arg);
      return argv[++i];
    };
    if (arg == "--device") {
      args.device = value();
    } else if (arg == "--bytes") {
      args.bytes = tidal::parse_bytes(value());
    } else if (arg == "--iters") {
      args.iters = std::stoi(value());
    } else if (arg == "--samples") {
      args.samples = std::stoi(value());
    } else if (arg == "--warmup") {
      args.warmup = std::stoi(value());
    } else if (arg == "--quick") {
      args.bytes = std::size_t{8} << 20;
      args.iters = 4;
      args.samples = 3;
      args.warmup = 1;
    } else {
      throw std::invalid_argument("unknown argument " + arg +
                                  "; expected --device, --bytes, --iters, --samples, --warmup, --quick");
    }
  }
  if (args.iters < 1 || args.samples < 1 || args.warmup < 0) {
    throw std::invalid_argument("--iters and --samples must be >= 1, --warmup >= 0");
  }
  return args;
}

// Bytes per second of `iters` copies, timed with the device's own events.
double tidal_sample(tidal::Device& device, tidal::Stream& stream, void* dst, const void* src,
                    const Args& args, CopyKind kind) {
  auto start = device.create_event(true);
  auto end = device.create_event(true);
  start->record(stream);
  for (int i = 0; i < args.iters; ++i) device.copy_async(dst, src, args.bytes, kind, stream);
  end->record(stream);
  end->synchronize();
  return static_cast<double>(args.bytes) * args.iters / end->elapsed_seconds_since(*start);
}

std::string json_list(const std::vector<double>& values) {
  std::string out = "[";
  for (std::size_t i = 0; i < values.size(); ++i) {
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%s%.6g", i ? ", " : "", values[i]);
    out += buf;
  }
  return out + "]";
}

#if defined(TIDAL_WITH_CUDA)
void cuda_check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
  }
}

// The peer: nothing but cudaMemcpyAsync on page-locked memory.
std::vector<double> cuda_peer(const Args& args, CopyKind kind) {
  void* host = nullptr;
  void* dev = nullptr;
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
  cuda_check(cudaMallocHost(&host, args.bytes), "cudaMallocHost");
  cuda_check(cudaMalloc(&dev, args.bytes), "cudaMalloc");
  cuda_check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  cuda_check(cudaEventCreate(&start), "cudaEventCreate");
  cuda_check(cudaEventCreate(&end), "cudaEventCreate");
  std::memset(host, 1, args.bytes);
  const bool h2d = kind == CopyKind::kHostToDevice;
  auto run = [&] {
    cuda_check(cudaEventRecord(start, stream), "cudaEventRecord");
    for (int i = 0; i < args.iters; ++i) {
      cuda_check(cudaMemcpyAsync(h2d ? dev : host, h2d ? host : dev, args.bytes,
                                 h2d ? cudaMemcpyHostToDevice : cudaMemcpyDeviceToHost, stream),
                 "cudaMemcpyAsync");
    }
    cuda_check(cudaEventRecord(end, stream), "cudaEventRecord");
    cuda_check(cudaEventSynchronize(end), "cudaEventSynchronize");
    float ms = 0;
    cuda_check(cudaEventElapsedTime(&ms, start, end), "cudaEventElapsedTime");
    return static_cast<double>(args.bytes) * args.iters / (ms * 1e-3);
  };
  for (int i = 0; i < args.warmup; ++i) run();
  std::vector<double> out;
  for (int i = 0; i < args.samples; ++i) out.push_back(run());
  cudaEventDestroy(start);
  cudaEventDestroy(end);
  cudaStreamDestroy(stream);
  cudaFree(dev);
  cudaFreeHost(host);
  return out;
}
#endif

// The peer on the simulated device: plain memcpy between two host buffers.
std::vector<double> memcpy_peer(const Args& args) {
  tidal::HostBuffer a(args.bytes);
  tidal::HostBuffer b(args.bytes);
  std::memset(a.data(), 1, args.bytes);
  std::memset(b.data(), 2, args.bytes);
  auto run = [&] {
    const auto t0 = std::chrono::steady_clock::now();
    for (int i = 0; i < args.iters; ++i) std::memcpy(b.data(), a.data(), args.bytes);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    return static_cast<double>(args.bytes) * args.iters / s;
  };
  for (int i = 0; i < args.warmup; ++i) run();
  std::vector<double> out;
  for (int i = 0; i < args.samples; ++i) out.push_back(run());
  return out;
}

int run(const Args& args) {
  auto device = tidal::create_device(tidal::parse_device_kind(args.device));
  const tidal::DeviceInfo info = device->info();
  auto stream = device->create_stream("bench");
  tidal::HostBuffer host(args.bytes, device);
  std::memset(host.data(), 1, args.bytes);
  tidal::DeviceBuffer dev = device->allocate(args.bytes);

  std::string directions;
  for (CopyKind kind : {CopyKind::kHostToDevice, CopyKind::kDeviceToHost}) {
    const bool h2d = kind == CopyKind::kHostToDevice;
    void* dst = h2d ? dev.data() : host.data();
    const void* src = h2d ? host.data() : dev.data();
    for (int i = 0; i < args.warmup; ++i) tidal_sample(*device, *stream, dst, src, args, kind);
    std::vector<double> ours;
    for (int i = 0; i < args.samples; ++i) ours.push_back(tidal_sample(*device, *stream, dst, src, args, kind));
    std::vector<double> peer;
    std::string peer_name;
#if defined(TIDAL_WITH_CUDA)
    if (info.backend == tidal::DeviceBackend::kCuda) {
      peer = cuda_peer(args, kind);
      peer_name = "cudaMemcpyAsync loop, cudaMallocHost memory";
    }
#endif
    if (peer.empty()) {
      peer = memcpy_peer(args);
      peer_name = "memcpy loop between host buffers";
    }
    directions += std::string(directions.empty() ? "" : ",\n") + "    \"" + (h2d ? "h2d" : "d2h") +
                  "\": {\"tidal_bytes_per_s\": " + json_list(ours) +
                  ", \"peer_bytes_per_s\": " + json_list(peer) + ", \"peer\": \"" + peer_name + "\"}";
  }
  std::printf(
      "{\n  \"backend\": \"%s\",\n  \"device_name\": \"%s\",\n  \"device_memory_bytes\": %zu,\n"
      "  \"pinned\": %s,\n  \"sim_copy_bandwidth_bytes_per_s\": %.6g,\n  \"transfer_bytes\": %zu,\n"
      "  \"copies_per_sample\": %d,\n  \"directions\": {\n%s\n  }\n}\n",
      tidal::to_string(info.backend), info.name.c_str(), info.total_memory_bytes,
      host.pinned() ? "true" : "false", info.copy_bandwidth_bytes_per_s, args.bytes, args.iters,
      directions.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(parse_args(argc, argv));
  } catch (const std::exception& e) {
    std::fprintf(stderr, "tidal_bench_device_bandwidth: %s\n", e.what());
    return 2;
  }
}
