// MlaBackend::forward_decode on the CPU device: it must pass exactly what the public operations
// would get when called by hand (metadata rows, FP8 query quantisation, scales, the KV write),
// reject bad calls clearly, and grow the workspace for longer verify windows.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backend/views.h"
#include "backend_testing.h"
#include "speedmla/backend.h"
#include "speedmla/cache.h"
#include "speedmla/decode.h"
#include "speedmla/error.h"
#include "speedmla/quantize.h"

namespace speedmla::test {
namespace {


// A deep copy (copying a HostTensor would share the view's pointer).
HostTensor clone(const HostTensor& t) {
  HostTensor copy(t.view().dtype, std::vector<int64_t>(t.view().shape.begin(), t.view().shape.begin() + t.view().ndim));
  std::memcpy(copy.view().data, t.view().data, t.nbytes());
  return copy;
}

bool same_bytes(const HostTensor& a, const HostTensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.view().data, b.view().data, a.nbytes()) == 0;
}

// A batch of 3 requests over a paged cache: request r uses pool row pool[r]; pool row p owns
// pages 1 + 4p .. 4 + 4p (page 0 stays the null page).
struct DecodeBatch {
  MlaBackendConfig config;
  HostTensor cache, req_to_page, pool, seq_lens;

  DecodeBatch(DType dtype, std::mt19937_64& rng) {
    config = small_config();
    config.page_size = 16;
    config.context_len = 64;  // 4 pages, width 8
    config.kv_cache_dtype = dtype;
    cache = HostTensor(dtype, {1 + 4 * 3, 16, 576});
    fill_uniform(cache, rng, -1.0, 1.0);
    req_to_page = HostTensor(DType::kInt32, {3, 4});
    for (int p = 0; p < 3; ++p)
      for (int i = 0; i < 4; ++i) req_to_page.data<int32_t>()[p * 4 + i] = 1 + 4 * p + i;
    pool = int_tensor(DType::kInt64, {2, 0, 1});
    seq_lens = int_tensor(DType::kInt32, {40, 17, 64});
  }

  // Decode metadata for all 3 requests.
  void init_decode(MlaBackend& backend) const {
    backend.init_forward_metadata(3, 0, pool.view(), seq_lens.view(), ForwardMode::kDecode, req_to_page.view(),
                                  std::nullopt);
  }

