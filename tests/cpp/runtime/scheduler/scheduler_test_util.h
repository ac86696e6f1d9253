// Helpers shared by the chunk-scheduler tests: small models on a small
// simulated device, and byte patterns to check data after moves.
#pragma once

#include <cstddef>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "chunk/chunk_store.h"
#include "runtime/device/sim_device.h"
#include "runtime/scheduler/chunk_scheduler.h"

namespace tidal::testing {

constexpr std::size_t kKiB = 1024;

// "t" + std::to_string(i) makes GCC 12 at -O3 warn falsely (-Wrestrict,
// GCC bug 105329); appending to a named string does not.
inline std::string indexed_name(const char* prefix, std::size_t i) {
  std::string name(prefix);
  name.append(std::to_string(i));
  return name;
}

// A store with one tensor per size, named t0, t1, ...
inline ChunkStore make_store(const std::vector<std::size_t>& numels, std::size_t chunk_bytes) {
  ChunkStore store({.chunk_bytes = chunk_bytes});
  for (std::size_t i = 0; i < numels.size(); ++i) {
    store.register_tensor(indexed_name("t", i), numels[i]);
  }
  return store;
}

inline std::shared_ptr<Device> make_device(std::size_t capacity_bytes, double bandwidth = 0) {
  return make_sim_device(
      {.capacity_bytes = capacity_bytes, .copy_bandwidth_bytes_per_s = bandwidth});
}

// Bytes derived from (seed, salt): writes and later checks agree on them.
inline std::vector<unsigned char> pattern(std::size_t bytes, unsigned seed) {
  std::mt19937 rng(seed);
  std::vector<unsigned char> out(bytes);
  for (auto& b : out) b = static_cast<unsigned char>(rng());
  return out;
}

inline void write_pattern(void* dst, std::size_t bytes, unsigned seed) {
  const auto p = pattern(bytes, seed);
  std::memcpy(dst, p.data(), bytes);
}

inline bool has_pattern(const void* src, std::size_t bytes, unsigned seed) {
  const auto p = pattern(bytes, seed);
  return std::memcmp(src, p.data(), bytes) == 0;
}

}  // namespace tidal::testing
