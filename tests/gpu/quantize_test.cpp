// quantize_fp8 and pack_prefill_kv on the GPU against the CPU path (the reference), bit for bit,
// on fresh wide-range random data (subnormals, saturation, ties, inf, NaN) with poisoned outputs.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "common/op_testing.h"
#include "common/util.h"
#include "cpu/reference_testing.h"

namespace speedmla::test {
namespace {

constexpr int64_t kNopeDim = kPrefillQkDim - kRopeDim;

class QuantizeGpu : public testing::TestWithParam<DType> {};

struct QuantizeCase {
  std::vector<int64_t> shape;
  std::vector<int64_t> x_strides, out_strides;  // empty: contiguous
  int64_t x_offset = 0;                          // elements; odd: misaligned (scalar path)
  float scale_inv = 1.f;
};

TEST_P(QuantizeGpu, QuantizeMatchesReference) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  const QuantizeCase cases[] = {
      {{0, 576}},
      {{1, 1}},
      {{3, 576}, {}, {}, 0, 0.5f},
      {{2, 5, 7}},                                            // 70 elements: scalar path
      {{4, 3, 576}, {3 * 640, 640, 1}, {}, 0, 1.3f},          // padded rows, merged outer dims
      {{4, 3, 576}, {4000, 1200, 1}, {3 * 592, 592, 1}},      // two outer dims, both strided
      {{5, 33}, {}, {}, 1, 2.f},                              // misaligned x: scalar path
      {{2, 1, 3, 1, 2, 16}, {}, {}, 0, 0.25f},                // six dims, contiguous
      {{3, 4, 32}, {32, 96, 1}},                              // outer dims transposed in x
  };
  for (const QuantizeCase& q : cases) {
    Mirror x(GetParam(), q.shape, q.x_strides, q.x_offset);
    Mirror out(DType::kFloat8E4M3, q.shape, q.out_strides);
    fill_wide(x.host, rng);
    x.upload();
    out.poison();
    SCOPED_TRACE(testing::Message() << "x " << x.layout() << " out " << out.layout() << " scale_inv "
                                    << q.scale_inv);
    quantize_fp8(x.host_view(), out.host_view(), q.scale_inv);
    quantize_fp8(x.device_view(), out.device_view(), q.scale_inv);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_TRUE(bitwise_equal(out.download(), out.host));
  }
}

struct PackCase {
  int64_t tokens, heads;
  DType v_dtype;         // kFloat32 or the parameter's dtype
  bool rope_3d = false;  // k_rope [T, 1, 64] rather than [T, 64]
  int64_t pad = 0;       // elements after each head row of k_nope and k_out (strided views)
  int64_t offset = 0;    // of k_nope, in elements: odd breaks 16-byte alignment (scalar path)
  float k_scale_inv = 1.f, v_scale_inv = 1.f;
};

// [T, H, width] with head stride width + pad.
Mirror head_rows(DType dtype, int64_t tokens, int64_t heads, int64_t width, int64_t pad = 0,
                 int64_t offset = 0) {
  return Mirror(dtype, {tokens, heads, width}, {heads * (width + pad), width + pad, 1}, offset);
}

TEST_P(QuantizeGpu, PackPrefillKvMatchesReference) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  const DType in = GetParam();
  const PackCase cases[] = {
      {0, 16, in},
      {1, 1, in, /*rope_3d=*/true},
      {17, 16, in, false, 0, 0, 0.5f, 2.f},
      {9, 4, DType::kFloat32, true, /*pad=*/8, 0, 1.5f, 0.75f},
      {6, 3, in, false, 0, /*offset=*/1},
      {40, 8, in, false, /*pad=*/5},  // 5-element pads: scalar path
  };
  for (const DType out_dtype : {DType::kFloat8E4M3, DType::kBFloat16}) {
    for (const PackCase& p : cases) {
      Mirror k_nope = head_rows(in, p.tokens, p.heads, kNopeDim, p.pad, p.offset);
      Mirror k_rope = p.rope_3d ? Mirror(in, {p.tokens, 1, kRopeDim}) : Mirror(in, {p.tokens, kRopeDim});
      Mirror v = head_rows(p.v_dtype, p.tokens, p.heads, kPrefillVDim);
      Mirror k_out = head_rows(out_dtype, p.tokens, p.heads, kPrefillQkDim, p.pad);
      Mirror v_out = head_rows(out_dtype, p.tokens, p.heads, kPrefillVDim);
      for (Mirror* t : {&k_nope, &k_rope, &v}) {
        fill_wide(t->host, rng);
        t->upload();
      }
      k_out.poison();
      v_out.poison();
      SCOPED_TRACE(testing::Message() << "k_nope " << k_nope.layout() << " k_rope " << k_rope.layout()
                                      << " v " << v.layout() << " k_out " << k_out.layout()
                                      << " scales " << p.k_scale_inv << ", " << p.v_scale_inv);
      pack_prefill_kv(k_nope.host_view(), k_rope.host_view(), v.host_view(), k_out.host_view(),
                      v_out.host_view(), p.k_scale_inv, p.v_scale_inv);
      pack_prefill_kv(k_nope.device_view(), k_rope.device_view(), v.device_view(),
                      k_out.device_view(), v_out.device_view(), p.k_scale_inv, p.v_scale_inv);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(bitwise_equal(k_out.download(), k_out.host)) << "k_out";
      EXPECT_TRUE(bitwise_equal(v_out.download(), v_out.host)) << "v_out";
    }
  }
}

