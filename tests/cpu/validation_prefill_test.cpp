// mla_prefill refuses every bad argument with an Error that names it; good CPU arguments run the
// reference.
#include <gtest/gtest.h>

#include <cstring>
#include <initializer_list>
#include <limits>
#include <string>

#include "common/util.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr Device kCuda{DeviceKind::kCUDA, 0};

// A valid problem: two requests, 4 query heads over 2 KV heads. Tests break one thing each.
class PrefillValidation : public testing::Test {
 protected:
  PrefillValidation() {
    std::mt19937_64 rng(7);
    fill_uniform(q_, rng, -1.0, 1.0);
    fill_uniform(k_, rng, -1.0, 1.0);
    fill_uniform(v_, rng, -1.0, 1.0);
    const int32_t cu_q[] = {0, 2, 6}, cu_k[] = {0, 3, 8};
    std::memcpy(cu_q_.data<int32_t>(), cu_q, sizeof cu_q);
    std::memcpy(cu_k_.data<int32_t>(), cu_k, sizeof cu_k);
  }

  void call() {
    mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, /*causal=*/true, 0.1f, 1.0f);
  }

  // Calls mla_prefill and expects an Error whose message holds every given part.
  void expect_error(std::initializer_list<const char*> parts) {
    try {
      call();
      ADD_FAILURE() << "no Error thrown";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("mla_prefill: ", 0), 0u) << message;
      for (const char* part : parts) EXPECT_NE(message.find(part), std::string::npos) << message;
    }
  }

  HostTensor q_{DType::kBFloat16, {6, 4, 192}}, k_{DType::kBFloat16, {8, 2, 192}},
      v_{DType::kBFloat16, {8, 2, 128}}, cu_q_{DType::kInt32, {3}}, cu_k_{DType::kInt32, {3}},
      out_{DType::kBFloat16, {6, 4, 128}}, lse_{DType::kFloat32, {6, 4}};
  TensorView q = q_.view(), k = k_.view(), v = v_.view(), cu_seqlens_q = cu_q_.view(),
             cu_seqlens_k = cu_k_.view(), out = out_.view();
  std::optional<TensorView> lse = lse_.view();
};

TEST_F(PrefillValidation, ValidCpuArgumentsRunTheReference) {
  ASSERT_NO_THROW(call());
  HostTensor expected_out(DType::kBFloat16, {6, 4, 128}), expected_lse(DType::kFloat32, {6, 4});
  reference::mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, expected_out.view(),
                         expected_lse.view(), true, 0.1f, 1.0f);
  EXPECT_EQ(std::memcmp(out_.data<uint8_t>(), expected_out.data<uint8_t>(), out_.nbytes()), 0);
  EXPECT_EQ(std::memcmp(lse_.data<uint8_t>(), expected_lse.data<uint8_t>(), lse_.nbytes()), 0);
  lse.reset();  // lse is optional
  EXPECT_NO_THROW(call());
}

TEST_F(PrefillValidation, WrongDtypes) {
  q.dtype = k.dtype = v.dtype = DType::kFloat32;
  expect_error({"q must be float8_e4m3fn or bfloat16", "float32"});
  q.dtype = v.dtype = DType::kBFloat16;
  k.dtype = DType::kFloat8E4M3;
  expect_error({"k must have the dtype of q"});
  k.dtype = DType::kBFloat16;
  v.dtype = DType::kFloat8E4M3;
  expect_error({"v must have the dtype of q"});
  v.dtype = DType::kBFloat16;
  cu_seqlens_q.dtype = DType::kInt64;
  expect_error({"cu_seqlens_q must be int32"});
  cu_seqlens_q.dtype = DType::kInt32;
  cu_seqlens_k.dtype = DType::kFloat32;
  expect_error({"cu_seqlens_k must be int32"});
  cu_seqlens_k.dtype = DType::kInt32;
  out.dtype = DType::kFloat32;
  expect_error({"out must be bfloat16"});
  out.dtype = DType::kBFloat16;
  lse->dtype = DType::kBFloat16;
  expect_error({"lse must be float32"});
}

TEST_F(PrefillValidation, WrongNumberOfDimensions) {
  q.ndim = 2;
  expect_error({"q must have 3 dimensions"});
  q.ndim = 3;
  lse->ndim = 3;
  expect_error({"lse must have 2 dimensions"});
  lse->ndim = 2;
  cu_seqlens_k.ndim = 2;
  expect_error({"cu_seqlens_k must have 1 dimensions"});
}