  // The block table rows [first, first + count) by hand.
  HostTensor block_table(int64_t first, int64_t count, int64_t width) const {
    HostTensor t(DType::kInt32, {count, width});
    for (int64_t r = 0; r < count; ++r)
      for (int64_t i = 0; i < 4; ++i)
        t.data<int32_t>()[r * width + i] = req_to_page.data<int32_t>()[pool.data<int64_t>()[first + r] * 4 + i];
    return t;
  }
};

TEST(BackendDecode, Bf16CacheMatchesADirectCall) {
  std::mt19937_64 rng(1);
  DecodeBatch batch(DType::kBFloat16, rng);
  MlaBackend backend(batch.config);
  batch.init_decode(backend);
  const int64_t heads = 4;
  HostTensor q(DType::kBFloat16, {3, heads, 576});
  fill_uniform(q, rng, -1.0, 1.0);
  HostTensor out(DType::kBFloat16, {3, heads, 512}), lse(DType::kFloat32, {3, heads});
  backend.forward_decode(q.view(), batch.cache.view(), 3, out.view(), 0.05f, 1.0f, std::nullopt, lse.view());

  HostTensor expected(DType::kBFloat16, {3, 1, heads, 512}), expected_lse(DType::kFloat32, {3, 1, heads});
  const HostTensor table = batch.block_table(0, 3, backend.block_table_width());
  mla_decode(detail::split_rows(q.view(), 3, 1), batch.cache.view(), table.view(), batch.seq_lens.view(),
             expected.view(), expected_lse.view(), std::nullopt, 0.05f, 1.0f);
  EXPECT_TRUE(same_bytes(out, expected));
  EXPECT_TRUE(same_bytes(lse, expected_lse));
}

TEST(BackendDecode, Fp8CacheQuantisesQueryAndWritesNewKvFirst) {
  std::mt19937_64 rng(2);
  DecodeBatch batch(DType::kFloat8E4M3, rng);
  MlaBackend backend(batch.config);
  // A mixed batch: row 0 is an extend request, rows 1 and 2 decode with q_len 2 (verify).
  const HostTensor prefix = int_tensor(DType::kInt32, {30});
  const HostTensor fresh = int_tensor(DType::kInt32, {10});
  backend.init_forward_metadata(3, 1, batch.pool.view(), batch.seq_lens.view(), ForwardMode::kMixed,
                                batch.req_to_page.view(), MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  const int64_t heads = 4, bs = 2, q_len = 2;
  HostTensor q(DType::kBFloat16, {bs * q_len, heads, 576});
  fill_uniform(q, rng, -2.0, 2.0);
  HostTensor new_kv(DType::kBFloat16, {bs * q_len, 1, 576});
  fill_uniform(new_kv, rng, -3.0, 3.0);
  // The new tokens' slots: the last two positions of each decode request.
  const HostTensor slots = int_tensor(DType::kInt64, {1 * 16 + 15, 2 * 16 + 0, 5 * 16 + 14, 5 * 16 + 15});
  const float scaling = 0.06f, k_scale = 0.5f;

  HostTensor expected_cache = clone(batch.cache);
  HostTensor out(DType::kBFloat16, {bs * q_len, heads, 512});
  backend.forward_decode(q.view(), batch.cache.view(), bs, out.view(), scaling, k_scale,
                         NewTokenKv{new_kv.view(), slots.view()});

  const TensorView rows = detail::squeeze(new_kv.view(), 1);
  kv_cache_write(expected_cache.view(), slots.view(), detail::slice_last(rows, 0, 512),
                 detail::slice_last(rows, 512, 64), 1.0f / k_scale);
  EXPECT_TRUE(same_bytes(batch.cache, expected_cache));
  HostTensor q8(DType::kFloat8E4M3, {bs, q_len, heads, 576});
  quantize_fp8(detail::split_rows(q.view(), bs, q_len), q8.view(), 1.0f);
  HostTensor expected(DType::kBFloat16, {bs, q_len, heads, 512});
  const HostTensor table = batch.block_table(1, bs, backend.block_table_width());
  mla_decode(q8.view(), expected_cache.view(), table.view(), detail::slice_rows(batch.seq_lens.view(), 1, bs),
             expected.view(), std::nullopt, std::nullopt, k_scale * scaling, k_scale);
  EXPECT_TRUE(same_bytes(out, expected));

  // The same step with 4-D q and out, and with an FP8 query passed through unchanged.
  HostTensor out4(DType::kBFloat16, {bs, q_len, heads, 512});
  backend.forward_decode(q8.view(), batch.cache.view(), bs, out4.view(), scaling, k_scale);
  EXPECT_TRUE(same_bytes(out4, expected));
}

TEST(BackendDecode, RejectsBadCalls) {
  std::mt19937_64 rng(3);
  DecodeBatch batch(DType::kBFloat16, rng);
  MlaBackend backend(batch.config);
  HostTensor q(DType::kBFloat16, {3, 4, 576}), out(DType::kBFloat16, {3, 4, 512});
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 3, out.view(), 0.1f); },
               "there is no decode metadata");
  batch.init_decode(backend);
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 4, out.view(), 0.1f); },
               "bs must be in [1, 3]");
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 2, out.view(), 0.1f); },
               "q.shape[0] = 3 must be a multiple of bs = 2");
  HostTensor q_heads(DType::kBFloat16, {3, 8, 576});
  expect_error([&] { backend.forward_decode(q_heads.view(), batch.cache.view(), 3, out.view(), 0.1f); },
               "q.shape[2] must be 4");
  HostTensor out_short(DType::kBFloat16, {2, 4, 512});
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 3, out_short.view(), 0.1f); },
               "out.shape[0] must be bs * q_len = 3");
  HostTensor fp8_cache(DType::kFloat8E4M3, {13, 16, 576});
  expect_error([&] { backend.forward_decode(q.view(), fp8_cache.view(), 3, out.view(), 0.1f); },
               "kv_cache must be bfloat16");
  HostTensor wrong_pages(DType::kBFloat16, {4, 64, 576});
  expect_error([&] { backend.forward_decode(q.view(), wrong_pages.view(), 3, out.view(), 0.1f); },
               "kv_cache.shape[1] must be 16");
  HostTensor bad_kv(DType::kBFloat16, {3, 2, 576});
  const HostTensor slots = int_tensor(DType::kInt64, {-1, -1, -1});
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 3, out.view(), 0.1f, 1.0f,
                                            NewTokenKv{bad_kv.view(), slots.view()}); },
               "new_kv.kv must be [T, 576] or [T, 1, 576]");
}

