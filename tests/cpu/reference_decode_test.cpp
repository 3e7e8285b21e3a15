// reference::mla_decode against the textbook formula over a contiguous, un-paged copy of each
// request's keys.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "common/util.h"
#include "reference_testing.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla::test {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// One decode problem: the knobs the tests turn.
struct DecodeCase {
  DType dtype = DType::kBFloat16;
  int64_t page_size = 16;
  int64_t q_len = 1;
  int64_t heads = 4;
  std::vector<int64_t> seq_lens;
  int64_t max_pages = 0;        // block-table width; 0: the longest request's pages + 2 of padding
  int64_t page_stride_pad = 0;  // elements between the end of one page and the next
  int64_t q_pad = 0;            // extra heads and columns around q's rows: a strided view
  uint8_t poison = 0xFF;        // bytes of every cache row no request owns (0xFF is NaN)
  float softmax_scale = 0.06f;
  float output_scale = 1.0f;
  struct PageOverride {
    int64_t request, index, page;
  };
  std::vector<PageOverride> page_overrides;  // block-table entries replaced after the cache is filled
};

// Inputs and outputs of one reference::mla_decode call.
struct DecodeRun {
  int64_t max_tokens = 0;        // max_pages * page_size
  std::vector<HostTensor> keys;  // per request: its first seq_len cache rows, [seq_len, 576]
  HostTensor q_buffer;           // q is a view into it, starting at element q_base
  int64_t q_base = 0;
  TensorView q;
  HostTensor cache_buffer;
  TensorView cache;
  HostTensor block_table, seq_lens, out, lse;
};

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

DecodeRun run_decode(const DecodeCase& c, std::mt19937_64& rng) {
  DecodeRun run;
  const auto batch = static_cast<int64_t>(c.seq_lens.size());
  const int64_t ps = c.page_size, esize = static_cast<int64_t>(dtype_size(c.dtype));
  int64_t max_pages = c.max_pages;
  if (max_pages == 0) {
    for (int64_t len : c.seq_lens) max_pages = std::max(max_pages, ceil_div(std::max<int64_t>(len, 0), ps));
    max_pages += 2;
  }
  run.max_tokens = max_pages * ps;
  auto stored = [&](int64_t len) { return len >= 0 && len <= run.max_tokens; };

  // Pages: 0 is the null page, then every request's pages in a random order, then 2 spare ones.
  int64_t used_pages = 0;
  for (int64_t len : c.seq_lens) used_pages += stored(len) ? ceil_div(len, ps) : 0;
  const int64_t num_pages = 1 + used_pages + 2;
  std::vector<int32_t> page_ids(static_cast<size_t>(num_pages - 1));
  std::iota(page_ids.begin(), page_ids.end(), 1);
  std::shuffle(page_ids.begin(), page_ids.end(), rng);

  // Padding entries hold random (valid) page ids: they must not matter.
  run.block_table = HostTensor(DType::kInt32, {batch, max_pages});
  std::uniform_int_distribution<int32_t> any_page(0, static_cast<int32_t>(num_pages - 1));
  for (int64_t i = 0; i < batch * max_pages; ++i) run.block_table.data<int32_t>()[i] = any_page(rng);
  run.seq_lens = HostTensor(DType::kInt32, {batch});

  const int64_t page_stride = ps * kCacheRowDim + c.page_stride_pad;
  run.cache_buffer = HostTensor(c.dtype, {num_pages * page_stride});
  fill_bytes(run.cache_buffer, c.poison);
  run.cache = run.cache_buffer.view();
  run.cache.ndim = 3;
  run.cache.shape = {num_pages, ps, kCacheRowDim};
  run.cache.strides = {page_stride, kCacheRowDim, 1};

  size_t next_page = 0;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t len = c.seq_lens[b];
    run.seq_lens.data<int32_t>()[b] = static_cast<int32_t>(len);
    run.keys.emplace_back(c.dtype, std::initializer_list<int64_t>{stored(len) ? len : 0, kCacheRowDim});
    HostTensor& keys = run.keys.back();
    fill_uniform(keys, rng, -1.0, 1.0);
    for (int64_t p = 0; p < keys.view().size(0); p += ps) {
      const int32_t page = page_ids[next_page++];
      run.block_table.data<int32_t>()[b * max_pages + p / ps] = page;
      const int64_t rows = std::min(ps, len - p);
      std::memcpy(run.cache_buffer.data<uint8_t>() + page * page_stride * esize,
                  keys.data<uint8_t>() + p * kCacheRowDim * esize,
                  static_cast<size_t>(rows * kCacheRowDim * esize));
    }
  }
  // An out-of-range page reads as zero rows: so do the keys the naive formula sees.
  for (const auto& o : c.page_overrides) {
    run.block_table.data<int32_t>()[o.request * max_pages + o.index] = static_cast<int32_t>(o.page);
    HostTensor& keys = run.keys[o.request];
    const int64_t end = std::min(keys.view().size(0), (o.index + 1) * ps);
    for (int64_t i = o.index * ps * kCacheRowDim; i < end * kCacheRowDim; ++i) set(keys, i, 0.0);
  }

  run.q_buffer = HostTensor(c.dtype, {batch, c.q_len, c.heads + c.q_pad, kCacheRowDim + 2 * c.q_pad});
  fill_uniform(run.q_buffer, rng, -1.0, 1.0);
  run.q_base = c.q_pad;
  run.q = run.q_buffer.view();
  run.q.data = run.q_buffer.data<uint8_t>() + run.q_base * esize;
  run.q.shape = {batch, c.q_len, c.heads, kCacheRowDim};

  run.out = HostTensor(DType::kBFloat16, {batch, c.q_len, c.heads, kLatentDim});
  run.lse = HostTensor(DType::kFloat32, {batch, c.q_len, c.heads});
  fill_bytes(run.out, 0xFF);
  fill_bytes(run.lse, 0xFF);
  reference::mla_decode(run.q, run.cache, run.block_table.view(), run.seq_lens.view(),
                        run.out.view(), run.lse.view(), c.softmax_scale, c.output_scale);
  return run;
}

