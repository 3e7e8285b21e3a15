// quantize_fp8 and pack_prefill_kv refuse every bad argument with an Error that names it; good
// CPU arguments run the reference.
#include <gtest/gtest.h>

#include <limits>
#include <random>

#include "common/op_testing.h"
#include "common/util.h"
#include "speedmla/quantize.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr Device kCuda{DeviceKind::kCUDA, 0};

// A valid quantize_fp8 call. Tests break one thing each.
class QuantizeValidation : public testing::Test {
 protected:
  QuantizeValidation() {
    std::mt19937_64 rng(3);
    fill_uniform(x_, rng, -500.0, 500.0);
  }
  testing::AssertionResult refused(const char* text) {
    return throws_error([&] { quantize_fp8(x, out, scale_inv); }, {"quantize_fp8: ", text});
  }

  HostTensor x_{DType::kBFloat16, {4, 16}}, out_{DType::kFloat8E4M3, {4, 16}};
  TensorView x = x_.view(), out = out_.view();
  float scale_inv = 0.5f;
};

TEST_F(QuantizeValidation, ValidCpuArgumentsRunTheReference) {
  ASSERT_NO_THROW(quantize_fp8(x, out, scale_inv));
  HostTensor expected(DType::kFloat8E4M3, {4, 16});
  reference::quantize_fp8(x, expected.view(), scale_inv);
  EXPECT_TRUE(bitwise_equal(out_, expected));
}

TEST_F(QuantizeValidation, Dtypes) {
  x.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(refused("x must be bfloat16 or float16 or float32"));
  x.dtype = DType::kBFloat16;
  out.dtype = DType::kBFloat16;
  EXPECT_TRUE(refused("out must be float8_e4m3fn, got bfloat16"));
}

TEST_F(QuantizeValidation, Shapes) {
  x.ndim = kMaxDims + 1;
  EXPECT_TRUE(refused("x must have at most 6 dimensions, got 7"));
  x.ndim = 2;
  out.ndim = 1;
  EXPECT_TRUE(refused("out must have 2 dimensions"));
  out.ndim = 2;
  out.shape[1] = 8;
  EXPECT_TRUE(refused("out.shape[1] must be 16"));
}

TEST_F(QuantizeValidation, LastDimContiguous) {
  x.strides[1] = 3;  // never read: validation throws first
  EXPECT_TRUE(refused("x must be contiguous in its last dimension"));
}

TEST_F(QuantizeValidation, NullData) {
  out.data = nullptr;
  EXPECT_TRUE(refused("out has a null data pointer"));
}

TEST_F(QuantizeValidation, Devices) {
  out.device = kCuda;
  EXPECT_TRUE(refused("out must be on cpu, got cuda:0"));
}

TEST_F(QuantizeValidation, Overlap) {
  out.data = x.data;
  EXPECT_TRUE(refused("out must not overlap x"));
  out = out_.view();
  out.strides[0] = 8;  // rows half on top of each other
  EXPECT_TRUE(refused("out is written, so no two of its elements may share an address"));
}

TEST_F(QuantizeValidation, Scale) {
  scale_inv = std::numeric_limits<float>::infinity();
  EXPECT_TRUE(refused("scale_inv must be finite"));
}

// A valid pack_prefill_kv call: 3 tokens, 2 heads, into FP8. Tests break one thing each.
class PackValidation : public testing::Test {
 protected:
  PackValidation() {
    std::mt19937_64 rng(9);
    for (HostTensor* t : {&k_nope_, &k_rope_, &v_}) fill_uniform(*t, rng, -2.0, 2.0);
  }
  void call() { pack_prefill_kv(k_nope, k_rope, v, k_out, v_out, k_scale_inv, v_scale_inv); }
  testing::AssertionResult refused(const char* text) {
    return throws_error([&] { call(); }, {"pack_prefill_kv: ", text});
  }

