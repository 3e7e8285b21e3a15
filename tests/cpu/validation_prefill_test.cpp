// mla_prefill refuses every bad argument with an Error that names it; good CPU arguments run the
// reference.
#include <gtest/gtest.h>

#include <cstring>
#include <functional>
#include <initializer_list>
#include <limits>
#include <string>

#include "common/util.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr Device kCuda{DeviceKind::kCUDA, 0};

// The arguments of one mla_prefill call.
struct PrefillArgs {
  TensorView q, k, v, cu_seqlens_q, cu_seqlens_k, out;
  std::optional<TensorView> lse;
  float softmax_scale = 0.1f, output_scale = 1.0f;
  void call() const {
    mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, /*causal=*/true, softmax_scale,
                output_scale);
  }
};

// A valid problem: two requests, 4 query heads over 2 KV heads. Each check breaks one thing.
class PrefillValidation : public testing::Test {
 protected:
  PrefillValidation() {
    std::mt19937_64 rng(7);
    fill_uniform(q_, rng, -1.0, 1.0);
    fill_uniform(k_, rng, -1.0, 1.0);
    fill_uniform(v_, rng, -1.0, 1.0);
    set_cu_seqlens({0, 2, 6}, {0, 3, 8});
  }

  PrefillArgs valid() const {
    return {q_.view(), k_.view(), v_.view(), cu_q_.view(), cu_k_.view(), out_.view(), lse_.view()};
  }

  void set_cu_seqlens(std::initializer_list<int32_t> q, std::initializer_list<int32_t> k) {
    std::copy(q.begin(), q.end(), cu_q_.data<int32_t>());
    std::copy(k.begin(), k.end(), cu_k_.data<int32_t>());
  }

  // Calls mla_prefill with valid arguments changed by `breakage` and expects an Error whose
  // message starts with the function name and holds every given part.
  void expect_error(const std::function<void(PrefillArgs&)>& breakage,
                    std::initializer_list<const char*> parts) {
    PrefillArgs args = valid();
    breakage(args);
    try {
      args.call();
      ADD_FAILURE() << "no Error thrown; expected one mentioning " << *parts.begin();
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_EQ(message.rfind("mla_prefill: ", 0), 0u) << message;
      for (const char* part : parts) EXPECT_NE(message.find(part), std::string::npos) << message;
    }
  }

  HostTensor q_{DType::kBFloat16, {6, 4, 192}}, k_{DType::kBFloat16, {8, 2, 192}},
      v_{DType::kBFloat16, {8, 2, 128}}, cu_q_{DType::kInt32, {3}}, cu_k_{DType::kInt32, {3}},
      out_{DType::kBFloat16, {6, 4, 128}}, lse_{DType::kFloat32, {6, 4}};
};

TEST_F(PrefillValidation, ValidCpuArgumentsRunTheReference) {
  PrefillArgs args = valid();
  ASSERT_NO_THROW(args.call());
  HostTensor expected_out(DType::kBFloat16, {6, 4, 128}), expected_lse(DType::kFloat32, {6, 4});
  reference::mla_prefill(args.q, args.k, args.v, args.cu_seqlens_q, args.cu_seqlens_k,
                         expected_out.view(), expected_lse.view(), true, 0.1f, 1.0f);
  EXPECT_EQ(std::memcmp(out_.data<uint8_t>(), expected_out.data<uint8_t>(), out_.nbytes()), 0);
  EXPECT_EQ(std::memcmp(lse_.data<uint8_t>(), expected_lse.data<uint8_t>(), lse_.nbytes()), 0);
  args.lse.reset();  // lse is optional
  EXPECT_NO_THROW(args.call());
}

TEST_F(PrefillValidation, WrongDtypes) {
  expect_error([](PrefillArgs& a) { a.q.dtype = a.k.dtype = a.v.dtype = DType::kFloat32; },
               {"q must be float8_e4m3fn or bfloat16", "float32"});
  expect_error([](PrefillArgs& a) { a.k.dtype = DType::kFloat8E4M3; }, {"k must have the dtype of q"});
  expect_error([](PrefillArgs& a) { a.v.dtype = DType::kFloat8E4M3; }, {"v must have the dtype of q"});
  expect_error([](PrefillArgs& a) { a.cu_seqlens_q.dtype = DType::kInt64; }, {"cu_seqlens_q must be int32"});
  expect_error([](PrefillArgs& a) { a.cu_seqlens_k.dtype = DType::kFloat32; }, {"cu_seqlens_k must be int32"});
  expect_error([](PrefillArgs& a) { a.out.dtype = DType::kFloat32; }, {"out must be bfloat16"});
  expect_error([](PrefillArgs& a) { a.lse->dtype = DType::kBFloat16; }, {"lse must be float32"});
}

TEST_F(PrefillValidation, WrongNumberOfDimensions) {
  expect_error([](PrefillArgs& a) { a.q.ndim = 2; }, {"q must have 3 dimensions"});
  expect_error([](PrefillArgs& a) { a.lse->ndim = 3; }, {"lse must have 2 dimensions"});
  expect_error([](PrefillArgs& a) { a.cu_seqlens_k.ndim = 2; }, {"cu_seqlens_k must have 1 dimensions"});
}

TEST_F(PrefillValidation, WrongHeadDims) {
  expect_error([](PrefillArgs& a) { a.q.shape[2] = 128; }, {"q.shape[2] must be 192"});
  expect_error([](PrefillArgs& a) { a.k.shape[2] = 576; }, {"k.shape[2] must be 192"});
  expect_error([](PrefillArgs& a) { a.v.shape[2] = 192; }, {"v.shape[2] must be 128"});
  expect_error([](PrefillArgs& a) { a.out.shape[2] = 192; }, {"out.shape[2] must be 128"});
}

