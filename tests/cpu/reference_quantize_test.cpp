// reference::quantize_fp8 and reference::pack_prefill_kv, element by element against the
// scalar conversions: out = convert(float(x) * scale_inv).
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/util.h"
#include "reference_testing.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr int64_t kNopeDim = 128, kRopeDim = 64;

uint8_t expected_fp8(double x, float scale_inv) {
  return float_to_fp8_e4m3(static_cast<float>(x) * scale_inv);
}

// Random values, with infinities, NaN, exact FP8 ties and values past the FP8 range mixed in.
void fill_tricky(HostTensor& t, std::mt19937_64& rng) {
  fill_uniform(t, rng, -700.0, 700.0);
  const double specials[] = {std::numeric_limits<double>::infinity(), -std::numeric_limits<double>::infinity(),
                             std::numeric_limits<double>::quiet_NaN(), 464.0, -464.0, 0x1p-10, 1.0625,
                             1e6, -0.0};
  std::uniform_int_distribution<int64_t> where(0, t.numel() - 1);
  for (int n = 0; n < 40; ++n)
    for (double s : specials) set(t, where(rng), s);
}

// x is a [4, 6, 70] view inside a [4, 9, 80] buffer; out is contiguous.
TEST(ReferenceQuantize, EveryElementOfAStridedTensor) {
  std::mt19937_64 rng = seeded_rng();
  for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
    HostTensor buffer(dtype, {4, 9, 80});
    fill_tricky(buffer, rng);
    TensorView x = buffer.view();
    x.shape = {4, 6, 70};
    HostTensor out(DType::kFloat8E4M3, {4, 6, 70});
    reference::quantize_fp8(x, out.view(), 1.75f);
    ElementChecker check;
    for (int64_t i = 0; i < 4; ++i)
      for (int64_t j = 0; j < 6; ++j)
        for (int64_t k = 0; k < 70; ++k) {
          const uint8_t expected = expected_fp8(get(buffer, (i * 9 + j) * 80 + k), 1.75f);
          const uint8_t actual = out.data<uint8_t>()[(i * 6 + j) * 70 + k];
          check.check(actual == expected, actual, expected, "code", {i, j, k});
        }
  }
}

TEST(ReferenceQuantize, SaturatesAndMapsNaNTo0x7F) {
  HostTensor x(DType::kFloat32, {6}), out(DType::kFloat8E4M3, {6});
  const float values[] = {1000.0f, -1000.0f, std::nanf(""), std::numeric_limits<float>::infinity(), 224.0f, 0.0f};
  for (int i = 0; i < 6; ++i) x.data<float>()[i] = values[i];
  reference::quantize_fp8(x.view(), out.view(), 2.0f);
  const uint8_t expected[] = {0x7E, 0xFE, 0x7F, 0x7E, 0x7E, 0x00};  // 224 * 2 = 448
  for (int i = 0; i < 6; ++i) EXPECT_EQ(out.data<uint8_t>()[i], expected[i]) << i;
}

TEST(ReferenceQuantize, ZeroDimensionalTensor) {
  HostTensor x(DType::kBFloat16, {1}), out(DType::kFloat8E4M3, {1});
  set(x, 0, 3.0);
  TensorView scalar_x = x.view(), scalar_out = out.view();
  scalar_x.ndim = scalar_out.ndim = 0;
  reference::quantize_fp8(scalar_x, scalar_out, 0.5f);
  EXPECT_EQ(out.data<uint8_t>()[0], float_to_fp8_e4m3(1.5f));
}

// k_out[t,h] = k_nope[t,h] ‖ k_rope[t] (× k_scale_inv), v_out = v × v_scale_inv, for FP8 and
// BF16 outputs and both k_rope layouts.
TEST(ReferencePack, EveryElementForBothOutputTypesAndRopeLayouts) {
  std::mt19937_64 rng = seeded_rng();
  constexpr int64_t kTokens = 7, kHeads = 3;
  const float k_scale_inv = 3.0f, v_scale_inv = 0.25f;
  for (DType out_dtype : {DType::kFloat8E4M3, DType::kBFloat16}) {
    for (bool rope_has_head_dim : {false, true}) {
      HostTensor k_nope(DType::kBFloat16, {kTokens, kHeads, kNopeDim});
      HostTensor k_rope = rope_has_head_dim ? HostTensor(DType::kFloat32, {kTokens, 1, kRopeDim})
                                            : HostTensor(DType::kFloat32, {kTokens, kRopeDim});
      HostTensor v(DType::kFloat16, {kTokens, kHeads, kPrefillVDim});
      fill_tricky(k_nope, rng);
      fill_tricky(k_rope, rng);
      fill_tricky(v, rng);
      HostTensor k_out(out_dtype, {kTokens, kHeads, kPrefillQkDim});
      HostTensor v_out(out_dtype, {kTokens, kHeads, kPrefillVDim});
      reference::pack_prefill_kv(k_nope.view(), k_rope.view(), v.view(), k_out.view(), v_out.view(),
                                 k_scale_inv, v_scale_inv);
      auto rounded = [&](double x, float scale_inv) {
        const float product = static_cast<float>(x) * scale_inv;
        return out_dtype == DType::kFloat8E4M3 ? fp8_e4m3_to_float(float_to_fp8_e4m3(product))
                                               : bf16_to_float(float_to_bf16(product));
      };
      ElementChecker check;
      for (int64_t t = 0; t < kTokens; ++t) {
        for (int64_t h = 0; h < kHeads; ++h) {
          for (int64_t d = 0; d < kPrefillQkDim; ++d) {
            const double x = d < kNopeDim ? get(k_nope, (t * kHeads + h) * kNopeDim + d)
                                          : get(k_rope, t * kRopeDim + d - kNopeDim);
            check.same(get(k_out, (t * kHeads + h) * kPrefillQkDim + d), rounded(x, k_scale_inv),
                       "k_out", {t, h, d});
          }
          for (int64_t d = 0; d < kPrefillVDim; ++d) {
            const int64_t i = (t * kHeads + h) * kPrefillVDim + d;
            check.same(get(v_out, i), rounded(get(v, i), v_scale_inv), "v_out", {t, h, d});
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace speedmla::test
