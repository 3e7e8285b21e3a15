// The chunked-prefill plan (edge cases by hand, invariants on random batches), the extend
// metadata's slot lists by hand, and a prefix spanning several loops against one-shot attention.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <random>
#include <vector>

#include "backend/views.h"
#include "backend_testing.h"
#include "common/prefix_expansion.h"
#include "speedmla/backend.h"
#include "speedmla/chunked_prefill.h"
#include "speedmla/error.h"
#include "speedmla/prefill.h"

namespace speedmla::test {
namespace {

using Cu = std::vector<std::vector<int32_t>>;

TEST(ChunkedPrefillPlan, NoPrefixNeedsNoLoop) {
  const std::vector<int32_t> none{0, 0, 0};
  const ChunkedPrefillPlan plan = plan_chunked_prefill(none, 30);
  EXPECT_EQ(plan.num_requests, 3);
  EXPECT_EQ(plan.chunk_len, 10);
  EXPECT_EQ(plan.num_loops, 0);
  EXPECT_EQ(plan.max_loop_tokens, 0);
  EXPECT_EQ(plan.total_tokens, 0);
  const ChunkedPrefillPlan empty = plan_chunked_prefill({}, 30);
  EXPECT_EQ(empty.num_loops, 0);
  EXPECT_EQ(empty.chunk_len, 30);
}

TEST(ChunkedPrefillPlan, OneRequestSpansSeveralLoops) {
  const std::vector<int32_t> prefix{10};
  const ChunkedPrefillPlan plan = plan_chunked_prefill(prefix, 4);
  EXPECT_EQ(plan.chunk_len, 4);
  EXPECT_EQ(plan.num_loops, 3);
  EXPECT_EQ(plan.cu_seq_lens, (Cu{{0, 4}, {0, 4}, {0, 2}}));
  EXPECT_EQ(plan.max_chunk_len, (std::vector<int32_t>{4, 4, 2}));
  EXPECT_EQ(plan.max_loop_tokens, 4);
  EXPECT_EQ(plan.total_tokens, 10);
  EXPECT_EQ(plan.loop_begin(2), 8);
}

TEST(ChunkedPrefillPlan, PrefixShorterThanAChunk) {
  const std::vector<int32_t> prefix{5, 0, 7};
  const ChunkedPrefillPlan plan = plan_chunked_prefill(prefix, 300);
  EXPECT_EQ(plan.chunk_len, 100);
  EXPECT_EQ(plan.num_loops, 1);
  EXPECT_EQ(plan.cu_seq_lens, (Cu{{0, 5, 5, 12}}));
  EXPECT_EQ(plan.max_chunk_len, (std::vector<int32_t>{7}));
}

TEST(ChunkedPrefillPlan, ManyRequestsShareTheCapacity) {
  // 20 requests, capacity 10: the chunk cannot drop below one token per request.
  std::vector<int32_t> prefix(20, 0);
  prefix[3] = 3;
  prefix[19] = 1;
  const ChunkedPrefillPlan plan = plan_chunked_prefill(prefix, 10);
  EXPECT_EQ(plan.chunk_len, 1);
  EXPECT_EQ(plan.num_loops, 3);
  for (int64_t loop = 0; loop < 3; ++loop) {
    EXPECT_EQ(plan.cu_seq_lens[loop][4] - plan.cu_seq_lens[loop][3], 1);
    EXPECT_EQ(plan.cu_seq_lens[loop][20] - plan.cu_seq_lens[loop][19], loop == 0 ? 1 : 0);
  }
  EXPECT_EQ(plan.max_loop_tokens, 2);
  // 4 requests of 8192 * 4: one loop of 8192 tokens each, the TokenSpeed default capacity.
  const std::vector<int32_t> four(4, 8192 * 4);
  const ChunkedPrefillPlan big = plan_chunked_prefill(four);
  EXPECT_EQ(big.chunk_len, 8192);
  EXPECT_EQ(big.num_loops, 4);
  EXPECT_EQ(big.max_loop_tokens, 8192 * 4);
}

TEST(ChunkedPrefillPlan, EveryPrefixTokenIsInExactlyOneLoop) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int64_t n = 1 + static_cast<int64_t>(rng() % 12);
    const int64_t capacity = 1 + static_cast<int64_t>(rng() % 64);
    std::vector<int32_t> prefix(n);
    for (int32_t& p : prefix) p = static_cast<int32_t>(rng() % 50);
    const ChunkedPrefillPlan plan = plan_chunked_prefill(prefix, capacity);
    for (int64_t b = 0; b < n; ++b) {
      int64_t covered = 0;
      for (int64_t loop = 0; loop < plan.num_loops; ++loop) {
        const int64_t len = plan.cu_seq_lens[loop][b + 1] - plan.cu_seq_lens[loop][b];
        // Loop i holds the positions [i*chunk, ...) that remain: contiguous, in order.
        EXPECT_EQ(len, std::clamp<int64_t>(prefix[b] - plan.loop_begin(loop), 0, plan.chunk_len));
        covered += len;
      }
      EXPECT_EQ(covered, prefix[b]);
    }
    if (n <= capacity)
      for (int64_t loop = 0; loop < plan.num_loops; ++loop)
        EXPECT_LE(plan.cu_seq_lens[loop][n], capacity);
  }
}

