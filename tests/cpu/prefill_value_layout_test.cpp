// mla_prefill with v in the kFp8Transposed layout (prefill.h) on the CPU: the same values give
// bit-identical results to the token-major layout, and the layout's own arguments are checked.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>

#include "common/prefill_problem.h"
#include "common/util.h"
#include "speedmla/error.h"
#include "speedmla/prefill.h"
#include "speedmla/quantize.h"

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

// pack_prefill_kv's reference writing the layout: each value at its position, after the same
// conversion as the token-major pack; the last group's missing tokens as zeros; positions past
// that group untouched.
TEST(PrefillValueLayout, PackWritesTheTransposedLayout) {
  constexpr int64_t kTokens = 21, kHeads = 3, kNope = kPrefillQkDim - 64;
  std::mt19937_64 rng(11);
  HostTensor k_nope(DType::kBFloat16, {kTokens, kHeads, kNope}), k_rope(DType::kBFloat16, {kTokens, 64});
  HostTensor v(DType::kBFloat16, {kTokens, kHeads, kPrefillVDim});
  for (HostTensor* t : {&k_nope, &k_rope, &v}) fill_uniform(*t, rng, -4.0, 4.0);
  HostTensor k_out(DType::kFloat8E4M3, {kTokens, kHeads, kPrefillQkDim});
  HostTensor v_plain(DType::kFloat8E4M3, {kTokens, kHeads, kPrefillVDim});
  pack_prefill_kv(k_nope.view(), k_rope.view(), v.view(), k_out.view(), v_plain.view(), 1.f, 0.5f);
  constexpr int64_t kPositions = 48;  // the tokens' two groups, and one more
  HostTensor k_out_t(DType::kFloat8E4M3, {kTokens, kHeads, kPrefillQkDim});
  HostTensor v_t(DType::kFloat8E4M3, {kHeads, kPrefillVDim, kPositions});
  fill_bytes(v_t, 0x55);
  pack_prefill_kv(k_nope.view(), k_rope.view(), v.view(), k_out_t.view(), v_t.view(),
                  PrefillValueLayout::kFp8Transposed, 1.f, 0.5f);
  EXPECT_EQ(std::memcmp(k_out.data<uint8_t>(), k_out_t.data<uint8_t>(), k_out.nbytes()), 0);
  const uint8_t* plain = v_plain.data<uint8_t>();
  const uint8_t* transposed = v_t.data<uint8_t>();
  for (int64_t h = 0; h < kHeads; ++h)
    for (int64_t d = 0; d < kPrefillVDim; ++d)
      for (int64_t t = 0; t < kPositions; ++t) {
        const uint8_t expected = t < kTokens ? plain[(t * kHeads + h) * kPrefillVDim + d] : t < 32 ? 0 : 0x55;
        ASSERT_EQ(transposed[(h * kPrefillVDim + d) * kPositions + fp8_transposed_value_position(t)],
                  expected)
            << "token " << t << " head " << h << " dim " << d;
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

TEST(PrefillValueLayout, PackRefusesWhatTheLayoutCannotHold) {
  HostTensor k_nope(DType::kBFloat16, {5, 2, kPrefillQkDim - 64}), k_rope(DType::kBFloat16, {5, 64});
  HostTensor v(DType::kBFloat16, {5, 2, kPrefillVDim});
  HostTensor k_fp8(DType::kFloat8E4M3, {5, 2, kPrefillQkDim}), k_bf16(DType::kBFloat16, {5, 2, kPrefillQkDim});
  HostTensor v_t(DType::kFloat8E4M3, {2, kPrefillVDim, 16}), v_t_short(DType::kFloat8E4M3, {2, kPrefillVDim, 4});
  HostTensor v_t_bf16(DType::kBFloat16, {2, kPrefillVDim, 16}), v_t_heads(DType::kFloat8E4M3, {3, kPrefillVDim, 16});
  auto pack = [&](const HostTensor& k_out, const HostTensor& v_out) {
    pack_prefill_kv(k_nope.view(), k_rope.view(), v.view(), k_out.view(), v_out.view(),
                    PrefillValueLayout::kFp8Transposed);
  };
  expect_error([&] { pack(k_bf16, v_t_bf16); }, "k_out must be FP8 e4m3 with v_layout kFp8Transposed");
  expect_error([&] { pack(k_fp8, v_t_short); }, "v_out.shape[2]");
  expect_error([&] { pack(k_fp8, v_t_heads); }, "v_out");
  EXPECT_NO_THROW(pack(k_fp8, v_t));
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
      "q (and k, v) must be FP8 e4m3 with v_layout kFp8Transposed");
}

}  // namespace
}  // namespace speedmla::test
