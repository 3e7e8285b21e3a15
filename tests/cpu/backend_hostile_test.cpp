// MlaBackend under hostile engine input, on the CPU: a seeded run of random decode steps whose
// batch sizes, query tokens, head counts, dtypes, pool indices, lengths and page tables are often
// wrong. Each step must either be refused with an Error that names the method and an argument,
// or give exactly what mla_decode gives on the block table the backend's rule predicts (pool
// rows out of range and padding read page 0; lengths and page ids as the decode contract says).
#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/op_testing.h"
#include "common/util.h"
#include "cpu/backend_testing.h"
#include "speedmla/speedmla.h"
#include "speedmla/backend.h"

namespace speedmla::test {
namespace {

int64_t uniform(std::mt19937_64& rng, int64_t lo, int64_t hi) {
  return std::uniform_int_distribution<int64_t>(lo, hi)(rng);
}

// True when `message` is "MlaBackend::<method>: <argument>..." for one of the step's arguments,
// or a config field it is checked against.
bool names_method_and_argument(const std::string& message) {
  for (const char* method : {"MlaBackend::init_forward_metadata: ", "MlaBackend::forward_decode: "}) {
    if (message.rfind(method, 0) != 0) continue;
    const std::string rest = message.substr(std::strlen(method));
    for (const char* arg : {"bs", "num_extends", "req_pool_indices", "seq_lens", "req_to_page", "q", "out",
                            "kv_cache", "scaling", "k_scale", "lse"})
      if (rest.rfind(arg, 0) == 0) return true;
  }
  return false;
}

TEST(BackendHostile, RandomDecodeStepsRefusedOrCorrect) {
  std::mt19937_64 rng = case_rng("backend hostile decode steps");
  const MlaBackendConfig config = small_config();  // H = 4, page 64, width 6, max_batch 4, BF16
  MlaBackend backend(config);
  const int64_t heads = config.num_local_heads(), width = backend.block_table_width();
  constexpr int64_t kPool = 3, kPoolWidth = 5, kPages = 9;
  HostTensor cache(DType::kBFloat16, {kPages, config.page_size, kCacheRowDim});
  fill_uniform(cache, rng, -1.0, 1.0);
  int refused = 0, checked = 0;
  for (int step = 0; step < 200; ++step) {
    // Page table with some ids outside the cache; pool indices and lengths partly out of range.
    HostTensor req_to_page(DType::kInt32, {kPool, kPoolWidth});
    for (int64_t i = 0; i < req_to_page.numel(); ++i)
      req_to_page.data<int32_t>()[i] = static_cast<int32_t>(uniform(rng, uniform(rng, 0, 9) == 0 ? -3 : 0, kPages + (uniform(rng, 0, 9) == 0 ? 5 : -1)));
    const int64_t bs = uniform(rng, 0, 9) == 0 ? uniform(rng, -1, 6) : uniform(rng, 1, 4);
    const int64_t rows = std::max<int64_t>(bs, 1);
    const int64_t q_len = uniform(rng, 1, 2);
    const DType pool_dtype = uniform(rng, 0, 19) == 0 ? DType::kFloat32 : uniform(rng, 0, 1) ? DType::kInt64 : DType::kInt32;
    HostTensor pool(pool_dtype, {rows + uniform(rng, -1, 1) * (uniform(rng, 0, 9) == 0)});
    std::vector<int64_t> pool_rows;
    for (int64_t r = 0; r < pool.numel(); ++r) {
      const int64_t p = uniform(rng, 0, 6) == 0 ? uniform(rng, -2, kPool + 1) : uniform(rng, 0, kPool - 1);
      set(pool, r, static_cast<double>(p));
      pool_rows.push_back(p);
    }
    const DType lens_dtype = uniform(rng, 0, 19) == 0 ? DType::kInt64 : DType::kInt32;
    HostTensor lens(lens_dtype, {rows});
    for (int64_t r = 0; r < rows; ++r)
      set(lens, r, static_cast<double>(uniform(rng, 0, 6) == 0 ? uniform(rng, -3, 500) : uniform(rng, q_len, 300)));
    const int64_t q_heads = uniform(rng, 0, 19) == 0 ? heads + 1 : heads;
    HostTensor q(DType::kBFloat16, {rows * q_len, q_heads, kCacheRowDim});
    fill_uniform(q, rng, -1.0, 1.0);
    HostTensor out(DType::kBFloat16, {rows * q_len, heads, kLatentDim});
    fill_bytes(out, 0xFF);
    const float scaling = uniform(rng, 0, 19) == 0 ? -1.f : 0.05f;

    try {
      backend.init_forward_metadata(bs, 0, pool.view(), lens.view(), ForwardMode::kDecode, req_to_page.view(),
                                    std::nullopt);
      backend.forward_decode(q.view(), cache.view(), bs, out.view(), scaling);
    } catch (const Error& e) {
      ++refused;
      EXPECT_TRUE(names_method_and_argument(e.what())) << "step " << step << ": " << e.what();
      continue;
    }
    // What the backend must have computed: mla_decode on the block table of its rule.
    ++checked;
    const std::vector<int64_t> expected_table =
        expected_block_table(std::vector<int64_t>(pool_rows.begin(), pool_rows.begin() + bs), kPool, kPoolWidth,
                             width, bs);
    HostTensor table(DType::kInt32, {bs, width});
    for (size_t i = 0; i < expected_table.size(); ++i) table.data<int32_t>()[i] = static_cast<int32_t>(expected_table[i]);
    // expected_block_table numbers pages 100 p + i + 1; map them back to this step's table.
    for (int64_t r = 0; r < bs; ++r)
      for (int64_t c = 0; c < width; ++c) {
        const int64_t v = expected_table[r * width + c];
        table.data<int32_t>()[r * width + c] =
            v == 0 ? 0 : req_to_page.data<int32_t>()[(v - 1) / 100 * kPoolWidth + (v - 1) % 100];
      }
    HostTensor q4 = q, expected(DType::kBFloat16, {bs, q_len, heads, kLatentDim});
    TensorView q_view = q4.view();
    q_view.ndim = 4;
    q_view.shape = {bs, q_len, heads, kCacheRowDim};
    q_view.strides = {q_len * heads * kCacheRowDim, heads * kCacheRowDim, kCacheRowDim, 1};
    HostTensor lens32(DType::kInt32, {bs});
    for (int64_t r = 0; r < bs; ++r) lens32.data<int32_t>()[r] = static_cast<int32_t>(get(lens, r));
    mla_decode(q_view, cache.view(), table.view(), lens32.view(), expected.view(), std::nullopt, std::nullopt, scaling);
    HostTensor got(DType::kBFloat16, {bs, q_len, heads, kLatentDim});
    std::memcpy(got.view().data, out.view().data, got.nbytes());
    EXPECT_TRUE(bitwise_equal(got, expected)) << "step " << step << " (bs " << bs << ", q_len " << q_len << ")";
  }
  std::printf("[ backend hostile ] %d steps refused, %d checked against mla_decode\n", refused, checked);
  EXPECT_GE(refused, 20);
  EXPECT_GE(checked, 60);
}

}  // namespace
}  // namespace speedmla::test
