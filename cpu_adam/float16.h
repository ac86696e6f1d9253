// Scalar conversions between fp32 and the two 16-bit float formats, by bit
// manipulation so they mean the same thing on every compiler and CPU. The
// scalar reference kernel uses them; the SIMD kernels must agree with them
// bit for bit. See Note [16-bit rounding].
//
// Note [16-bit rounding]
// ~~~~~~~~~~~~~~~~~~~~~~
// Every fp32 -> fp16/bf16 conversion in cpu_adam rounds to nearest, ties to
// even (what torch's `.to(torch.float16)` / `.to(torch.bfloat16)` and the
// F16C instruction do), handles subnormals, and saturates to infinity past
// the largest finite value. A NaN becomes a quiet NaN: 0x7E00 | sign for
// fp16 and 0x7FC0 for bf16, exactly as c10::Half / c10::BFloat16 produce.
// (F16C keeps the top NaN payload bits instead; payloads are not part of
// the contract, NaN-ness is.) Highway 1.0.3's own software DemoteTo for
// targets without F16C truncates and does not produce infinities, and its
// bf16 DemoteTo truncates on every target, so cpu_adam never uses those.
#pragma once

#include <cstdint>
#include <cstring>

namespace tidal::cpu_adam {

inline std::uint32_t float_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

inline float bits_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Exact: every fp16 value (subnormals, infinities, NaNs) has an fp32 image.
inline float f16_to_f32(std::uint16_t h) {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1Fu;
  const std::uint32_t mant = h & 0x3FFu;
  if (exp == 0x1F) return bits_float(sign | 0x7F800000u | (mant << 13));  // inf / NaN
  if (exp != 0) return bits_float(sign | ((exp + 112u) << 23) | (mant << 13));
  // Zero or subnormal: mant * 2^-24, exact in fp32.
  const float magnitude = static_cast<float>(mant) * 5.9604644775390625e-8f;
  return bits_float(sign | float_bits(magnitude));
}

// Round to nearest even; see Note [16-bit rounding].
inline std::uint16_t f32_to_f16_rne(float f) {
  const std::uint32_t u = float_bits(f);
  const std::uint32_t sign = (u >> 16) & 0x8000u;
  const std::uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<std::uint16_t>(sign | 0x7E00u);  // NaN
  if (a >= 0x477FF000u) return static_cast<std::uint16_t>(sign | 0x7C00u);  // rounds past 65504
  if (a < 0x38800000u) {
    // Below the smallest fp16 normal (2^-14): the result is subnormal or zero.
    // Its unit is 2^-24; shift the full 24-bit significand into place and
    // round the shifted-out bits to nearest even.
    if (a < 0x33000000u) return static_cast<std::uint16_t>(sign);  // < 2^-25: rounds to 0
    const std::uint32_t exp = a >> 23;              // 102..112
    const std::uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;
    const std::uint32_t shift = 126u - exp;         // 14..24
    std::uint32_t q = mant >> shift;
    const std::uint32_t rem = mant & ((1u << shift) - 1u);
    const std::uint32_t half = 1u << (shift - 1u);
    if (rem > half || (rem == half && (q & 1u))) ++q;
    return static_cast<std::uint16_t>(sign | q);
  }
  // Normal: rebias the exponent, then round the 13 dropped mantissa bits.
  std::uint32_t r = a - (112u << 23);
  r += 0xFFFu + ((r >> 13) & 1u);
  return static_cast<std::uint16_t>(sign | (r >> 13));
}

inline float bf16_to_f32(std::uint16_t b) {
  return bits_float(static_cast<std::uint32_t>(b) << 16);
}

// Round to nearest even; see Note [16-bit rounding].
inline std::uint16_t f32_to_bf16_rne(float f) {
  const std::uint32_t u = float_bits(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;  // NaN
  return static_cast<std::uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

}  // namespace tidal::cpu_adam