  HostTensor k_nope_{DType::kBFloat16, {3, 2, 128}}, k_rope_{DType::kBFloat16, {3, 64}},
      v_{DType::kBFloat16, {3, 2, 128}}, k_out_{DType::kFloat8E4M3, {3, 2, 192}},
      v_out_{DType::kFloat8E4M3, {3, 2, 128}};
  TensorView k_nope = k_nope_.view(), k_rope = k_rope_.view(), v = v_.view(), k_out = k_out_.view(),
             v_out = v_out_.view();
  float k_scale_inv = 2.f, v_scale_inv = 0.5f;
};

TEST_F(PackValidation, ValidCpuArgumentsRunTheReference) {
  ASSERT_NO_THROW(call());
  HostTensor expected_k(DType::kFloat8E4M3, {3, 2, 192}), expected_v(DType::kFloat8E4M3, {3, 2, 128});
  reference::pack_prefill_kv(k_nope, k_rope, v, expected_k.view(), expected_v.view(), k_scale_inv,
                             v_scale_inv);
  EXPECT_TRUE(bitwise_equal(k_out_, expected_k));
  EXPECT_TRUE(bitwise_equal(v_out_, expected_v));
}

TEST_F(PackValidation, RopeWithAHeadDimIsAccepted) {
  k_rope.ndim = 3;
  k_rope.shape = {3, 1, 64};
  k_rope.strides = {64, 64, 1};
  EXPECT_NO_THROW(call());
}

TEST_F(PackValidation, InputShapes) {
  k_nope.shape[2] = 192;
  EXPECT_TRUE(refused("k_nope.shape[2] must be 128"));
  k_nope.shape[2] = 128;
  v.shape[1] = 1;
  EXPECT_TRUE(refused("v.shape[1] must be 2"));
}

TEST_F(PackValidation, RopeShape) {
  k_rope.ndim = 4;
  EXPECT_TRUE(refused("k_rope must be [T, 64] or [T, 1, 64], got 4 dimensions"));
  k_rope.ndim = 3;
  k_rope.shape = {3, 2, 64};
  k_rope.strides = {128, 64, 1};
  EXPECT_TRUE(refused("k_rope.shape[1] must be 1"));
  k_rope = k_rope_.view();
  k_rope.shape[0] = 4;
  EXPECT_TRUE(refused("k_rope.shape[0] must be 3"));
}

TEST_F(PackValidation, Dtypes) {
  k_rope.dtype = DType::kFloat32;
  EXPECT_TRUE(refused("k_rope must be bfloat16 like k_nope, got float32"));
  k_rope.dtype = DType::kBFloat16;
  v.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(refused("v must be bfloat16 or float16 or float32"));
  v.dtype = DType::kBFloat16;
  k_out.dtype = DType::kFloat32;
  EXPECT_TRUE(refused("k_out must be float8_e4m3fn or bfloat16"));
  k_out.dtype = DType::kFloat8E4M3;
  v_out.dtype = DType::kBFloat16;
  EXPECT_TRUE(refused("v_out must be float8_e4m3fn, got bfloat16"));
}

TEST_F(PackValidation, LastDimContiguous) {
  v.strides[2] = 2;
  EXPECT_TRUE(refused("v must be contiguous in its last dimension"));
}

TEST_F(PackValidation, Devices) {
  k_rope.device = kCuda;
  EXPECT_TRUE(refused("k_rope must be on cpu, got cuda:0"));
}

TEST_F(PackValidation, Overlaps) {
  v_out.data = k_out.data;
  EXPECT_TRUE(refused("k_out must not overlap v_out"));
  v_out = v_out_.view();
  v_out.data = k_nope.data;
  EXPECT_TRUE(refused("v_out must not overlap k_nope"));
  v_out = v_out_.view();
  k_out.strides[1] = 0;
  EXPECT_TRUE(refused("k_out is written, so no two of its elements may share an address"));
}

TEST_F(PackValidation, Scales) {
  v_scale_inv = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(refused("v_scale_inv must be finite"));
}

}  // namespace
}  // namespace speedmla::test