// Every output element against the naive formula; out-of-range requests must be all NaN.
void expect_matches_naive(const DecodeCase& c, const DecodeRun& run) {
  ElementChecker check;
  for (int64_t b = 0; b < static_cast<int64_t>(c.seq_lens.size()); ++b) {
    const int64_t len = c.seq_lens[b];
    const bool in_range = len >= 0 && len <= run.max_tokens;
    for (int64_t t = 0; t < c.q_len; ++t) {
      // Query token t sees the first len - (q_len - 1) + t keys.
      const int64_t visible = in_range ? std::max<int64_t>(0, len - (c.q_len - 1) + t) : 0;
      std::vector<std::vector<double>> keys(visible, std::vector<double>(kCacheRowDim));
      std::vector<std::vector<double>> values(visible, std::vector<double>(kLatentDim));
      for (int64_t k = 0; k < visible; ++k) {
        for (int64_t d = 0; d < kCacheRowDim; ++d) keys[k][d] = get(run.keys[b], k * kCacheRowDim + d);
        std::copy_n(keys[k].begin(), kLatentDim, values[k].begin());
      }
      for (int64_t h = 0; h < c.heads; ++h) {
        const int64_t row = (b * c.q_len + t) * c.heads + h;
        if (!in_range) {
          for (int64_t d = 0; d < kLatentDim; ++d)
            check.same(get(run.out, row * kLatentDim + d), kNaN, "out", {b, t, h, d});
          check.same(get(run.lse, row), kNaN, "lse", {b, t, h});
          continue;
        }
        std::vector<double> q(kCacheRowDim);
        const int64_t q_row = run.q_base + b * run.q.stride(0) + t * run.q.stride(1) + h * run.q.stride(2);
        for (int64_t d = 0; d < kCacheRowDim; ++d) q[d] = get(run.q_buffer, q_row + d);
        const NaiveAttention expected =
            naive_attention(q, keys, values, c.softmax_scale, c.output_scale, kLatentDim);
        for (int64_t d = 0; d < kLatentDim; ++d)
          check.bf16(get(run.out, row * kLatentDim + d), expected.out[d], "out", {b, t, h, d});
        check.fp32(get(run.lse, row), expected.lse, "lse", {b, t, h});
      }
    }
  }
}

void check_case(const DecodeCase& c) {
  std::mt19937_64 rng = seeded_rng();
  expect_matches_naive(c, run_decode(c, rng));
}

TEST(ReferenceDecode, MatchesNaiveForQueryLengths1To5AndPageSizes1_16_64) {
  std::mt19937_64 rng = seeded_rng();
  std::uniform_int_distribution<int64_t> length(1, 140);
  for (int64_t page_size : {1, 16, 64}) {
    for (int64_t q_len = 1; q_len <= 5; ++q_len) {
      SCOPED_TRACE(testing::Message() << "page_size " << page_size << " q_len " << q_len);
      DecodeCase c;
      c.page_size = page_size;
      c.q_len = q_len;
      c.heads = 3;
      c.seq_lens = {q_len + length(rng), length(rng), q_len};
      expect_matches_naive(c, run_decode(c, rng));
    }
  }
}

TEST(ReferenceDecode, Fp8CacheWithOutputScale) {
  DecodeCase c;
  c.dtype = DType::kFloat8E4M3;
  c.page_size = 64;
  c.q_len = 2;
  c.heads = 16;
  c.seq_lens = {200, 65, 64, 1};
  c.output_scale = 0.37f;
  check_case(c);
}

