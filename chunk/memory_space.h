// Where a chunk's payload lives. A chunk is in exactly one memory space at a
// time; kNone means it holds no payload (all its tensors are FREE, or it was
// never materialized). kDisk: the payload is in the scheduler's file on a
// disk (Note [Chunks on NVMe: the tier] in runtime/scheduler/disk_tier.h);
// nothing computes on it there, so its address is a token, not memory.
#pragma once

#include <cstddef>
#include <cstdint>

namespace tidal {

enum class MemorySpace : std::uint8_t { kNone = 0, kHost = 1, kDevice = 2, kDisk = 3 };

// Number of MemorySpace values, for arrays indexed by space.
inline constexpr std::size_t kNumMemorySpaces = 4;

constexpr std::size_t index_of(MemorySpace space) { return static_cast<std::size_t>(space); }

constexpr const char* to_string(MemorySpace space) {
  switch (space) {
    case MemorySpace::kNone:
      return "none";
    case MemorySpace::kHost:
      return "host";
    case MemorySpace::kDevice:
      return "device";
    case MemorySpace::kDisk:
      return "disk";
  }
  return "unknown memory space";
}

}  // namespace tidal
