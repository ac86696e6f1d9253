#include "runtime/core/units.h"

#include <gtest/gtest.h>

#include <string>

#include "runtime/core/error.h"

namespace tidal {
namespace {

TEST(ParseBytes, AcceptsSiAndIecUnits) {
  EXPECT_EQ(parse_bytes("0"), 0u);
  EXPECT_EQ(parse_bytes("123"), 123u);
  EXPECT_EQ(parse_bytes("123B"), 123u);
  EXPECT_EQ(parse_bytes("5GB"), 5'000'000'000u);
  EXPECT_EQ(parse_bytes("5gb"), 5'000'000'000u);
  EXPECT_EQ(parse_bytes("512k"), 512'000u);
  EXPECT_EQ(parse_bytes("64MiB"), 64u << 20);
  EXPECT_EQ(parse_bytes(" 1.5 GiB "), 3u << 29);
  EXPECT_EQ(parse_bytes("2TiB"), std::size_t{2} << 40);
}

TEST(ParseBytes, RejectsWithTheTextAndTheAcceptedForms) {
  for (const char* bad : {"", "GB", "-5GB", "5 parsecs", "1.2.3MB", "0.5B", "1e3"}) {
    try {
      parse_bytes(bad);
      FAIL() << "accepted \"" << bad << "\"";
    } catch (const ValueError& e) {
      const std::string message = e.message();
      EXPECT_NE(message.find(std::string("\"") + bad + "\""), std::string::npos) << message;
    }
  }
  try {
    parse_bytes("5 parsecs");
  } catch (const ValueError& e) {
    EXPECT_NE(e.message().find("KiB/MiB/GiB/TiB"), std::string::npos) << e.message();
  }
}

TEST(ParseBandwidth, NeedsPerSecond) {
  EXPECT_DOUBLE_EQ(parse_bandwidth("12GB/s"), 12e9);
  EXPECT_DOUBLE_EQ(parse_bandwidth("1MiB/s"), 1048576.0);
  EXPECT_THROW(parse_bandwidth("12GB"), ValueError);
}

}  // namespace
}  // namespace tidal
