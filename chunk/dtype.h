// Element types a chunk list stores. The chunk store deals in raw bytes and
// element counts; DType only says how many bytes an element takes and how to
// name it in messages. No libtorch here (see docs/architecture.md).
#pragma once

#include <cstddef>
#include <cstdint>

namespace tidal {

enum class DType : std::uint8_t { kFloat16, kBFloat16, kFloat32 };

constexpr std::size_t element_size(DType dtype) {
  return dtype == DType::kFloat32 ? 4 : 2;
}

constexpr const char* to_string(DType dtype) {
  switch (dtype) {
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
    case DType::kFloat32:
      return "float32";
  }
  return "unknown dtype";
}

}  // namespace tidal