TEST_F(PrefillValidation, HeadsNotAMultipleOfKvHeads) {
  for (int64_t heads : {3, 1}) {
    expect_error([=](PrefillArgs& a) { a.q.shape[1] = a.out.shape[1] = a.lse->shape[1] = heads; },
                 {"q.shape[1] (H) must be a positive multiple of k.shape[1] (H_kv = 2)"});
  }
  expect_error([](PrefillArgs& a) { a.k.shape[1] = a.v.shape[1] = 0; }, {"k.shape[1] (H_kv) must be >= 1"});
}

TEST_F(PrefillValidation, MismatchedShapes) {
  expect_error([](PrefillArgs& a) { a.v.shape[0] = 7; }, {"v.shape[0] must be 8"});
  expect_error([](PrefillArgs& a) { a.v.shape[1] = 1; }, {"v.shape[1] must be 2"});
  expect_error([](PrefillArgs& a) { a.out.shape[0] = 5; }, {"out.shape[0] must be 6"});
  expect_error([](PrefillArgs& a) { a.lse->shape[1] = 2; }, {"lse.shape[1] must be 4"});
  expect_error([](PrefillArgs& a) { a.cu_seqlens_k.shape[0] = 2; }, {"cu_seqlens_k.shape[0] must be 3"});
  expect_error([](PrefillArgs& a) { a.cu_seqlens_q.shape[0] = a.cu_seqlens_k.shape[0] = 0; },
               {"cu_seqlens_q must have B+1 >= 1 entries"});
}

TEST_F(PrefillValidation, NonContiguousLastDim) {
  expect_error([](PrefillArgs& a) { a.q.strides[2] = 2; }, {"q must be contiguous in its last dimension"});
  expect_error([](PrefillArgs& a) { a.k.strides[2] = 2; }, {"k must be contiguous in its last dimension"});
  expect_error([](PrefillArgs& a) { a.v.strides[2] = 2; }, {"v must be contiguous in its last dimension"});
  expect_error([](PrefillArgs& a) { a.out.strides[2] = 2; }, {"out must be contiguous in its last dimension"});
}

TEST_F(PrefillValidation, MismatchedDevices) {
  expect_error([](PrefillArgs& a) { a.k.device = kCuda; }, {"k must be on cpu", "cuda:0"});
  expect_error([](PrefillArgs& a) { a.cu_seqlens_q.device = kCuda; }, {"cu_seqlens_q must be on cpu"});
  expect_error([](PrefillArgs& a) { a.lse->device = kCuda; }, {"lse must be on cpu"});
  expect_error([](PrefillArgs& a) { a.q.device = kCuda; }, {"k must be on cuda:0, got cpu"});
}

// What the SM90 kernel needs beyond the contract is checked before anything touches a device
// (these views claim CUDA without one).
TEST_F(PrefillValidation, GpuRequirements) {
  auto on_cuda = [](PrefillArgs& a) {
    for (TensorView* t : {&a.q, &a.k, &a.v, &a.cu_seqlens_q, &a.cu_seqlens_k, &a.out, &*a.lse}) t->device = kCuda;
  };
  expect_error(
      [&](PrefillArgs& a) {
        on_cuda(a);
        a.softmax_scale = -0.1f;
      },
      {"softmax_scale must be > 0 on the GPU"});
  expect_error(
      [&](PrefillArgs& a) {
        on_cuda(a);
        a.q.strides[0] -= 1;  // a token stride that is no multiple of 16 bytes
      },
      {"q.stride(0) must be a multiple of 16 bytes"});
}

TEST_F(PrefillValidation, BadCuSeqlensValues) {
  auto unchanged = [](PrefillArgs&) {};
  set_cu_seqlens({1, 2, 6}, {0, 3, 8});
  expect_error(unchanged, {"cu_seqlens_q[0] must be 0, got 1"});
  set_cu_seqlens({0, 2, 6}, {0, 9, 8});
  expect_error(unchanged, {"cu_seqlens_k must be non-decreasing", "cu_seqlens_k[2] = 8"});
  set_cu_seqlens({0, 2, 7}, {0, 3, 8});
  expect_error(unchanged, {"cu_seqlens_q[2] must be <= q.shape[0] = 6, got 7"});
  set_cu_seqlens({0, 2, 6}, {0, -1, 8});
  expect_error(unchanged, {"cu_seqlens_k must be non-decreasing"});
}

TEST_F(PrefillValidation, OverlappingOutputs) {
  expect_error([](PrefillArgs& a) { a.out.data = a.q.data; }, {"out must not overlap q"});
  expect_error([](PrefillArgs& a) { a.lse->data = a.out.data; }, {"lse must not overlap out"});
  expect_error([](PrefillArgs& a) { a.out.strides[0] = 0; },  // every row at one address
               {"out is written, so no two of its elements may share an address"});
}

TEST_F(PrefillValidation, NonFiniteScales) {
  expect_error([](PrefillArgs& a) { a.softmax_scale = std::numeric_limits<float>::quiet_NaN(); },
               {"softmax_scale must be finite"});
  expect_error([](PrefillArgs& a) { a.output_scale = std::numeric_limits<float>::infinity(); },
               {"output_scale must be finite"});
}

}  // namespace
}  // namespace speedmla::test
