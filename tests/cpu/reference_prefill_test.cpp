// reference::mla_prefill against the textbook formula, request by request and head by head.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <utility>
#include <vector>

#include "common/util.h"
#include "reference_testing.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

struct PrefillCase {
  DType dtype = DType::kBFloat16;
  int64_t heads = 4;
  int64_t kv_heads = 4;
  bool causal = true;
  std::vector<std::pair<int64_t, int64_t>> lengths;  // (len_q, len_k) of each request
  int64_t unused_rows = 3;  // packed rows past cu_seqlens[B] (must stay untouched)
  int64_t pad = 0;          // extra heads and columns around every row: strided views
  bool with_lse = true;
  float softmax_scale = 0.07f;
  float output_scale = 1.0f;
};

// A [rows, heads, dim] tensor viewed inside a buffer with `pad` extra heads and columns.
struct Packed {
  HostTensor buffer;
  TensorView view;
  double at(int64_t row, int64_t head, int64_t d) const {
    return get(buffer, view.stride(0) * row + view.stride(1) * head + d);
  }
};

Packed random_packed(DType dtype, int64_t rows, int64_t heads, int64_t dim, int64_t pad,
                     std::mt19937_64& rng) {
  Packed p;
  p.buffer = HostTensor(dtype, {rows, heads + pad, dim + pad});
  fill_uniform(p.buffer, rng, -1.0, 1.0);
  p.view = p.buffer.view();
  p.view.shape = {rows, heads, dim};
  return p;
}

HostTensor cu_seqlens(const std::vector<int64_t>& lengths) {
  HostTensor cu(DType::kInt32, {static_cast<int64_t>(lengths.size()) + 1});
  for (size_t b = 0; b < lengths.size(); ++b)
    cu.data<int32_t>()[b + 1] = cu.data<int32_t>()[b] + static_cast<int32_t>(lengths[b]);
  return cu;
}

void check_prefill(const PrefillCase& c) {
  std::mt19937_64 rng = seeded_rng();
  std::vector<int64_t> len_q, len_k;
  for (auto [lq, lk] : c.lengths) {
    len_q.push_back(lq);
    len_k.push_back(lk);
  }
  const HostTensor cu_q = cu_seqlens(len_q), cu_k = cu_seqlens(len_k);
  const auto batch = static_cast<int64_t>(c.lengths.size());
  const int64_t total_q = cu_q.data<int32_t>()[batch] + c.unused_rows;
  const int64_t total_k = cu_k.data<int32_t>()[batch] + c.unused_rows;
  const Packed q = random_packed(c.dtype, total_q, c.heads, kPrefillQkDim, c.pad, rng);
  const Packed k = random_packed(c.dtype, total_k, c.kv_heads, kPrefillQkDim, c.pad, rng);
  const Packed v = random_packed(c.dtype, total_k, c.kv_heads, kPrefillVDim, c.pad, rng);
  HostTensor out(DType::kBFloat16, {total_q, c.heads, kPrefillVDim});
  HostTensor lse(DType::kFloat32, {total_q, c.heads});
  fill_bytes(out, 0xFF);
  fill_bytes(lse, 0xFF);
  reference::mla_prefill(q.view, k.view, v.view, cu_q.view(), cu_k.view(), out.view(),
                         c.with_lse ? std::optional(lse.view()) : std::nullopt, c.causal,
                         c.softmax_scale, c.output_scale);

  ElementChecker check;
  const int64_t group = c.heads / c.kv_heads;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q0 = cu_q.data<int32_t>()[b], k0 = cu_k.data<int32_t>()[b];
    for (int64_t i = 0; i < len_q[b]; ++i) {
      // Bottom-right causal: query i sees keys j <= i + (len_k - len_q).
      const int64_t visible =
          c.causal ? std::clamp<int64_t>(i + len_k[b] - len_q[b] + 1, 0, len_k[b]) : len_k[b];
      for (int64_t h = 0; h < c.heads; ++h) {
        std::vector<double> query(kPrefillQkDim);
        for (int64_t d = 0; d < kPrefillQkDim; ++d) query[d] = q.at(q0 + i, h, d);
        std::vector<std::vector<double>> keys(visible, std::vector<double>(kPrefillQkDim));
        std::vector<std::vector<double>> values(visible, std::vector<double>(kPrefillVDim));
        for (int64_t j = 0; j < visible; ++j) {
          for (int64_t d = 0; d < kPrefillQkDim; ++d) keys[j][d] = k.at(k0 + j, h / group, d);
          for (int64_t d = 0; d < kPrefillVDim; ++d) values[j][d] = v.at(k0 + j, h / group, d);
        }
        const NaiveAttention expected =
            naive_attention(query, keys, values, c.softmax_scale, c.output_scale, kPrefillVDim);
        const int64_t row = (q0 + i) * c.heads + h;
        for (int64_t d = 0; d < kPrefillVDim; ++d)
          check.bf16(get(out, row * kPrefillVDim + d), expected.out[d], "out", {b, i, h, d});
        if (c.with_lse) check.fp32(get(lse, row), expected.lse, "lse", {b, i, h});
      }
    }
  }
  // Rows past cu_seqlens_q[B], and lse when not requested, keep their poison bytes.
  const int64_t first_unused = cu_q.data<int32_t>()[batch] * c.heads;
  for (int64_t i = first_unused * kPrefillVDim; i < out.numel(); ++i)
    ASSERT_EQ(out.data<uint16_t>()[i], 0xFFFF) << "out element " << i << " was written";
  for (int64_t i = c.with_lse ? first_unused : 0; i < lse.numel(); ++i)
    ASSERT_EQ(lse.data<uint32_t>()[i], 0xFFFFFFFFu) << "lse element " << i << " was written";
}