TEST(ChunkedPrefillPlan, RejectsBadArguments) {
  const std::vector<int32_t> ok{1}, negative{3, -1};
  EXPECT_THROW(plan_chunked_prefill(ok, 0), Error);
  EXPECT_THROW(plan_chunked_prefill(negative, 8), Error);
}

MlaBackendConfig page8_config(int64_t heads, int64_t capacity) {
  MlaBackendConfig config;
  config.num_heads = heads;
  config.page_size = 8;
  config.kv_cache_dtype = DType::kBFloat16;
  config.context_len = 300;
  config.max_batch = 4;
  config.chunked_prefill_capacity = capacity;
  return config;
}

// Request 0 (pool row 1) has pages 7, 3; request 1 (pool row 0) has page 5.
HostTensor two_request_page_table(int64_t width) {
  HostTensor t(DType::kInt32, {2, width});
  t.data<int32_t>()[0] = 5;
  t.data<int32_t>()[width] = 7;
  t.data<int32_t>()[width + 1] = 3;
  return t;
}

TEST(BackendExtendMetadata, SlotListsByHand) {
  MlaBackend backend(page8_config(4, 8));  // two requests: 4 prefix tokens each per loop
  const HostTensor req_to_page = two_request_page_table(backend.block_table_width());
  const HostTensor pool = int_tensor(DType::kInt64, {1, 0});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {12, 8});
  const HostTensor prefix = int_tensor(DType::kInt32, {10, 3});
  const HostTensor fresh = int_tensor(DType::kInt32, {2, 5});
  backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend,
                                req_to_page.view(),
                                MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  const ExtendMetadata* md = backend.extend_metadata();
  ASSERT_NE(md, nullptr);
  EXPECT_EQ(int_values(md->cu_seq_lens), (std::vector<int64_t>{0, 12, 20}));
  EXPECT_EQ(int_values(md->cu_extend_seq_lens), (std::vector<int64_t>{0, 2, 7}));
  EXPECT_EQ(md->max_extend_seq_len, 5);
  EXPECT_EQ(md->max_seq_len, 300);
  ASSERT_EQ(md->chunks.num_loops, 3);
  EXPECT_EQ(int_values(md->chunk_cu_seq_lens[0]), (std::vector<int64_t>{0, 4, 7}));
  EXPECT_EQ(int_values(md->chunk_cu_seq_lens[1]), (std::vector<int64_t>{0, 4, 4}));
  EXPECT_EQ(int_values(md->chunk_cu_seq_lens[2]), (std::vector<int64_t>{0, 2, 2}));
  // slot = page * 8 + position % 8
  EXPECT_EQ(int_values(md->chunk_slots[0]), (std::vector<int64_t>{56, 57, 58, 59, 40, 41, 42}));
  EXPECT_EQ(int_values(md->chunk_slots[1]), (std::vector<int64_t>{60, 61, 62, 63}));
  EXPECT_EQ(int_values(md->chunk_slots[2]), (std::vector<int64_t>{24, 25}));
}

// ---- a prefix spanning several loops equals one-shot attention ---------------------------------

constexpr int64_t kNope = 128;  // k_nope and v width per head

