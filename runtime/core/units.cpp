#include "runtime/core/units.h"

#include <cctype>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>

#include "runtime/core/error.h"

namespace tidal {
namespace {

constexpr const char* kAcceptedForms =
    "expected a non-negative number with an optional unit: B, KB/MB/GB/TB (powers of 1000) or "
    "KiB/MiB/GiB/TiB (powers of 1024), e.g. \"64MiB\" or \"5GB\"";

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

double unit_multiplier(std::string_view original, std::string_view unit_text) {
  const std::string unit = lower(trim(unit_text));
  if (unit.empty() || unit == "b") return 1.0;
  static constexpr struct {
    const char* si;
    const char* si_short;
    const char* iec;
    int power;
  } kUnits[] = {{"kb", "k", "kib", 1}, {"mb", "m", "mib", 2}, {"gb", "g", "gib", 3}, {"tb", "t", "tib", 4}};
  for (const auto& u : kUnits) {
    if (unit == u.si || unit == u.si_short) return std::pow(1000.0, u.power);
    if (unit == u.iec) return std::pow(1024.0, u.power);
  }
  TIDAL_THROW(ValueError, "invalid byte size \"", original, "\": unknown unit \"", trim(unit_text),
              "\"; ", kAcceptedForms);
}

}  // namespace

std::size_t parse_bytes(std::string_view text) {
  const std::string_view s = trim(text);
  TIDAL_CHECK(!s.empty(), "invalid byte size \"", text, "\": empty; ", kAcceptedForms);
  std::size_t number_end = 0;
  while (number_end < s.size() &&
         (std::isdigit(static_cast<unsigned char>(s[number_end])) || s[number_end] == '.')) {
    ++number_end;
  }
  TIDAL_CHECK(number_end > 0, "invalid byte size \"", text, "\": ", kAcceptedForms);
  const std::string number(s.substr(0, number_end));
  char* parse_end = nullptr;
  const double value = std::strtod(number.c_str(), &parse_end);
  TIDAL_CHECK(parse_end == number.c_str() + number.size() && std::isfinite(value),
              "invalid byte size \"", text, "\": \"", number, "\" is not a number; ", kAcceptedForms);
  const double bytes = value * unit_multiplier(text, s.substr(number_end));
  TIDAL_CHECK(bytes < static_cast<double>(std::numeric_limits<std::size_t>::max()),
              "invalid byte size \"", text, "\": too large");
  TIDAL_CHECK(bytes == std::floor(bytes), "invalid byte size \"", text, "\": ", bytes,
              " is not a whole number of bytes");
  return static_cast<std::size_t>(bytes);
}

double parse_bandwidth(std::string_view text) {
  std::string_view s = trim(text);
  TIDAL_CHECK(s.size() > 2 && (s.substr(s.size() - 2) == "/s" || s.substr(s.size() - 2) == "/S"),
              "invalid bandwidth \"", text, "\": expected a byte size per second such as \"12GB/s\"");
  return static_cast<double>(parse_bytes(s.substr(0, s.size() - 2)));
}

}  // namespace tidal
