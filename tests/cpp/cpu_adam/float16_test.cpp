// The scalar fp16/bf16 conversions against independent oracles: the
// compiler's own _Float16 (libgcc's soft-float conversions) for fp16, and a
// rounding decision made in double arithmetic for bf16.
#include "cpu_adam/float16.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace tidal::cpu_adam {
namespace {

// Round-to-nearest-even onto the bf16 grid, decided in double: the two bf16
// neighbours of x are exact in double, and so is the distance to each.
std::uint16_t bf16_oracle(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const std::uint32_t u = float_bits(x);
  if (std::isinf(x)) return static_cast<std::uint16_t>(u >> 16);
  const std::uint32_t down = u & 0xFFFF0000u;            // towards zero
  const std::uint32_t up = down + 0x10000u;              // away from zero (may become inf)
  const double dx = std::fabs(static_cast<double>(x));
  const double d_down = dx - std::fabs(static_cast<double>(bits_float(down)));
  const double up_mag = (up & 0x7FFFFFFFu) >= 0x7F800000u
                            ? std::ldexp(1.0, 128)       // the value infinity stands for
                            : std::fabs(static_cast<double>(bits_float(up)));
  const double d_up = up_mag - dx;
  std::uint32_t pick;
  if (d_down < d_up) {
    pick = down;
  } else if (d_up < d_down) {
    pick = up;
  } else {
    pick = ((down >> 16) & 1u) == 0 ? down : up;
  }
  return static_cast<std::uint16_t>(pick >> 16);
}

#if defined(__FLT16_MAX__)
std::uint16_t f16_oracle(float x) {
  const _Float16 h = static_cast<_Float16>(x);
  std::uint16_t bits;
  std::memcpy(&bits, &h, sizeof bits);
  return bits;
}

float f16_oracle_to_f32(std::uint16_t bits) {
  _Float16 h;
  std::memcpy(&h, &bits, sizeof h);
  return static_cast<float>(h);
}
#endif

bool f16_is_nan(std::uint16_t h) { return (h & 0x7C00u) == 0x7C00u && (h & 0x3FFu) != 0; }

// Every float worth a look: all fp16 values, every midpoint between two
// neighbouring fp16 values and the floats just either side of it, values
// around the overflow threshold, plus random floats across all exponents.
std::vector<float> interesting_floats() {
  std::vector<float> out;
  for (std::uint32_t h = 0; h < 0x7C00u; ++h) {
    const float a = f16_to_f32(static_cast<std::uint16_t>(h));
    const float b = f16_to_f32(static_cast<std::uint16_t>(h + 1));  // h + 1 == 0x7C00 is inf
    for (float sign : {1.0f, -1.0f}) {
      out.push_back(sign * a);
      if (std::isfinite(b)) {
        const float mid = static_cast<float>((static_cast<double>(a) + b) / 2);  // exact
        out.push_back(sign * mid);
        out.push_back(sign * std::nextafter(mid, 0.0f));
        out.push_back(sign * std::nextafter(mid, 1e30f));
      }
    }
  }
  for (float x : {65504.0f, 65519.99f, 65520.0f, 65536.0f, 1e30f,
                  std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                  std::numeric_limits<float>::denorm_min(), std::numeric_limits<float>::min(),
                  2.9802322e-08f /* 2^-25 */, 2.9802326e-08f, 5.9604645e-08f /* 2^-24 */}) {
    out.push_back(x);
    out.push_back(-x);
  }
  std::mt19937 rng(7);
  std::uniform_int_distribution<std::uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const float x = bits_float(bits(rng));
    if (!std::isnan(x)) out.push_back(x);
  }
  return out;
}

#if defined(__FLT16_MAX__)
TEST(Float16, WideningIsExactForEveryBitPattern) {
  for (std::uint32_t h = 0; h <= 0xFFFFu; ++h) {
    const auto bits = static_cast<std::uint16_t>(h);
    const float ours = f16_to_f32(bits);
    const float oracle = f16_oracle_to_f32(bits);
    if (f16_is_nan(bits)) {
      ASSERT_TRUE(std::isnan(ours)) << std::hex << h;
    } else {
      ASSERT_EQ(float_bits(ours), float_bits(oracle)) << std::hex << h;
    }
  }
}

TEST(Float16, NarrowingRoundsToNearestEvenLikeTheCompiler) {
  for (float x : interesting_floats()) {
    ASSERT_EQ(f32_to_f16_rne(x), f16_oracle(x)) << x << " bits " << std::hex << float_bits(x);
  }
}
#else
TEST(Float16, WideningIsExactForEveryBitPattern) { GTEST_SKIP() << "this compiler has no _Float16 type to serve as the independent oracle"; }
#endif

TEST(Float16, NarrowingSpecialValues) {
  EXPECT_EQ(f32_to_f16_rne(65504.0f), 0x7BFFu);
  EXPECT_EQ(f32_to_f16_rne(65519.0f), 0x7BFFu);
  EXPECT_EQ(f32_to_f16_rne(65520.0f), 0x7C00u);  // the tie rounds to even: infinity
  EXPECT_EQ(f32_to_f16_rne(-1e9f), 0xFC00u);
  EXPECT_EQ(f32_to_f16_rne(std::numeric_limits<float>::quiet_NaN()), 0x7E00u);
  EXPECT_EQ(f32_to_f16_rne(5.9604645e-08f), 0x0001u);   // smallest subnormal
  EXPECT_EQ(f32_to_f16_rne(2.9802322e-08f), 0x0000u);   // half of it: tie to even (0)
  EXPECT_EQ(f32_to_f16_rne(8.940697e-08f), 0x0002u);    // 1.5 units: tie to even (2)
  EXPECT_EQ(f32_to_f16_rne(-0.0f), 0x8000u);
  EXPECT_EQ(f32_to_f16_rne(1.0f + 1.0f / 2048), 0x3C00u);  // tie between 1 and 1+2^-10: even
  EXPECT_EQ(f32_to_f16_rne(1.0f + 3.0f / 2048), 0x3C02u);  // tie: rounds up to even
}

TEST(BFloat16, NarrowingRoundsToNearestEven) {
  for (float x : interesting_floats()) {
    ASSERT_EQ(f32_to_bf16_rne(x), bf16_oracle(x)) << x << " bits " << std::hex << float_bits(x);
  }
  EXPECT_EQ(f32_to_bf16_rne(std::numeric_limits<float>::quiet_NaN()), 0x7FC0u);
  EXPECT_EQ(f32_to_bf16_rne(std::numeric_limits<float>::max()), 0x7F80u);  // rounds to inf
  EXPECT_EQ(f32_to_bf16_rne(bits_float(0x3F808000u)), 0x3F80u);  // tie, even stays
  EXPECT_EQ(f32_to_bf16_rne(bits_float(0x3F818000u)), 0x3F82u);  // tie, odd rounds up
}

TEST(BFloat16, WideningIsExact) {
  for (std::uint32_t b = 0; b <= 0xFFFFu; ++b) {
    const float x = bf16_to_f32(static_cast<std::uint16_t>(b));
    ASSERT_EQ(float_bits(x), b << 16);
  }
}

}  // namespace
}  // namespace tidal::cpu_adam