TEST(BackendChunkedPrefill, PrefixOverSeveralLoopsEqualsOneShotAttention) {
  std::mt19937_64 rng(11);
  const int64_t heads = 4;
  MlaBackend backend(page8_config(heads, 8));  // chunk 4 per request: request 0 needs 3 loops
  const std::vector<int64_t> prefix{10, 3}, fresh{2, 5};
  const int64_t n = 2;
  const int64_t width = backend.block_table_width();
  const HostTensor req_to_page = two_request_page_table(width);
  const std::vector<std::vector<int64_t>> pages{{7, 3}, {5}};  // per request (pool rows 1, 0)
  const HostTensor pool = int_tensor(DType::kInt64, {1, 0});

  // The cache: 8 pages of 8 rows, NaN everywhere the prefixes do not reach.
  HostTensor cache(DType::kBFloat16, {8, 8, 576});
  fill_bytes(cache, 0xFF);
  const PrefixExpansion expand(heads, rng);
  // Every request's full key sequence: prefix latents (in the cache) then new-token latents.
  std::vector<HostTensor> latents;
  for (int64_t b = 0; b < n; ++b) {
    HostTensor lat(DType::kBFloat16, {prefix[b] + fresh[b], 576});
    fill_uniform(lat, rng, -1.0, 1.0);
    for (int64_t pos = 0; pos < prefix[b]; ++pos) {
      const int64_t slot = pages[b][pos / 8] * 8 + pos % 8;
      std::memcpy(cache.data<uint16_t>() + slot * 576, lat.data<uint16_t>() + pos * 576, 576 * 2);
    }
    latents.push_back(std::move(lat));
  }
  // One-shot: all keys of each request, causal (bottom-right) over prefix + new tokens.
  const int64_t total_q = fresh[0] + fresh[1], total_k = total_q + prefix[0] + prefix[1];
  HostTensor all_k(DType::kBFloat16, {total_k, heads, 192}), all_v(DType::kBFloat16, {total_k, heads, kNope});
  HostTensor self_k(DType::kBFloat16, {total_q, heads, 192}), self_v(DType::kBFloat16, {total_q, heads, kNope});
  for (int64_t b = 0, k_row = 0, q_row = 0; b < n; ++b) {
    const TensorView lat = latents[b].view();
    expand(lat, detail::slice_rows(all_k.view(), k_row, lat.shape[0]), detail::slice_rows(all_v.view(), k_row, lat.shape[0]));
    const TensorView fresh_lat = detail::slice_rows(lat, prefix[b], fresh[b]);
    expand(fresh_lat, detail::slice_rows(self_k.view(), q_row, fresh[b]), detail::slice_rows(self_v.view(), q_row, fresh[b]));
    k_row += lat.shape[0];
    q_row += fresh[b];
  }
  HostTensor q(DType::kBFloat16, {total_q, heads, 192});
  fill_uniform(q, rng, -1.0, 1.0);
  const HostTensor cu_q = int_tensor(DType::kInt32, {0, fresh[0], total_q});
  const HostTensor cu_all = int_tensor(DType::kInt32, {0, prefix[0] + fresh[0], total_k});
  const float scale = 0.1f;
  HostTensor expected(DType::kBFloat16, {total_q, heads, kNope}), expected_lse(DType::kFloat32, {total_q, heads});
  mla_prefill(q.view(), all_k.view(), all_v.view(), cu_q.view(), cu_all.view(), expected.view(),
              expected_lse.view(), true, scale);

  // Chunked: causal self-attention, then the prefix loops merged in.
  const HostTensor seq_lens = int_tensor(DType::kInt32, {12, 8});
  const HostTensor prefix_t = int_tensor(DType::kInt32, prefix), fresh_t = int_tensor(DType::kInt32, fresh);
  backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend,
                                req_to_page.view(), MlaBackend::ExtendLens{prefix_t.view(), fresh_t.view()});
  ASSERT_EQ(backend.extend_metadata()->chunks.num_loops, 3);
  HostTensor out(DType::kBFloat16, {total_q, heads, kNope}), lse(DType::kFloat32, {total_q, heads});
  backend.forward_extend_chunked(q.view(), self_k.view(), self_v.view(), cu_q.view(), cu_q.view(),
                                 true, scale, out.view(), lse.view());
  const int64_t rows = backend.extend_metadata()->chunks.max_loop_tokens;
  HostTensor s_lat(DType::kBFloat16, {rows, 576}), s_k(DType::kBFloat16, {rows, heads, 192}),
      s_v(DType::kBFloat16, {rows, heads, kNope}), s_out(DType::kBFloat16, {total_q, heads, kNope}),
      s_lse(DType::kFloat32, {total_q, heads});
  int calls = 0;
  backend.attend_cached_prefix(
      q.view(), cache.view(), 1.0f,
      [&](const TensorView& lat, const TensorView& k, const TensorView& v) { ++calls; expand(lat, k, v); },
      PrefixScratch{s_lat.view(), s_k.view(), s_v.view(), s_out.view(), s_lse.view()}, out.view(),
      lse.view(), scale);
  EXPECT_EQ(calls, 3);
  const ErrorStats out_err = compare(out, expected), lse_err = compare(lse, expected_lse);
  EXPECT_LT(out_err.rel_l2, 1e-2) << out_err.summary();
  EXPECT_EQ(out_err.nonfinite, 0);
  EXPECT_LT(lse_err.max_abs, 1e-4) << lse_err.summary();
}

