// mla_prefill with v in the kFp8Transposed layout (prefill.h) on the CPU: the same values give
// bit-identical results to the token-major layout, and the layout's own arguments are checked.
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "common/prefill_problem.h"
#include "common/util.h"
#include "speedmla/error.h"
#include "speedmla/prefill.h"

namespace speedmla::test {
namespace {

PrefillProblemSpec transposed_spec(bool causal) {
  // Requests that start off the layout's 16-token groups and lengths across them.
  return {.name = "value-layout", .dtype = DType::kFloat8E4M3, .heads = 4, .kv_heads = 2, .causal = causal,
          .requests = {{3, 5}, {17, 17}, {0, 9}, {40, 33}, {1, 1}, {5, 0}},
          .v_layout = PrefillValueLayout::kFp8Transposed};
}

TEST(PrefillValueLayout, TransposedValuesGiveTheTokenMajorResultBitForBit) {
  for (bool causal : {true, false}) {
    const PrefillProblem pb = make_prefill_problem(transposed_spec(causal));
    const PrefillResult expected = prefill_reference(pb);
    PrefillResult actual{HostTensor(DType::kBFloat16, {pb.q.shape[0], pb.spec.heads, kPrefillVDim}),
                         HostTensor(DType::kFloat32, {pb.q.shape[0], pb.spec.heads})};
    mla_prefill(pb.q, pb.k, pb.v_transposed.view(), PrefillValueLayout::kFp8Transposed, pb.cu_q.view(),
                pb.cu_k.view(), actual.out.view(), actual.lse.view(), causal, pb.spec.softmax_scale);
    ASSERT_EQ(actual.out.nbytes(), expected.out.nbytes());
    EXPECT_EQ(std::memcmp(actual.out.data<uint8_t>(), expected.out.data<uint8_t>(), actual.out.nbytes()), 0)
        << pb.spec.label();
    EXPECT_EQ(std::memcmp(actual.lse.data<uint8_t>(), expected.lse.data<uint8_t>(), actual.lse.nbytes()), 0)
        << pb.spec.label();
  }
}

TEST(PrefillValueLayout, PositionsFollowThePFragmentOrder) {
  // Token 8a + 2k + b of a group at position 4k + 2a + b; groups in place.
  for (int t = 0; t < 64; ++t) {
    const int a = (t % 16) / 8, k = (t % 8) / 2, b = t % 2;
    EXPECT_EQ(fp8_transposed_value_position(t), 16 * (t / 16) + 4 * k + 2 * a + b) << "token " << t;
  }
}

// Runs `call` and expects an Error whose message contains `fragment`.
template <typename Call>
void expect_error(Call call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "no error; expected one containing: " << fragment;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
  }
}

TEST(PrefillValueLayout, RefusesWhatTheLayoutCannotHold) {
  const PrefillProblem pb = make_prefill_problem(transposed_spec(true));
  HostTensor out(DType::kBFloat16, {pb.q.shape[0], pb.spec.heads, kPrefillVDim});
  auto call = [&](const TensorView& v, PrefillValueLayout layout) {
    mla_prefill(pb.q, pb.k, v, layout, pb.cu_q.view(), pb.cu_k.view(), out.view(), std::nullopt, true, 0.1f);
  };
  // Token positions not a multiple of 16, or fewer than the keys.
  TensorView short_v = pb.v_transposed.view();
  short_v.shape[2] = 8;
  expect_error([&] { call(short_v, PrefillValueLayout::kFp8Transposed); }, "v.shape[2]");
  TensorView odd_v = pb.v_transposed.view();
  odd_v.shape[2] -= 1;
  expect_error([&] { call(odd_v, PrefillValueLayout::kFp8Transposed); }, "multiple of 16");
  // The token-major layout's shape given as transposed, and the reverse.
  expect_error([&] { call(pb.v, PrefillValueLayout::kFp8Transposed); }, "v");
  expect_error([&] { call(pb.v_transposed.view(), PrefillValueLayout::kTokenMajor); }, "v");
  // Not a layout.
  expect_error([&] { call(pb.v, static_cast<PrefillValueLayout>(7)); }, "v_layout");
}

TEST(PrefillValueLayout, TransposedValuesAreFp8Only) {
  PrefillProblemSpec spec = transposed_spec(true);
  spec.dtype = DType::kBFloat16;
  spec.v_layout = PrefillValueLayout::kTokenMajor;
  const PrefillProblem pb = make_prefill_problem(spec);
  HostTensor out(DType::kBFloat16, {pb.q.shape[0], pb.spec.heads, kPrefillVDim});
  HostTensor v_t(DType::kBFloat16, {pb.spec.kv_heads, kPrefillVDim, 48});
  expect_error(
      [&] {
        mla_prefill(pb.q, pb.k, v_t.view(), PrefillValueLayout::kFp8Transposed, pb.cu_q.view(), pb.cu_k.view(),
                    out.view(), std::nullopt, true, 0.1f);
      },
      "v_layout kFp8Transposed needs FP8");
}

}  // namespace
}  // namespace speedmla::test
