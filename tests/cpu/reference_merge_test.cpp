// reference::merge_attn_states: identities of the LSE merge, and agreement with attention over
// the union of the keys (computed with the naive formula).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "common/util.h"
#include "reference_testing.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr int64_t kTokens = 5, kHeads = 3, kDim = 24, kQkDim = 16;
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

// A partial attention result: out [T, H, D] and lse [T, H].
struct State {
  HostTensor out, lse;
  explicit State(DType dtype = DType::kFloat32)
      : out(dtype, {kTokens, kHeads, kDim}), lse(DType::kFloat32, {kTokens, kHeads}) {}
};

// An FP32 copy of `s` (exact for BF16 and FP32 states).
State fp32_copy(const State& s) {
  State copy;
  for (int64_t i = 0; i < copy.out.numel(); ++i) set(copy.out, i, get(s.out, i));
  for (int64_t i = 0; i < copy.lse.numel(); ++i) set(copy.lse, i, get(s.lse, i));
  return copy;
}

State merged(const State& a, const State& b, DType dtype = DType::kFloat32) {
  State result(dtype);
  reference::merge_attn_states(a.out.view(), a.lse.view(), b.out.view(), b.lse.view(),
                               result.out.view(), result.lse.view());
  return result;
}

// Attention of every (token, head) row over random keys split into `num_parts` disjoint
// consecutive ranges (some may be empty): one state per part, and the naive attention over all.
struct SplitAttention {
  std::vector<State> parts;
  std::vector<NaiveAttention> whole;  // per row t * H + h
};

SplitAttention split_attention(int num_parts, DType dtype, std::mt19937_64& rng) {
  SplitAttention split;
  for (int p = 0; p < num_parts; ++p) split.parts.emplace_back(dtype);
  std::uniform_real_distribution<double> value(-1.0, 1.0);
  std::uniform_int_distribution<int> key_count(1, 40);
  auto random_vector = [&](int64_t n) {
    std::vector<double> v(n);
    for (double& x : v) x = value(rng);
    return v;
  };
  for (int64_t row = 0; row < kTokens * kHeads; ++row) {
    const std::vector<double> q = random_vector(kQkDim);
    std::vector<std::vector<double>> keys, values;
    for (int n = key_count(rng); n > 0; --n) {
      keys.push_back(random_vector(kQkDim));
      values.push_back(random_vector(kDim));
    }
    split.whole.push_back(naive_attention(q, keys, values, 0.9, 1.0, kDim));
    // Random cut points; a part may get no key.
    std::vector<size_t> cuts = {0};
    for (int p = 1; p < num_parts; ++p)
      cuts.push_back(std::uniform_int_distribution<size_t>(cuts.back(), keys.size())(rng));
    cuts.push_back(keys.size());
    for (int p = 0; p < num_parts; ++p) {
      const std::vector<std::vector<double>> part_keys(keys.begin() + cuts[p], keys.begin() + cuts[p + 1]);
      const std::vector<std::vector<double>> part_values(values.begin() + cuts[p], values.begin() + cuts[p + 1]);
      const NaiveAttention part = naive_attention(q, part_keys, part_values, 0.9, 1.0, kDim);
      for (int64_t d = 0; d < kDim; ++d) set(split.parts[p].out, row * kDim + d, part.out[d]);
      set(split.parts[p].lse, row, part.lse);
    }
  }
  return split;
}

void expect_same_bits(const HostTensor& actual, const HostTensor& expected, const char* what) {
  ASSERT_EQ(actual.nbytes(), expected.nbytes());
  const size_t size = dtype_size(actual.view().dtype);
  ElementChecker check;
  for (int64_t i = 0; i < actual.numel(); ++i) {
    const bool same = std::memcmp(actual.data<uint8_t>() + i * size,
                                  expected.data<uint8_t>() + i * size, size) == 0;
    check.check(same, get(actual, i), get(expected, i), what, {i});
  }
}

void expect_matches_whole(const State& state, const std::vector<NaiveAttention>& whole) {
  ElementChecker check;
  for (int64_t row = 0; row < kTokens * kHeads; ++row) {
    for (int64_t d = 0; d < kDim; ++d)
      check.fp32(get(state.out, row * kDim + d), whole[row].out[d], "out", {row, d});
    check.fp32(get(state.lse, row), whole[row].lse, "lse", {row});
  }
}

TEST(ReferenceMerge, EqualsAttentionOverTheUnionOfKeys) {
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(2, DType::kFloat32, rng);
  expect_matches_whole(merged(split.parts[0], split.parts[1]), split.whole);
}

TEST(ReferenceMerge, IsCommutative) {
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(2, DType::kFloat32, rng);
  const State ab = merged(split.parts[0], split.parts[1]), ba = merged(split.parts[1], split.parts[0]);
  expect_same_bits(ab.out, ba.out, "out");
  expect_same_bits(ab.lse, ba.lse, "lse");
}

TEST(ReferenceMerge, IsAssociativeOverThreeParts) {
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(3, DType::kFloat32, rng);
  const State &a = split.parts[0], &b = split.parts[1], &c = split.parts[2];
  const State left = merged(merged(a, b), c), right = merged(a, merged(b, c));
  expect_matches_whole(left, split.whole);
  expect_matches_whole(right, split.whole);
}

