// SmallIds against std::vector: the same random sequence of operations on
// both, across the inline/heap boundary, with copies and moves in between.
#include "runtime/dtr/small_ids.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <utility>
#include <vector>

namespace tidal::dtr {
namespace {

template <std::size_t N>
void expect_same(const SmallIds<N>& got, const std::vector<std::int64_t>& want) {
  ASSERT_EQ(got.size(), want.size());
  EXPECT_EQ(got.empty(), want.empty());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin(), want.end()));
  if (!want.empty()) {
    EXPECT_EQ(got.front(), want.front());
    EXPECT_EQ(got.back(), want.back());
  }
}

template <std::size_t N>
void random_operations(std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  SmallIds<N> ids;
  std::vector<std::int64_t> ref;
  for (int step = 0; step < 4000; ++step) {
    const auto value = static_cast<std::int64_t>(rng() % 7);
    switch (rng() % 8) {
      case 0:
      case 1:
      case 2:
        ids.push_back(value);
        ref.push_back(value);
        break;
      case 3: {  // erase(remove(...)), as the records drop a user
        ids.erase(std::remove(ids.begin(), ids.end(), value), ids.end());
        ref.erase(std::remove(ref.begin(), ref.end(), value), ref.end());
        break;
      }
      case 4: {
        std::vector<std::int64_t> src(rng() % (3 * N + 2), value);
        ids.assign(src.begin(), src.end());
        ref = src;
        break;
      }
      case 5: {  // copy, then keep using the copy
        SmallIds<N> copy(ids);
        expect_same(copy, ref);
        ids = copy;
        break;
      }
      case 6: {  // move out and back: the source is left empty and usable
        SmallIds<N> moved(std::move(ids));
        expect_same(moved, ref);
        EXPECT_TRUE(ids.empty());
        ids.push_back(value);
        ids = std::move(moved);
        break;
      }
      default:
        if (rng() % 16 == 0) {
          ids.clear();
          ref.clear();
        } else if (!ref.empty()) {
          const std::size_t i = rng() % ref.size();
          ids[i] = value;
          ref[i] = value;
        }
    }
    expect_same(ids, ref);
    if (::testing::Test::HasFailure()) return;
  }
}

TEST(SmallIds, MatchesStdVectorOneInline) { random_operations<1>(1); }
TEST(SmallIds, MatchesStdVectorTwoInline) { random_operations<2>(2); }
TEST(SmallIds, MatchesStdVectorThreeInline) { random_operations<3>(3); }

TEST(SmallIds, ReserveKeepsTheIdsAcrossTheHeapBoundary) {
  SmallIds<2> ids;
  for (std::int64_t i = 0; i < 100; ++i) {
    ids.push_back(i);
    ids.reserve(ids.size() + (i % 3));
  }
  std::vector<std::int64_t> want(100);
  for (std::int64_t i = 0; i < 100; ++i) want[static_cast<std::size_t>(i)] = i;
  expect_same(ids, want);
}

}  // namespace
}  // namespace tidal::dtr
