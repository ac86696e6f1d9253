#include "runtime/core/error.h"

#include <cstdio>

namespace tidal {
namespace {

// Keeps paths in messages short: "runtime/device/sim_device.cpp", not the
// absolute path of whoever built the library.
std::string_view strip_source_root(std::string_view file) {
  for (std::string_view root : {"/runtime/", "/chunk/", "/cpu_adam/", "/hooks/", "/python/"}) {
    auto pos = file.rfind(root);
    if (pos != std::string_view::npos) return file.substr(pos + 1);
  }
  return file;
}

std::string with_location(const std::string& message, const char* file, int line) {
  return detail::str_cat(message, " [", strip_source_root(file), ":", line, "]");
}

}  // namespace

Error::Error(std::string message, const char* file, int line)
    : std::runtime_error(with_location(message, file, line)), message_(std::move(message)) {}

namespace detail {

void throw_internal(const char* condition, const char* file, int line,
                    const std::string& detail) {
  std::string message = str_cat("internal error: `", condition, "` failed");
  if (!detail.empty()) message += str_cat(": ", detail);
  message += ". This is a bug in tidal; please report it with this message.";
  throw InternalError(std::move(message), file, line);
}

}  // namespace detail

std::string format_bytes(std::size_t bytes) {
  static constexpr const char* kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double value = static_cast<double>(bytes);
  int unit = 0;
  while (value >= 1024.0 && unit < 4) {
    value /= 1024.0;
    ++unit;
  }
  char buf[64];
  if (unit == 0) {
    std::snprintf(buf, sizeof(buf), "%zu bytes", bytes);
  } else {
    std::snprintf(buf, sizeof(buf), "%.2f %s (%zu bytes)", value, kUnits[unit], bytes);
  }
  return buf;
}

}  // namespace tidal