TEST(ReferenceDecode, RowsWithoutVisibleKeysGiveZeroAndNegInfLse) {
  DecodeCase c;
  c.q_len = 4;
  c.seq_lens = {0, 1, 3, 4, 9};  // seq_len < q_len: the first q_len - seq_len tokens see nothing
  check_case(c);
}

TEST(ReferenceDecode, StridedPagesAndQueries) {
  DecodeCase c;
  c.page_size = 16;
  c.q_len = 2;
  c.page_stride_pad = 40;  // page stride > page_size * 576
  c.q_pad = 24;
  c.seq_lens = {50, 17, 130};
  check_case(c);
}

// Padding entries, the null page and unused slots hold NaN in one run and zeros in the other:
// the results are finite, identical and right.
TEST(ReferenceDecode, PaddingAndUnusedSlotsAreNeverRead) {
  DecodeCase c;
  c.page_size = 16;
  c.q_len = 3;
  c.seq_lens = {37, 3, 64, 1};
  std::mt19937_64 rng = seeded_rng();
  std::mt19937_64 same_rng = rng;
  const DecodeRun with_nan = run_decode(c, rng);
  c.poison = 0x00;
  const DecodeRun with_zeros = run_decode(c, same_rng);
  expect_matches_naive(c, with_nan);
  for (int64_t i = 0; i < with_nan.out.numel(); ++i) {
    ASSERT_TRUE(std::isfinite(get(with_nan.out, i))) << i;
    ASSERT_EQ(with_nan.out.data<uint16_t>()[i], with_zeros.out.data<uint16_t>()[i]) << i;
  }
  for (int64_t i = 0; i < with_nan.lse.numel(); ++i)
    ASSERT_EQ(get(with_nan.lse, i), get(with_zeros.lse, i)) << i;
}

TEST(ReferenceDecode, SeqLenOutsideTheBlockTableGivesNaN) {
  DecodeCase c;
  c.page_size = 16;
  c.q_len = 2;
  c.max_pages = 4;                    // 64 tokens
  c.seq_lens = {-1, 40, 65, 64, -7};  // 65 is one past the table; 64 fills it exactly
  check_case(c);
}

TEST(ReferenceDecode, OutOfRangePageIdsReadAsZeroRows) {
  DecodeCase c;
  c.page_size = 16;
  c.q_len = 2;
  c.seq_lens = {60, 33};
  c.page_overrides = {{0, 1, 1 << 20}, {1, 2, -3}};
  check_case(c);
}

// Two keys with hand-picked scores 1 and 2: lse = ln(e + e^2), out the e-weighted average.
TEST(ReferenceDecode, HandComputedScoresAndLse) {
  HostTensor q(DType::kBFloat16, {1, 1, 1, kCacheRowDim});
  HostTensor cache(DType::kBFloat16, {2, 2, kCacheRowDim});
  HostTensor block_table(DType::kInt32, {1, 1});
  HostTensor seq_lens(DType::kInt32, {1});
  HostTensor out(DType::kBFloat16, {1, 1, 1, kLatentDim});
  HostTensor lse(DType::kFloat32, {1, 1, 1});
  set(q, 0, 1.0);
  set(q, kCacheRowDim - 1, 0.5);                     // a rope dim: it scores but is no value
  set(cache, 2 * kCacheRowDim + 0, 1.0);             // page 1, row 0: score 1
  set(cache, 3 * kCacheRowDim + 0, 1.0);             // page 1, row 1: score 1 + 0.5 * 2 = 2
  set(cache, 4 * kCacheRowDim - 1, 2.0);
  set(cache, 3 * kCacheRowDim + 7, 3.0);             // a value-only dim of the second key
  block_table.data<int32_t>()[0] = 1;
  seq_lens.data<int32_t>()[0] = 2;
  reference::mla_decode(q.view(), cache.view(), block_table.view(), seq_lens.view(), out.view(),
                        lse.view(), 1.0f, 0.5f);
  const double e1 = std::exp(1.0), e2 = std::exp(2.0);
  EXPECT_FLOAT_EQ(get(lse, 0), std::log(e1 + e2));
  EXPECT_EQ(get(out, 0), bf16_to_float(float_to_bf16(static_cast<float>(0.5 * (e1 + e2) / (e1 + e2)))));
  EXPECT_EQ(get(out, 7), bf16_to_float(float_to_bf16(static_cast<float>(0.5 * 3 * e2 / (e1 + e2)))));
  for (int64_t d = 1; d < kLatentDim; ++d)
    if (d != 7) EXPECT_EQ(get(out, d), 0.0) << d;
}

}  // namespace
}  // namespace speedmla::test
