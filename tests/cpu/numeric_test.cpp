// The host conversions of speedmla/numeric.h against CUDA's own host-side conversions
// (cuda_fp8.h, cuda_bf16.h, cuda_fp16.h), which define what the GPU computes.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <vector>

#include "speedmla/numeric.h"

namespace speedmla {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();

uint8_t cuda_float_to_fp8(float x) { return __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3); }

float cuda_fp8_to_float(uint8_t code) {
  const __half h = __nv_cvt_fp8_to_halfraw(code, __NV_E4M3);
  return __half2float(h);
}

template <typename T>
uint16_t bits16(T value) {
  uint16_t bits;
  std::memcpy(&bits, &value, sizeof bits);
  return bits;
}

template <typename T>
T from_bits16(uint16_t bits) {
  T value;
  std::memcpy(&value, &bits, sizeof bits);
  return value;
}

// Equal bit patterns, or both NaN (payloads of NaN are not part of the contract).
bool same_float(float a, float b) {
  return (std::isnan(a) && std::isnan(b)) || std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

// Inputs where conversions go wrong: every value of `grid` (sorted, positive), the midpoint of
// each neighbouring pair (a rounding tie) and the floats just around each, with both signs;
// zeros, infinities, NaNs, the float extremes; then `random_count` random bit patterns.
std::vector<float> tricky_floats(const std::vector<float>& grid, int random_count, uint64_t seed) {
  std::vector<float> values = {0.0f, -0.0f, kInf, -kInf, std::nanf(""), -std::nanf(""),
                               std::numeric_limits<float>::max(), std::numeric_limits<float>::min(),
                               std::numeric_limits<float>::denorm_min(), 1e30f, 1e-30f};
  auto add_around = [&](float x) {
    for (float v : {x, std::nextafter(x, 0.0f), std::nextafter(x, kInf)}) {
      values.push_back(v);
      values.push_back(-v);
    }
  };
  for (size_t i = 0; i < grid.size(); ++i) {
    add_around(grid[i]);
    if (i + 1 < grid.size()) add_around(static_cast<float>((double(grid[i]) + grid[i + 1]) / 2));
  }
  std::mt19937_64 rng(seed);
  for (int i = 0; i < random_count; ++i) values.push_back(std::bit_cast<float>(static_cast<uint32_t>(rng())));
  return values;
}

uint64_t printed_seed() {
  const uint64_t seed = std::random_device{}();
  std::cout << "seed " << seed << "\n";
  return seed;
}

TEST(NumericFp8, EveryCodeDecodesLikeCuda) {
  for (int code = 0; code < 256; ++code) {
    const float value = fp8_e4m3_to_float(static_cast<uint8_t>(code));
    EXPECT_TRUE(same_float(value, cuda_fp8_to_float(static_cast<uint8_t>(code))))
        << "code 0x" << std::hex << code << " -> " << value;
    EXPECT_EQ(std::isnan(value), (code & 0x7F) == 0x7F) << "code " << code;
  }
  EXPECT_EQ(fp8_e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0xFE), -448.0f);
  EXPECT_EQ(fp8_e4m3_to_float(0x01), 0x1p-9f);
  EXPECT_EQ(fp8_e4m3_to_float(0x08), 0x1p-6f);
  EXPECT_EQ(fp8_e4m3_to_float(0x38), 1.0f);
  EXPECT_TRUE(std::signbit(fp8_e4m3_to_float(0x80)));
}

TEST(NumericFp8, EncodeMatchesCudaOnCodesTiesAndRandomFloats) {
  std::vector<float> grid;
  for (int code = 0; code < 0x7F; ++code) grid.push_back(fp8_e4m3_to_float(static_cast<uint8_t>(code)));
  grid.push_back(480.0f);  // the step above 448 (the NaN code): its tie with 448 must saturate
  const uint64_t seed = printed_seed();
  std::vector<float> values = tricky_floats(grid, 1 << 20, seed);
  std::mt19937_64 rng(seed + 1);
  std::uniform_real_distribution<float> in_range(-600.0f, 600.0f);
  for (int i = 0; i < (1 << 18); ++i) values.push_back(in_range(rng));
  for (float x : values) {
    ASSERT_EQ(float_to_fp8_e4m3(x), cuda_float_to_fp8(x)) << "x = " << x << " (bits 0x" << std::hex
                                                          << std::bit_cast<uint32_t>(x) << ")";
  }
}