// lse -inf is a part that saw no key: whatever its output holds (NaN here), the merge returns
// the other part unchanged, in either order.
TEST(ReferenceMerge, EmptyPartReturnsTheOtherExactly) {
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(1, DType::kBFloat16, rng);
  State empty(DType::kBFloat16);
  fill_bytes(empty.out, 0xFF);
  for (int64_t i = 0; i < empty.lse.numel(); ++i) set(empty.lse, i, -kInf);
  for (const State& result : {merged(split.parts[0], empty, DType::kBFloat16),
                              merged(empty, split.parts[0], DType::kBFloat16)}) {
    expect_same_bits(result.out, split.parts[0].out, "out");
    expect_same_bits(result.lse, split.parts[0].lse, "lse");
  }
}

TEST(ReferenceMerge, TwoEmptyPartsGiveZeroAndNegInf) {
  State empty;
  for (int64_t i = 0; i < empty.lse.numel(); ++i) set(empty.lse, i, -kInf);
  const State result = merged(empty, empty);
  ElementChecker check;
  for (int64_t i = 0; i < result.out.numel(); ++i) check.same(get(result.out, i), 0.0, "out", {i});
  for (int64_t i = 0; i < result.lse.numel(); ++i) check.same(get(result.lse, i), -kInf, "lse", {i});
}

TEST(ReferenceMerge, InPlaceIntoTheFirstPart) {
  std::mt19937_64 rng = seeded_rng();
  SplitAttention split = split_attention(2, DType::kBFloat16, rng);
  const State expected = merged(split.parts[0], split.parts[1], DType::kBFloat16);
  State& a = split.parts[0];
  reference::merge_attn_states(a.out.view(), a.lse.view(), split.parts[1].out.view(),
                               split.parts[1].lse.view(), a.out.view(), a.lse.view());
  expect_same_bits(a.out, expected.out, "out");
  expect_same_bits(a.lse, expected.lse, "lse");
}

// BF16 and FP32 parts mixed, a BF16 result, no lse output: the value of the FP32 merge of the
// same (exactly widened) inputs, rounded once to BF16.
TEST(ReferenceMerge, MixedDtypesWithoutLse) {
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(2, DType::kBFloat16, rng);
  const State b_fp32 = fp32_copy(split.parts[1]);
  const State exact = merged(fp32_copy(split.parts[0]), b_fp32);

  HostTensor out(DType::kBFloat16, {kTokens, kHeads, kDim});
  reference::merge_attn_states(split.parts[0].out.view(), split.parts[0].lse.view(),
                               b_fp32.out.view(), b_fp32.lse.view(), out.view(), std::nullopt);
  ElementChecker check;
  for (int64_t i = 0; i < out.numel(); ++i) check.bf16(get(out, i), get(exact.out, i), "out", {i});
}

// out_b read through a view with padded rows and out written to one: the same bits as contiguous.
TEST(ReferenceMerge, StridedViews) {
  constexpr int64_t kPad = 8;
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(2, DType::kFloat32, rng);
  const State& a = split.parts[0];
  const State& b = split.parts[1];
  const State expected = merged(a, b);
  HostTensor b_buffer(DType::kFloat32, {kTokens, kHeads, kDim + kPad});
  HostTensor out_buffer(DType::kFloat32, {kTokens, kHeads, kDim + kPad});
  for (int64_t row = 0; row < kTokens * kHeads; ++row)
    for (int64_t d = 0; d < kDim; ++d) set(b_buffer, row * (kDim + kPad) + d, get(b.out, row * kDim + d));
  TensorView b_out = b_buffer.view(), out = out_buffer.view();
  b_out.shape[2] = out.shape[2] = kDim;
  reference::merge_attn_states(a.out.view(), a.lse.view(), b_out, b.lse.view(), out, std::nullopt);
  ElementChecker check;
  for (int64_t row = 0; row < kTokens * kHeads; ++row)
    for (int64_t d = 0; d < kDim; ++d)
      check.same(get(out_buffer, row * (kDim + kPad) + d), get(expected.out, row * kDim + d), "out",
                 {row, d});
}

TEST(ReferenceMerge, NaNPropagatesAndInfiniteLseDominates) {
  std::mt19937_64 rng = seeded_rng();
  const SplitAttention split = split_attention(2, DType::kFloat32, rng);
  State a = fp32_copy(split.parts[0]), b = fp32_copy(split.parts[1]);
  set(a.lse, 0, kNaN);  // row 0: NaN
  set(a.lse, 1, kInf);  // row 1: only a is infinitely heavy
  set(a.lse, 2, kInf);  // row 2: both are
  set(b.lse, 2, kInf);
  const State result = merged(a, b);
  ElementChecker check;
  for (int64_t d = 0; d < kDim; ++d) {
    check.same(get(result.out, d), kNaN, "out", {0, d});
    check.same(get(result.out, kDim + d), get(a.out, kDim + d), "out", {1, d});
    check.fp32(get(result.out, 2 * kDim + d),
               (get(a.out, 2 * kDim + d) + get(b.out, 2 * kDim + d)) / 2, "out", {2, d});
  }
  check.same(get(result.lse, 0), kNaN, "lse", {0});
  check.same(get(result.lse, 1), kInf, "lse", {1});
  check.same(get(result.lse, 2), kInf, "lse", {2});
}

}  // namespace
}  // namespace speedmla::test