// Shorter, equal and longer query than key ranges, single tokens, and a tail of keys.
const std::vector<std::pair<int64_t, int64_t>> kMixedLengths = {
    {5, 40}, {33, 33}, {40, 7}, {1, 1}, {17, 64}, {1, 30}};

TEST(ReferencePrefill, CausalIsBottomRightAligned) {
  PrefillCase c;
  c.lengths = kMixedLengths;
  check_prefill(c);
}

TEST(ReferencePrefill, NonCausalSeesEveryKey) {
  PrefillCase c;
  c.causal = false;
  c.lengths = kMixedLengths;
  check_prefill(c);
}

TEST(ReferencePrefill, GroupedQueryHeadsShareTheirKvHead) {
  for (auto [heads, kv_heads] : {std::pair{8, 2}, {6, 1}, {3, 3}, {16, 4}}) {
    SCOPED_TRACE(testing::Message() << "H " << heads << " H_kv " << kv_heads);
    PrefillCase c;
    c.heads = heads;
    c.kv_heads = kv_heads;
    c.lengths = {{9, 20}, {12, 12}};
    check_prefill(c);
  }
}

TEST(ReferencePrefill, ZeroLengthRequests) {
  for (bool causal : {true, false}) {
    PrefillCase c;
    c.causal = causal;
    c.lengths = {{0, 10}, {5, 0}, {0, 0}, {3, 4}, {0, 0}};  // no keys: out 0, lse -inf
    check_prefill(c);
  }
}

TEST(ReferencePrefill, Fp8InputsWithOutputScaleAndNoLse) {
  PrefillCase c;
  c.dtype = DType::kFloat8E4M3;
  c.heads = 8;
  c.kv_heads = 2;
  c.lengths = {{20, 50}, {7, 7}};
  c.with_lse = false;
  c.output_scale = 1.7f;
  check_prefill(c);
}

TEST(ReferencePrefill, StridedViews) {
  PrefillCase c;
  c.pad = 8;
  c.heads = 4;
  c.kv_heads = 2;
  c.lengths = {{11, 30}, {30, 11}};
  check_prefill(c);
}

}  // namespace
}  // namespace speedmla::test
