// Bit-exact scalar conversions (speedmla/numeric.h), written on the IEEE bit patterns so that the
// result never depends on the host's floating-point environment or on x87 excess precision.
#include "speedmla/numeric.h"

#include <bit>
#include <cmath>

namespace speedmla {
namespace {

constexpr uint32_t kFloatSignMask = 0x80000000u;
constexpr uint32_t kFloatAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kFloatInfBits = 0x7F800000u;
constexpr int kFloatMantissaBits = 23;
constexpr int kFloatExponentBias = 127;

// Rounds `bits` (a non-negative float's bits) to nearest even after dropping its `drop` low bits
// and returns the kept high part. A carry out of the mantissa correctly bumps the exponent.
constexpr uint32_t round_bits_nearest_even(uint32_t bits, int drop) {
  const uint32_t half_minus_one = (1u << (drop - 1)) - 1;
  const uint32_t lowest_kept = (bits >> drop) & 1u;
  return (bits + half_minus_one + lowest_kept) >> drop;
}

// Rounds a non-negative float to the nearest integer, ties to even. Used for the subnormal ranges,
// where the target grid has a fixed spacing: the caller scales (exactly, by a power of two) so
// that one step is 1.
uint32_t round_scaled_nearest_even(float scaled) {
  const float floor_value = std::floor(scaled);
  const float fraction = scaled - floor_value;  // exact: both are on the same binade or below
  auto result = static_cast<uint32_t>(floor_value);
  if (fraction > 0.5f || (fraction == 0.5f && (result & 1u))) ++result;
  return result;
}

// FP8 e4m3fn layout: 1 sign, 4 exponent (bias 7), 3 mantissa bits; S.1111.111 is NaN.
constexpr int kFp8MantissaBits = 3;
constexpr int kFp8ExponentBias = 7;
constexpr uint8_t kFp8MaxFinite = 0x7E;  // 448
constexpr uint8_t kFp8NaN = 0x7F;
constexpr float kFp8MaxValue = 448.0f;
constexpr float kFp8MinNormal = 0x1p-6f;
constexpr float kFp8SubnormalsPerUnit = 0x1p9f;  // subnormal spacing is 2^-9

// FP16 layout: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
constexpr int kFp16MantissaBits = 10;
constexpr int kFp16ExponentBias = 15;
constexpr uint16_t kFp16InfBits = 0x7C00;
constexpr uint16_t kFp16QuietBit = 0x0200;
// The smallest magnitude that rounds to infinity: halfway between 65504 and 65536, which ties
// to the even neighbour 65536 = inf.
constexpr float kFp16RoundsToInf = 65520.0f;
constexpr float kFp16MinNormal = 0x1p-14f;
constexpr float kFp16SubnormalsPerUnit = 0x1p24f;  // subnormal spacing is 2^-24

}  // namespace

float fp8_e4m3_to_float(uint8_t code) {
  const bool negative = code & 0x80;
  const int exponent = (code >> kFp8MantissaBits) & 0xF;
  const int mantissa = code & 0x7;
  float magnitude;
  if (exponent == 0xF && mantissa == 0x7) {
    magnitude = std::nanf("");
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<float>(mantissa), 1 - kFp8ExponentBias - kFp8MantissaBits);
  } else {
    magnitude = std::ldexp(static_cast<float>(8 + mantissa),
                           exponent - kFp8ExponentBias - kFp8MantissaBits);
  }
  return negative ? -magnitude : magnitude;
}

uint8_t float_to_fp8_e4m3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = (bits & kFloatSignMask) ? 0x80 : 0x00;
  const uint32_t abs_bits = bits & kFloatAbsMask;
  if (abs_bits > kFloatInfBits) return kFp8NaN;
  const float magnitude = std::bit_cast<float>(abs_bits);
  // Everything from 448 up, infinity included, saturates (there is no FP8 infinity; 464, the
  // midpoint to the next step, would round to the NaN code anyway).
  if (magnitude >= kFp8MaxValue) return sign | kFp8MaxFinite;
  if (magnitude < kFp8MinNormal) {
    // Subnormal range: the code is the count of 2^-9 steps (8 steps = 0x08 = the smallest normal).
    return sign | static_cast<uint8_t>(round_scaled_nearest_even(magnitude * kFp8SubnormalsPerUnit));
  }
  // Normal range: keep 3 mantissa bits, then re-bias the exponent from 127 to 7.
  const uint32_t rounded = round_bits_nearest_even(abs_bits, kFloatMantissaBits - kFp8MantissaBits);
  const uint32_t rebias = static_cast<uint32_t>(kFloatExponentBias - kFp8ExponentBias)
                          << kFp8MantissaBits;
  return sign | static_cast<uint8_t>(rounded - rebias);
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  // Rounding a NaN's bits could carry it into infinity; truncate and force the quiet bit.
  if ((bits & kFloatAbsMask) > kFloatInfBits) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  // Sign and exponent ride along: a carry out of the mantissa reaches the exponent (up to inf).
  return static_cast<uint16_t>(round_bits_nearest_even(bits & kFloatAbsMask, 16) |
                               ((bits & kFloatSignMask) >> 16));
}

float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const int exponent = (bits >> kFp16MantissaBits) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0x1F)  // inf or NaN, payload kept
    return std::bit_cast<float>(sign | kFloatInfBits | (mantissa << (kFloatMantissaBits - kFp16MantissaBits)));
  if (exponent == 0) {
    const float magnitude = std::ldexp(static_cast<float>(mantissa), 1 - kFp16ExponentBias - kFp16MantissaBits);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t float_exponent = static_cast<uint32_t>(exponent - kFp16ExponentBias + kFloatExponentBias);
  return std::bit_cast<float>(sign | (float_exponent << kFloatMantissaBits) |
                              (mantissa << (kFloatMantissaBits - kFp16MantissaBits)));
}

uint16_t float_to_fp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint16_t sign = static_cast<uint16_t>((bits & kFloatSignMask) >> 16);
  const uint32_t abs_bits = bits & kFloatAbsMask;
  if (abs_bits > kFloatInfBits) {
    const auto payload = static_cast<uint16_t>((abs_bits >> (kFloatMantissaBits - kFp16MantissaBits)) & 0x3FF);
    return sign | kFp16InfBits | kFp16QuietBit | payload;
  }
  const float magnitude = std::bit_cast<float>(abs_bits);
  if (magnitude >= kFp16RoundsToInf) return sign | kFp16InfBits;
  if (magnitude < kFp16MinNormal) {
    // Subnormal range: the code is the count of 2^-24 steps (1024 steps = the smallest normal).
    return sign | static_cast<uint16_t>(round_scaled_nearest_even(magnitude * kFp16SubnormalsPerUnit));
  }
  const uint32_t rounded = round_bits_nearest_even(abs_bits, kFloatMantissaBits - kFp16MantissaBits);
  const uint32_t rebias = static_cast<uint32_t>(kFloatExponentBias - kFp16ExponentBias)
                          << kFp16MantissaBits;
  return sign | static_cast<uint16_t>(rounded - rebias);
}

}  // namespace speedmla
