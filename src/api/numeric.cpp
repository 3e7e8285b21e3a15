// Bit-exact scalar conversions (speedmla/numeric.h), written on the IEEE bit patterns so that the
// result never depends on the host's floating-point environment or on x87 excess precision.
#include "speedmla/numeric.h"

#include <bit>
#include <cmath>
#include <limits>

namespace speedmla {
namespace {

constexpr uint32_t kFloatSignMask = 0x80000000u;
constexpr uint32_t kFloatAbsMask = 0x7FFFFFFFu;
constexpr uint32_t kFloatInfBits = 0x7F800000u;
constexpr int kFloatMantissaBits = 23;
constexpr int kFloatExponentBias = 127;

// A narrow binary format: FP8 e4m3 (3 mantissa bits, bias 7) or FP16 (10 bits, bias 15).
struct NarrowFormat {
  int mantissa_bits;
  int exponent_bias;
};
constexpr NarrowFormat kFp8E4M3{3, 7};
constexpr NarrowFormat kFp16{10, 15};

// Rounds `bits` (a non-negative float's bits) to nearest even after dropping its `drop` low bits
// and returns the kept high part. A carry out of the mantissa correctly bumps the exponent.
constexpr uint32_t round_bits_nearest_even(uint32_t bits, int drop) {
  const uint32_t half_minus_one = (1u << (drop - 1)) - 1;
  const uint32_t lowest_kept = (bits >> drop) & 1u;
  return (bits + half_minus_one + lowest_kept) >> drop;
}

// The magnitude of a code's finite value, from its exponent and mantissa fields.
float decode_magnitude(NarrowFormat format, int exponent, int mantissa) {
  if (exponent == 0)  // subnormal: no implicit leading 1, exponent as for the field value 1
    return std::ldexp(static_cast<float>(mantissa), 1 - format.exponent_bias - format.mantissa_bits);
  return std::ldexp(static_cast<float>((1 << format.mantissa_bits) + mantissa),
                    exponent - format.exponent_bias - format.mantissa_bits);
}

// The code (without sign) of a finite non-negative float, rounded to nearest even; the caller
// handles NaN and values past the format's range. A result one past the largest mantissa
// carries into the exponent field, which is the correct next code.
uint32_t encode_magnitude(NarrowFormat format, float magnitude) {
  const float min_normal = std::ldexp(1.0f, 1 - format.exponent_bias);
  if (magnitude < min_normal) {
    // Subnormal range: a fixed grid. Scale (exactly) so that one step is 1, then round to an
    // integer: that is the code, and 1 << mantissa_bits steps is the smallest normal's code.
    const float steps = std::ldexp(magnitude, format.exponent_bias - 1 + format.mantissa_bits);
    const float floor_steps = std::floor(steps);
    auto code = static_cast<uint32_t>(floor_steps);
    const float fraction = steps - floor_steps;  // exact
    if (fraction > 0.5f || (fraction == 0.5f && (code & 1u))) ++code;
    return code;
  }
  // Normal range: keep mantissa_bits, then re-bias the exponent.
  const uint32_t rounded = round_bits_nearest_even(std::bit_cast<uint32_t>(magnitude),
                                                   kFloatMantissaBits - format.mantissa_bits);
  return rounded - (static_cast<uint32_t>(kFloatExponentBias - format.exponent_bias)
                    << format.mantissa_bits);
}

constexpr uint8_t kFp8MaxFinite = 0x7E;  // 448
constexpr uint8_t kFp8NaN = 0x7F;
constexpr float kFp8MaxValue = 448.0f;

constexpr uint16_t kFp16InfBits = 0x7C00;
constexpr uint16_t kFp16QuietBit = 0x0200;
// The smallest magnitude that rounds to infinity: halfway between 65504 and 65536, which ties
// to the even neighbour 65536 = inf.
constexpr float kFp16RoundsToInf = 65520.0f;

}  // namespace

float fp8_e4m3_to_float(uint8_t code) {
  // S.1111.111 is NaN; e4m3fn has no infinities.
  const float magnitude = (code & 0x7F) == kFp8NaN
                              ? std::numeric_limits<float>::quiet_NaN()
                              : decode_magnitude(kFp8E4M3, (code >> 3) & 0xF, code & 0x7);
  return (code & 0x80) ? -magnitude : magnitude;
}

uint8_t float_to_fp8_e4m3(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const uint8_t sign = (bits & kFloatSignMask) ? 0x80 : 0x00;
  if ((bits & kFloatAbsMask) > kFloatInfBits) return kFp8NaN;
  const float magnitude = std::bit_cast<float>(bits & kFloatAbsMask);
  // Everything from 448 up, infinity included, saturates (there is no FP8 infinity; 464, the
  // midpoint to the next step, would round to the NaN code anyway).
  if (magnitude >= kFp8MaxValue) return sign | kFp8MaxFinite;
  return sign | static_cast<uint8_t>(encode_magnitude(kFp8E4M3, magnitude));
}

float bf16_to_float(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

uint16_t float_to_bf16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  // Rounding a NaN's bits could carry it into infinity; truncate and force the quiet bit.
  if ((bits & kFloatAbsMask) > kFloatInfBits) return static_cast<uint16_t>((bits >> 16) | 0x0040);
  // BF16 is float's upper half: a carry out of the mantissa reaches the exponent (up to inf).
  return static_cast<uint16_t>(round_bits_nearest_even(bits & kFloatAbsMask, 16) |
                               ((bits & kFloatSignMask) >> 16));
}

float fp16_to_float(uint16_t bits) {
  const uint32_t sign = static_cast<uint32_t>(bits & 0x8000) << 16;
  const int exponent = (bits >> kFp16.mantissa_bits) & 0x1F;
  const uint32_t mantissa = bits & 0x3FF;
  if (exponent == 0x1F)  // inf or NaN, payload kept
    return std::bit_cast<float>(sign | kFloatInfBits |
                                (mantissa << (kFloatMantissaBits - kFp16.mantissa_bits)));
  const float magnitude = decode_magnitude(kFp16, exponent, static_cast<int>(mantissa));
  return sign ? -magnitude : magnitude;
}

uint16_t float_to_fp16(float value) {
  const uint32_t bits = std::bit_cast<uint32_t>(value);
  const auto sign = static_cast<uint16_t>((bits & kFloatSignMask) >> 16);
  const uint32_t abs_bits = bits & kFloatAbsMask;
  if (abs_bits > kFloatInfBits) {  // NaN: keep the top of the payload, force the quiet bit
    const auto payload =
        static_cast<uint16_t>((abs_bits >> (kFloatMantissaBits - kFp16.mantissa_bits)) & 0x3FF);
    return sign | kFp16InfBits | kFp16QuietBit | payload;
  }
  const float magnitude = std::bit_cast<float>(abs_bits);
  if (magnitude >= kFp16RoundsToInf) return sign | kFp16InfBits;
  return sign | static_cast<uint16_t>(encode_magnitude(kFp16, magnitude));
}

}  // namespace speedmla
