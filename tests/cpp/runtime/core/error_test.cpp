#include "runtime/core/error.h"

#include <gtest/gtest.h>

#include <string>

namespace tidal {
namespace {

void check_positive(int value) { TIDAL_CHECK(value > 0, "expected a positive count, got ", value); }

TEST(Error, CheckCarriesValuesAndLocation) {
  try {
    check_positive(-3);
    FAIL() << "TIDAL_CHECK did not throw";
  } catch (const ValueError& e) {
    EXPECT_EQ(e.message(), "expected a positive count, got -3");
    const std::string what = e.what();
    EXPECT_NE(what.find("expected a positive count, got -3 [runtime/"), std::string::npos) << what;
    EXPECT_NE(what.find("error_test.cpp:"), std::string::npos) << what;
  }
}

TEST(Error, CheckPassesWithoutBuildingTheMessage) {
  int evaluated = 0;
  auto costly = [&] {
    ++evaluated;
    return std::string("never needed");
  };
  TIDAL_CHECK(true, costly());
  EXPECT_EQ(evaluated, 0);
}

TEST(Error, EachCheckThrowsItsType) {
  EXPECT_THROW(TIDAL_CHECK_TYPE(false, "dtype"), TypeError);
  EXPECT_THROW(TIDAL_CHECK_INDEX(false, "index"), IndexError);
  EXPECT_THROW(TIDAL_CHECK_SUPPORTED(false, "feature"), NotImplementedError);
  EXPECT_THROW(TIDAL_CHECK_RUNTIME(false, "runtime"), Error);
  EXPECT_THROW(TIDAL_THROW(OutOfMemoryError, "oom"), OutOfMemoryError);
  // Every type is a tidal::Error, so one catch clause sees them all.
  EXPECT_THROW(TIDAL_CHECK_TYPE(false, "dtype"), Error);
}

TEST(Error, InternalAssertNamesTheConditionAndAsksForAReport) {
  const int chunks = 2;
  try {
    TIDAL_INTERNAL_ASSERT(chunks == 3, "chunks=", chunks);
    FAIL() << "TIDAL_INTERNAL_ASSERT did not throw";
  } catch (const InternalError& e) {
    const std::string message = e.message();
    EXPECT_NE(message.find("`chunks == 3` failed: chunks=2"), std::string::npos) << message;
    EXPECT_NE(message.find("bug in tidal"), std::string::npos) << message;
  }
}

TEST(Error, DebugOnlyAssertFollowsTheBuildMode) {
#if TIDAL_DEBUG_CHECKS_ENABLED
  EXPECT_THROW(TIDAL_INTERNAL_ASSERT_DEBUG_ONLY(1 + 1 == 3, "debug"), InternalError);
#else
  int evaluated = 0;
  TIDAL_INTERNAL_ASSERT_DEBUG_ONLY((++evaluated, false), "not evaluated in release");
  EXPECT_EQ(evaluated, 0);
#endif
}

TEST(Error, FormatBytes) {
  EXPECT_EQ(format_bytes(0), "0 bytes");
  EXPECT_EQ(format_bytes(1023), "1023 bytes");
  EXPECT_EQ(format_bytes(64u << 20), "64.00 MiB (67108864 bytes)");
  EXPECT_EQ(format_bytes(3u << 29), "1.50 GiB (1610612736 bytes)");
}

}  // namespace
}  // namespace tidal