// A batch without cached prefixes runs no loop; empty scratch is accepted in either value layout,
// with the strides a framework gives an empty tensor (PyTorch: [H, 128, 0] has (128, 1, 1)).
TEST(BackendChunkedPrefill, NoPrefixRunsNoLoopWithEmptyTransposedScratch) {
  const int64_t heads = 2;
  MlaBackend backend(page8_config(heads, 8));
  const HostTensor req_to_page = two_request_page_table(backend.block_table_width());
  const HostTensor pool = int_tensor(DType::kInt64, {1, 0});
  const HostTensor seq_lens = int_tensor(DType::kInt32, {2, 5});
  const HostTensor prefix = int_tensor(DType::kInt32, {0, 0}), fresh = int_tensor(DType::kInt32, {2, 5});
  backend.init_forward_metadata(2, 2, pool.view(), seq_lens.view(), ForwardMode::kExtend, req_to_page.view(),
                                MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  ASSERT_EQ(backend.extend_metadata()->chunks.max_loop_tokens, 0);
  HostTensor cache(DType::kBFloat16, {8, 8, 576});
  HostTensor q(DType::kFloat8E4M3, {7, heads, 192});
  HostTensor s_lat(DType::kBFloat16, {0, 576}), s_k(DType::kFloat8E4M3, {0, heads, 192}),
      s_v_tokens(DType::kFloat8E4M3, {0, heads, kNope}), s_v(DType::kFloat8E4M3, {heads, kNope, 0}), s_out(DType::kBFloat16, {7, heads, kNope}),
      s_lse(DType::kFloat32, {7, heads});
  s_v.view().strides = {kNope, 1, 1};
  HostTensor out(DType::kBFloat16, {7, heads, kNope}), lse(DType::kFloat32, {7, heads});
  fill_bytes(out, 0x3C);
  fill_bytes(lse, 0x3F);
  const HostTensor out_before = out, lse_before = lse;
  int calls = 0;
  for (const PrefillValueLayout layout : {PrefillValueLayout::kTokenMajor, PrefillValueLayout::kFp8Transposed}) {
    const TensorView v = layout == PrefillValueLayout::kFp8Transposed ? s_v.view() : s_v_tokens.view();
    backend.attend_cached_prefix(
        q.view(), cache.view(), 1.0f, [&](const TensorView&, const TensorView&, const TensorView&) { ++calls; },
        PrefixScratch{s_lat.view(), s_k.view(), v, s_out.view(), s_lse.view(), layout}, out.view(), lse.view(),
        0.1f);
  }
  EXPECT_EQ(calls, 0);
  EXPECT_EQ(std::memcmp(out.data<uint8_t>(), out_before.data<uint8_t>(), out.nbytes()), 0);
  EXPECT_EQ(std::memcmp(lse.data<uint8_t>(), lse_before.data<uint8_t>(), lse.nbytes()), 0);
}

}  // namespace
}  // namespace speedmla::test