TEST_F(PrefillValidation, WrongHeadDims) {
  q.shape[2] = 128;
  expect_error({"q.shape[2] must be 192"});
  q.shape[2] = 192;
  k.shape[2] = 576;
  expect_error({"k.shape[2] must be 192"});
  k.shape[2] = 192;
  v.shape[2] = 192;
  expect_error({"v.shape[2] must be 128"});
  v.shape[2] = 128;
  out.shape[2] = 192;
  expect_error({"out.shape[2] must be 128"});
}

TEST_F(PrefillValidation, HeadsNotAMultipleOfKvHeads) {
  q.shape[1] = out.shape[1] = lse->shape[1] = 3;
  expect_error({"q.shape[1] (H) must be a positive multiple of k.shape[1]"});
  q.shape[1] = out.shape[1] = lse->shape[1] = 1;
  expect_error({"q.shape[1] (H)"});
  q.shape[1] = out.shape[1] = lse->shape[1] = 4;
  k.shape[1] = v.shape[1] = 0;
  expect_error({"k.shape[1] (H_kv) must be >= 1"});
}

TEST_F(PrefillValidation, MismatchedShapes) {
  v.shape[0] = 7;
  expect_error({"v.shape[0] must be 8"});
  v.shape[0] = 8;
  v.shape[1] = 1;
  expect_error({"v.shape[1] must be 2"});
  v.shape[1] = 2;
  out.shape[0] = 5;
  expect_error({"out.shape[0] must be 6"});
  out.shape[0] = 6;
  lse->shape[1] = 2;
  expect_error({"lse.shape[1] must be 4"});
  lse->shape[1] = 4;
  cu_seqlens_k.shape[0] = 2;
  expect_error({"cu_seqlens_k.shape[0] must be 3"});
  cu_seqlens_k.shape[0] = 3;
  cu_seqlens_q.shape[0] = cu_seqlens_k.shape[0] = 0;
  expect_error({"cu_seqlens_q must have B+1 >= 1 entries"});
}

TEST_F(PrefillValidation, NonContiguousLastDim) {
  for (TensorView* t : {&q, &k, &v, &out}) {
    const int64_t saved = t->strides[2];
    t->strides[2] = 2;
    expect_error({"must be contiguous in its last dimension"});
    t->strides[2] = saved;
  }
  q.strides[2] = 2;
  expect_error({"q must be contiguous"});
}

TEST_F(PrefillValidation, MismatchedDevices) {
  k.device = kCuda;
  expect_error({"k must be on cpu", "cuda:0"});
  k.device = {};
  cu_seqlens_q.device = kCuda;
  expect_error({"cu_seqlens_q must be on cpu"});
  cu_seqlens_q.device = {};
  lse->device = kCuda;
  expect_error({"lse must be on cpu"});
}

TEST_F(PrefillValidation, CudaTensorsAreRefusedUntilTheGpuPathExists) {
  for (TensorView* t : {&q, &k, &v, &cu_seqlens_q, &cu_seqlens_k, &out}) t->device = kCuda;
  lse->device = kCuda;
  expect_error({"the GPU path is not available yet (CUDA tensors given); use CPU tensors"});
}

TEST_F(PrefillValidation, BadCuSeqlensValues) {
  cu_q_.data<int32_t>()[0] = 1;
  expect_error({"cu_seqlens_q[0] must be 0, got 1"});
  cu_q_.data<int32_t>()[0] = 0;
  cu_k_.data<int32_t>()[1] = 9;
  expect_error({"cu_seqlens_k must be non-decreasing", "cu_seqlens_k[2] = 8"});
  cu_k_.data<int32_t>()[1] = 3;
  cu_q_.data<int32_t>()[2] = 7;
  expect_error({"cu_seqlens_q[2] must be <= q.shape[0] = 6, got 7"});
  cu_q_.data<int32_t>()[2] = 6;
  cu_k_.data<int32_t>()[1] = -1;
  expect_error({"cu_seqlens_k must be non-decreasing"});
}

TEST_F(PrefillValidation, OutputsOverlappingInputs) {
  out.data = q.data;
  expect_error({"out must not overlap q"});
  out = out_.view();
  lse->data = out.data;
  expect_error({"lse must not overlap out"});
  lse = lse_.view();
  out.strides[0] = 0;  // every row at one address
  expect_error({"out is written, so no two of its elements may share an address"});
}

TEST_F(PrefillValidation, NonFiniteScales) {
  EXPECT_THROW(mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, true,
                           std::numeric_limits<float>::quiet_NaN()),
               Error);
  try {
    mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, true, 0.1f,
                std::numeric_limits<float>::infinity());
    ADD_FAILURE() << "no Error thrown";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("output_scale must be finite"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace speedmla::test
