// merge_attn_states refuses every bad argument with an Error that names it; good CPU arguments,
// in place included, run the reference.
#include <gtest/gtest.h>

#include <optional>
#include <random>

#include "common/op_testing.h"
#include "common/util.h"
#include "speedmla/merge.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr Device kCuda{DeviceKind::kCUDA, 0};
constexpr int64_t kT = 2, kH = 3, kD = 8;

// A valid call merging a BF16 and an FP32 state into BF16. Tests break one thing each.
class MergeValidation : public testing::Test {
 protected:
  MergeValidation() {
    std::mt19937_64 rng(5);
    for (HostTensor* t : {&out_a_, &out_b_}) fill_uniform(*t, rng, -1.0, 1.0);
    for (HostTensor* t : {&lse_a_, &lse_b_}) fill_uniform(*t, rng, -3.0, 3.0);
  }

  void call() { merge_attn_states(out_a, lse_a, out_b, lse_b, out, lse); }
  // Expects call() to throw an Error naming merge_attn_states and containing `text`.
  testing::AssertionResult refused(const char* text) {
    return throws_error([&] { call(); }, {"merge_attn_states: ", text});
  }

  HostTensor out_a_{DType::kBFloat16, {kT, kH, kD}}, lse_a_{DType::kFloat32, {kT, kH}},
      out_b_{DType::kFloat32, {kT, kH, kD}}, lse_b_{DType::kFloat32, {kT, kH}},
      out_{DType::kBFloat16, {kT, kH, kD}}, lse_{DType::kFloat32, {kT, kH}};
  TensorView out_a = out_a_.view(), lse_a = lse_a_.view(), out_b = out_b_.view(),
             lse_b = lse_b_.view(), out = out_.view();
  std::optional<TensorView> lse = lse_.view();
};

TEST_F(MergeValidation, ValidCpuArgumentsRunTheReference) {
  ASSERT_NO_THROW(call());
  HostTensor expected_out(DType::kBFloat16, {kT, kH, kD}), expected_lse(DType::kFloat32, {kT, kH});
  reference::merge_attn_states(out_a, lse_a, out_b, lse_b, expected_out.view(), expected_lse.view());
  EXPECT_TRUE(bitwise_equal(out_, expected_out));
  EXPECT_TRUE(bitwise_equal(lse_, expected_lse));
}

TEST_F(MergeValidation, InPlaceIntoAIsAccepted) {
  HostTensor expected_out(DType::kBFloat16, {kT, kH, kD}), expected_lse(DType::kFloat32, {kT, kH});
  reference::merge_attn_states(out_a, lse_a, out_b, lse_b, expected_out.view(), expected_lse.view());
  out = out_a;
  lse = lse_a;
  ASSERT_NO_THROW(call());
  EXPECT_TRUE(bitwise_equal(out_a_, expected_out));
  EXPECT_TRUE(bitwise_equal(lse_a_, expected_lse));
}

TEST_F(MergeValidation, WithoutLseIsAccepted) {
  lse = std::nullopt;
  EXPECT_NO_THROW(call());
}

TEST_F(MergeValidation, Ranks) {
  out_a.ndim = 2;
  EXPECT_TRUE(refused("out_a must have 3 dimensions"));
  out_a.ndim = 3;
  lse_b.ndim = 3;
  lse_b.shape[2] = 1;
  EXPECT_TRUE(refused("lse_b must have 2 dimensions"));
}

TEST_F(MergeValidation, Dtypes) {
  out_a.dtype = DType::kFloat16;
  EXPECT_TRUE(refused("out_a must be bfloat16 or float32, got float16"));
  out_a.dtype = DType::kBFloat16;
  lse_a.dtype = DType::kBFloat16;
  EXPECT_TRUE(refused("lse_a must be float32"));
  lse_a.dtype = DType::kFloat32;
  out.dtype = DType::kFloat8E4M3;
  EXPECT_TRUE(refused("out must be bfloat16 or float32"));
}

TEST_F(MergeValidation, Shapes) {
  out_b.shape[2] = kD / 2;
  EXPECT_TRUE(refused("out_b.shape[2] must be 8"));
  out_b.shape[2] = kD;
  lse_b.shape[1] = kH - 1;
  EXPECT_TRUE(refused("lse_b.shape[1] must be 3"));
  lse_b.shape[1] = kH;
  lse->shape[0] = kT + 1;
  EXPECT_TRUE(refused("lse.shape[0] must be 2"));
}

TEST_F(MergeValidation, LastDimContiguous) {
  out.strides[2] = 2;
  EXPECT_TRUE(refused("out must be contiguous in its last dimension"));
}

TEST_F(MergeValidation, NullData) {
  out_b.data = nullptr;
  EXPECT_TRUE(refused("out_b has a null data pointer"));
}

TEST_F(MergeValidation, Devices) {
  lse->device = kCuda;  // never touched: validation throws first
  EXPECT_TRUE(refused("lse must be on cpu, got cuda:0"));
  lse->device = Device{};
  out_a.device = kCuda;
  EXPECT_TRUE(refused("lse_a must be on cuda:0, got cpu"));
}

TEST_F(MergeValidation, OutOverlappingInputs) {
  out = out_a;
  out.data = static_cast<uint16_t*>(out_a.data) + 1;  // shifted by one element: partial overlap
  EXPECT_TRUE(refused("out must be out_a itself (in place) or not overlap it"));
  out = out_a;
  out.dtype = DType::kFloat32;  // out_a's bytes seen as another dtype: not in place
  EXPECT_TRUE(refused("out must be out_a itself (in place) or not overlap it"));
  out = out_b;
  EXPECT_TRUE(refused("out must not overlap out_b"));
  out = out_.view();
  out.data = lse_a.data;
  EXPECT_TRUE(refused("out must not overlap lse_a"));
}

TEST_F(MergeValidation, LseOverlappingOthers) {
  lse = lse_a;
  lse->data = static_cast<float*>(lse_a.data) + 1;
  EXPECT_TRUE(refused("lse must be lse_a itself (in place) or not overlap it"));
  lse = lse_b;
  EXPECT_TRUE(refused("lse must not overlap lse_b"));
  lse = lse_.view();
  lse->data = out_b.data;
  EXPECT_TRUE(refused("lse must not overlap out_b"));
}

TEST_F(MergeValidation, BroadcastOutput) {
  out.strides[1] = 0;  // every head of a token at one address
  EXPECT_TRUE(refused("out is written, so no two of its elements may share an address"));
  out = out_.view();
  lse->strides[0] = 1;  // token t+1, head h is token t, head h+1
  EXPECT_TRUE(refused("lse is written, so no two of its elements may share an address"));
}

}  // namespace
}  // namespace speedmla::test