TEST(NumericFp8, SaturatesAndMapsNaNTo0x7F) {
  EXPECT_EQ(float_to_fp8_e4m3(448.0f), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(464.0f), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(1e9f), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(kInf), 0x7E);
  EXPECT_EQ(float_to_fp8_e4m3(-kInf), 0xFE);
  EXPECT_EQ(float_to_fp8_e4m3(std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_fp8_e4m3(0x1p-10f), 0x00);        // tie between 0 and 2^-9: even is 0
  EXPECT_EQ(float_to_fp8_e4m3(3 * 0x1p-10f), 0x02);    // tie between codes 1 and 2
  for (int code = 0; code < 256; ++code) {
    if ((code & 0x7F) == 0x7F) continue;
    EXPECT_EQ(float_to_fp8_e4m3(fp8_e4m3_to_float(static_cast<uint8_t>(code))), code) << code;
  }
}

// A 16-bit format: our conversions, CUDA's, and the quiet bit a NaN must carry.
struct Format16 {
  float (*decode)(uint16_t);
  uint16_t (*encode)(float);
  float (*cuda_decode)(uint16_t);
  uint16_t (*cuda_encode)(float);
  uint16_t quiet_bit;
};

const Format16 kBf16{bf16_to_float, float_to_bf16,
                     [](uint16_t b) { return __bfloat162float(from_bits16<__nv_bfloat16>(b)); },
                     [](float x) { return bits16(__float2bfloat16_rn(x)); }, 0x0040};
const Format16 kFp16{fp16_to_float, float_to_fp16,
                     [](uint16_t b) { return __half2float(from_bits16<__half>(b)); },
                     [](float x) { return bits16(__float2half_rn(x)); }, 0x0200};

void expect_decodes_like_cuda(const Format16& format) {
  for (uint32_t bits = 0; bits < 0x10000; ++bits) {
    const auto code = static_cast<uint16_t>(bits);
    ASSERT_TRUE(same_float(format.decode(code), format.cuda_decode(code))) << bits;
  }
}

// Every `step`-th code below `end` and its neighbours, the ties between them, then the extra
// values (the top of the range) and random floats. NaN only needs to stay a quiet NaN.
void expect_encodes_like_cuda(const Format16& format, uint32_t end, uint32_t step,
                              std::initializer_list<float> extra) {
  std::vector<float> grid;
  for (uint32_t bits = 0; bits < end; bits += step) grid.push_back(format.decode(static_cast<uint16_t>(bits)));
  grid.insert(grid.end(), extra);
  for (float x : tricky_floats(grid, 1 << 20, printed_seed())) {
    const uint16_t ours = format.encode(x), cuda = format.cuda_encode(x);
    if (std::isnan(x)) {
      ASSERT_TRUE(std::isnan(format.decode(ours)) && std::isnan(format.decode(cuda)));
      ASSERT_TRUE(ours & format.quiet_bit) << "NaN must stay quiet";
    } else {
      ASSERT_EQ(ours, cuda) << "x = " << x << " (bits 0x" << std::hex << std::bit_cast<uint32_t>(x) << ")";
    }
  }
}

TEST(NumericBf16, EveryCodeDecodesLikeCuda) { expect_decodes_like_cuda(kBf16); }

TEST(NumericBf16, EncodeMatchesCuda) {
  // The largest finite value, and inf: their tie rounds to inf.
  expect_encodes_like_cuda(kBf16, 0x7F80, 0x11, {bf16_to_float(0x7F7F), kInf});
  // A signalling NaN whose payload is only in the low 16 bits must stay NaN, not become inf.
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::bit_cast<float>(0x7F800001u)))));
}

TEST(NumericFp16, EveryCodeDecodesLikeCuda) { expect_decodes_like_cuda(kFp16); }

TEST(NumericFp16, EncodeMatchesCuda) {
  expect_encodes_like_cuda(kFp16, 0x7C00, 0x7, {65504.0f, 65536.0f});  // the tie 65520 rounds to inf
  EXPECT_EQ(float_to_fp16(65520.0f), 0x7C00);
  EXPECT_EQ(float_to_fp16(std::nextafter(65520.0f, 0.0f)), 0x7BFF);
  EXPECT_EQ(float_to_fp16(0x1p-25f), 0x0000);      // tie between 0 and the smallest subnormal
  EXPECT_EQ(float_to_fp16(3 * 0x1p-25f), 0x0002);  // tie between subnormals 1 and 2
}

}  // namespace
}  // namespace speedmla