// v_out in the kFp8Transposed layout (prefill.h): the GPU's bytes equal the reference's, the
// positions of the last group's missing tokens included, and nothing past them (poisoned) or in
// the gaps of a padded dim stride is written.
TEST_P(QuantizeGpu, PackPrefillKvTransposedValuesMatchReference) {
  SPEEDMLA_REQUIRE_GPU();
  std::mt19937_64 rng = seeded_rng();
  const DType in = GetParam();
  // Vector path (aligned); v and k_nope rows of a [T, H, 256] projection (pad 128); the scalar
  // path (k_nope one element off 16-byte alignment); negative scales on both paths (the padding
  // stays +0: a scaled zero would be -0, which the GPU once wrote).
  const PackCase cases[] = {{0, 4, in},
                            {1, 1, in},
                            {16, 16, in},
                            {17, 3, in, true, 0, 0, 0.5f, 2.f},
                            {45, 8, in},
                            {50, 4, in, false, 128},
                            {33, 2, in, false, 0, 1, 2.f, 0.25f},
                            {19, 2, in, false, 0, 0, -1.f, -1.f},
                            {5, 3, in, false, 0, 1, -0.5f, -2.f}};
  for (const PackCase& p : cases) {
    for (const int64_t spare : {int64_t{0}, int64_t{32}}) {  // positions past the tokens' groups
      const int64_t positions = (p.tokens + 15) / 16 * 16 + spare;
      Mirror k_rope = p.rope_3d ? Mirror(in, {p.tokens, 1, kRopeDim}) : Mirror(in, {p.tokens, kRopeDim});
      Mirror k_nope = head_rows(in, p.tokens, p.heads, kNopeDim, p.pad, p.offset);
      Mirror v = head_rows(p.v_dtype, p.tokens, p.heads, kPrefillVDim, p.pad);
      Mirror k_out = head_rows(DType::kFloat8E4M3, p.tokens, p.heads, kPrefillQkDim);
      // Dim stride: the positions plus 16 bytes of gap.
      Mirror v_out(DType::kFloat8E4M3, {p.heads, kPrefillVDim, positions},
                   {kPrefillVDim * (positions + 16), positions + 16, 1});
      for (Mirror* t : {&k_nope, &k_rope, &v}) {
        fill_wide(t->host, rng);
        t->upload();
      }
      k_out.poison();
      v_out.poison();
      SCOPED_TRACE(testing::Message() << "tokens " << p.tokens << " heads " << p.heads << " positions " << positions
                                      << " v " << v.layout());
      pack_prefill_kv(k_nope.host_view(), k_rope.host_view(), v.host_view(), k_out.host_view(), v_out.host_view(),
                      PrefillValueLayout::kFp8Transposed, p.k_scale_inv, p.v_scale_inv);
      pack_prefill_kv(k_nope.device_view(), k_rope.device_view(), v.device_view(), k_out.device_view(),
                      v_out.device_view(), PrefillValueLayout::kFp8Transposed, p.k_scale_inv, p.v_scale_inv);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      EXPECT_TRUE(bitwise_equal(k_out.download(), k_out.host)) << "k_out";
      EXPECT_TRUE(bitwise_equal(v_out.download(), v_out.host)) << "v_out";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(InputDtypes, QuantizeGpu,
                         testing::Values(DType::kBFloat16, DType::kFloat16, DType::kFloat32),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