// Every argument is checked before any work: a call refused by the decode's checks leaves the
// new KV unwritten. Each argument is named as the engine passed it.
TEST(BackendDecode, ChecksEverythingBeforeWritingTheCache) {
  std::mt19937_64 rng(5);
  DecodeBatch batch(DType::kFloat8E4M3, rng);
  MlaBackend backend(batch.config);
  batch.init_decode(backend);
  HostTensor q(DType::kBFloat16, {3, 4, 576}), out(DType::kBFloat16, {3, 4, 512});
  fill_uniform(q, rng, -1.0, 1.0);
  HostTensor new_kv(DType::kBFloat16, {3, 576});
  fill_uniform(new_kv, rng, -1.0, 1.0);
  const HostTensor slots = int_tensor(DType::kInt64, {16, 17, 18});
  const HostTensor before = clone(batch.cache);
  HostTensor bad_lse(DType::kBFloat16, {3, 4});
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 3, out.view(), 0.1f, 1.0f,
                                            NewTokenKv{new_kv.view(), slots.view()}, bad_lse.view()); },
               "MlaBackend::forward_decode: lse must be float32");
  EXPECT_TRUE(same_bytes(batch.cache, before));
  HostTensor int_q(DType::kInt32, {3, 4, 576});
  expect_error([&] { backend.forward_decode(int_q.view(), batch.cache.view(), 3, out.view(), 0.1f); },
               "MlaBackend::forward_decode: q must be bfloat16 or float16 or float32");
  const HostTensor bad_slots = int_tensor(DType::kInt32, {16, 17, 18});
  expect_error([&] { backend.forward_decode(q.view(), batch.cache.view(), 3, out.view(), 0.1f, 1.0f,
                                            NewTokenKv{new_kv.view(), bad_slots.view()}); },
               "kv_cache_write: slots must be int64");
  EXPECT_TRUE(same_bytes(batch.cache, before));
}

TEST(BackendWorkspace, OwnedPerBackendAndStreamGrowingOnly) {
  std::mt19937_64 rng(4);
  DecodeBatch batch(DType::kFloat8E4M3, rng);  // an FP8 cache needs CPU workspace (the FP8 query)
  MlaBackend backend(batch.config);
  EXPECT_EQ(backend.workspace_capacity(), 0u);  // allocated on first use
  const int64_t rows = std::max(batch.config.max_batch, batch.config.max_graph_batch);
  batch.init_decode(backend);
  const int64_t q_len = 9;
  HostTensor q(DType::kBFloat16, {3 * q_len, 4, 576}), out(DType::kBFloat16, {3 * q_len, 4, 512});
  fill_uniform(q, rng, -1.0, 1.0);
  backend.forward_decode(q.view(), batch.cache.view(), 3, out.view(), 0.1f);
  const size_t grown = backend.workspace_capacity();
  EXPECT_EQ(grown, backend.workspace_bytes(rows, q_len));  // sized for the largest batch at once
  HostTensor q1(DType::kBFloat16, {3, 4, 576}), out1(DType::kBFloat16, {3, 4, 512});
  backend.forward_decode(q1.view(), batch.cache.view(), 3, out1.view(), 0.1f);
  EXPECT_EQ(backend.workspace_capacity(), grown);  // never shrinks

  // Another stream gets a buffer of its own and leaves the first one alone (the CPU path ignores
  // streams otherwise, so any handle serves as a key here).
  const auto side = reinterpret_cast<Stream>(uintptr_t{0x5100});
  EXPECT_EQ(backend.workspace_capacity(side), 0u);
  backend.forward_decode(q1.view(), batch.cache.view(), 3, out1.view(), 0.1f, 1.0f, std::nullopt, std::nullopt,
                         side);
  EXPECT_EQ(backend.workspace_capacity(side), backend.workspace_bytes(rows, 1));
  EXPECT_EQ(backend.workspace_capacity(), grown);

  // Another backend on the same device owns its own buffers.
  MlaBackend other(batch.config);
  EXPECT_EQ(other.workspace_capacity(), 0u);
  EXPECT_EQ(backend.workspace_bytes(2, 3), static_cast<size_t>(2 * 3 * 4 * 576));  // CPU: FP8 queries only
}

}  // namespace
}  // namespace speedmla::test
