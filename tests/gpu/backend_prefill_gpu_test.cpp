// The extend path of MlaBackend on the GPU (contract §5): the new tokens' causal self-pass
// (forward_extend_chunked), then the cached prefix in loops (attend_cached_prefix: gather_cache,
// the model's expand, non-causal mla_prefill, merge_attn_states in place), against one-shot
// mla_prefill over each request's whole key range, on the GPU and on the CPU reference. The mixed
// variant appends decode requests after the extend rows and checks them against the CPU backend.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "backend/views.h"
#include "common/dtype_gpu_test.h"
#include "common/prefill_problem.h"
#include "common/prefix_expansion.h"
#include "common/util.h"
#include "cpu/backend_testing.h"
#include "speedmla/backend.h"

namespace speedmla::test {
namespace {

constexpr int64_t kHeads = 16, kPage = 16;

struct ExtendCase {
  DType dtype;
  std::vector<int32_t> prefix, fresh;  // extend requests: cached and new tokens
  std::vector<int32_t> decode_lens;    // decode requests after them (seq_len, one new token each)
  int64_t capacity;                    // prefix tokens per loop
  // kFp8Transposed (FP8): the self-pass values and the loops' scratch values in that layout.
  PrefillValueLayout v_layout = PrefillValueLayout::kTokenMajor;
};

// Bounds against the one-shot reference. The chunked result carries the kernel's own error plus
// one BF16 rounding of the running output per loop (merge_attn_states writes BF16): about 1e-3
// each in rel. L2, so BF16 gets 1e-2 (as the CPU chunked test). FP8 as the one-shot tests. Against
// the one-shot GPU result both sides carry independent FP8 rounding of P: 8e-2.
PrefillBounds reference_bounds(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? PrefillBounds{6e-2, 4e-2} : PrefillBounds{1e-2, 2e-3};
}
PrefillBounds one_shot_bounds(DType dtype) {
  return dtype == DType::kFloat8E4M3 ? PrefillBounds{8e-2, 4e-2} : PrefillBounds{1e-2, 2e-3};
}
double decode_bound(DType dtype) { return dtype == DType::kFloat8E4M3 ? 6e-2 : 1e-2; }

Device current_gpu() {
  int device = 0;
  cudaGetDevice(&device);
  return Device{DeviceKind::kCUDA, device};
}

MlaBackendConfig config_for(const ExtendCase& c, Device device) {
  MlaBackendConfig config;
  config.num_heads = kHeads;
  config.page_size = kPage;
  config.kv_cache_dtype = c.dtype;
  config.context_len = 2048;
  config.max_batch = 8;
  config.chunked_prefill_capacity = c.capacity;
  config.device = device;
  return config;
}

void run_extend_case(const ExtendCase& c, const std::string& name) {
  const int64_t n_ext = static_cast<int64_t>(c.prefix.size()), n_dec = static_cast<int64_t>(c.decode_lens.size());
  const int64_t bs = n_ext + n_dec;
  const float scale = 0.0721688f, k_scale = c.dtype == DType::kFloat8E4M3 ? 0.5f : 1.f, scaling = 0.05f;
  std::mt19937_64 rng = case_rng(name);

  // The paged cache: every request owns its own shuffled pages (pool row r = request r); every
  // slot no request reads holds NaN.
  std::vector<int32_t> seq_lens(bs);
  for (int64_t r = 0; r < bs; ++r) seq_lens[r] = r < n_ext ? c.prefix[r] + c.fresh[r] : c.decode_lens[r - n_ext];
  const int64_t max_pages = 2048 / kPage;
  int64_t pages_needed = 0;
  for (int32_t len : seq_lens) pages_needed += (len + kPage - 1) / kPage;
  std::vector<int32_t> pages(pages_needed);
  std::iota(pages.begin(), pages.end(), 1);  // page 0: the null page
  std::shuffle(pages.begin(), pages.end(), rng);
  HostTensor req_to_page(DType::kInt32, {bs, max_pages}), cache(c.dtype, {1 + pages_needed, kPage, kCacheRowDim});
  fill_bytes(cache, 0xFF);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t r = 0, next = 0; r < bs; ++r) {
    const int64_t readable = r < n_ext ? c.prefix[r] : seq_lens[r];  // extend rows: only the prefix is read
    for (int64_t i = 0; i < max_pages; ++i)
      req_to_page.data<int32_t>()[r * max_pages + i] = i * kPage < seq_lens[r] ? pages[next++] : 0;
    for (int64_t pos = 0; pos < readable; ++pos) {
      const int64_t slot = int64_t{req_to_page.data<int32_t>()[r * max_pages + pos / kPage]} * kPage + pos % kPage;
      for (int64_t d = 0; d < kCacheRowDim; ++d) set(cache, slot * kCacheRowDim + d, normal(rng));
    }
  }
  std::vector<int64_t> pool_rows(bs);
  std::iota(pool_rows.begin(), pool_rows.end(), 0);
  const HostTensor pool = int_tensor(DType::kInt64, pool_rows);
  const HostTensor lens = int_tensor(DType::kInt32, std::vector<int64_t>(seq_lens.begin(), seq_lens.end()));
  const HostTensor prefix = int_tensor(DType::kInt32, std::vector<int64_t>(c.prefix.begin(), c.prefix.end()));
  const HostTensor fresh = int_tensor(DType::kInt32, std::vector<int64_t>(c.fresh.begin(), c.fresh.end()));

  // The one-shot problem: each extend request's new queries over all its keys (prefix + new),
  // causal. Its keys and values are the expansion of the latents the loops will see: the
  // gathered cache rows (× k_scale, BF16), then the new tokens' own latents.
  PrefillProblemSpec spec;
  spec.name = name;
  spec.dtype = c.dtype;
  spec.heads = spec.kv_heads = kHeads;
  spec.spare_rows = 0;
  for (int64_t b = 0; b < n_ext; ++b) spec.requests.push_back({c.fresh[b], c.prefix[b] + c.fresh[b]});
  PrefillProblem pb = make_prefill_problem(spec);
  const int64_t total_q = pb.q_begin.back(), total_k = pb.k_begin.back();
  HostTensor latent(DType::kBFloat16, {total_k, kCacheRowDim});
  for (int64_t i = 0; i < latent.numel(); ++i) set(latent, i, normal(rng));  // prefix rows replaced below
  std::vector<int64_t> prefix_slots, prefix_rows;
  for (int64_t b = 0; b < n_ext; ++b)
    for (int64_t pos = 0; pos < c.prefix[b]; ++pos) {
      prefix_slots.push_back(int64_t{req_to_page.data<int32_t>()[b * max_pages + pos / kPage]} * kPage + pos % kPage);
      prefix_rows.push_back(pb.k_begin[b] + pos);
    }
  const HostTensor slots = int_tensor(DType::kInt64, prefix_slots);
  HostTensor gathered(DType::kBFloat16, {static_cast<int64_t>(prefix_slots.size()), kCacheRowDim});
  if (!prefix_slots.empty()) gather_cache(cache.view(), slots.view(), gathered.view(), k_scale);
  for (size_t i = 0; i < prefix_rows.size(); ++i)
    std::memcpy(latent.data<uint16_t>() + prefix_rows[i] * kCacheRowDim, gathered.data<uint16_t>() + i * kCacheRowDim,
                kCacheRowDim * sizeof(uint16_t));
  const PrefixExpansion expand(kHeads, rng);
  expand(latent.view(), pb.k, pb.v);
  // The self-pass keys: the new tokens' rows of the one-shot keys, packed.
  HostTensor self_k(c.dtype, {total_q, kHeads, kPrefillQkDim}), self_v(c.dtype, {total_q, kHeads, kPrefillVDim});
  for (int64_t b = 0; b < n_ext; ++b) {
    const int64_t first = pb.k_begin[b] + c.prefix[b];
    expand(detail::slice_rows(latent.view(), first, c.fresh[b]), detail::slice_rows(self_k.view(), pb.q_begin[b], c.fresh[b]),
           detail::slice_rows(self_v.view(), pb.q_begin[b], c.fresh[b]));
  }

  // On the GPU, through the backend.
  MlaBackend backend(config_for(c, current_gpu()));
  const bool transposed = c.v_layout == PrefillValueLayout::kFp8Transposed;
  const DeviceTensor d_cache(cache), d_table(req_to_page), d_pool(pool), d_lens(lens), d_self_k(self_k),
      d_self_v(transposed ? transposed_values(self_v.view(), fp8_transposed_value_positions(total_q)) : self_v);
  DevicePrefill one_shot(pb);  // holds q, cu_seqlens_q and the one-shot keys on the device
  backend.init_forward_metadata(bs, n_ext, d_pool.view(), d_lens.view(), n_dec ? ForwardMode::kMixed : ForwardMode::kExtend,
                                d_table.view(), MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  const ExtendMetadata& md = *backend.extend_metadata();
  DeviceTensor out(DType::kBFloat16, {total_q, kHeads, kPrefillVDim}), lse(DType::kFloat32, {total_q, kHeads});
  out.fill_bytes(0xFF);
  lse.fill_bytes(0xFF);
  backend.forward_extend_chunked(one_shot.q, d_self_k.view(), d_self_v.view(), c.v_layout, one_shot.cu_q.view(),
                                 one_shot.cu_q.view(), true, scale, out.view(), lse.view());
  const int64_t rows = std::max<int64_t>(md.chunks.max_loop_tokens, 1);
  DeviceTensor s_latent(DType::kBFloat16, {rows, kCacheRowDim}), s_k(c.dtype, {rows, kHeads, kPrefillQkDim}),
      s_v(c.dtype, prefill_value_shape(rows, kHeads, c.v_layout)),
      s_out(DType::kBFloat16, {total_q, kHeads, kPrefillVDim}), s_lse(DType::kFloat32, {total_q, kHeads});
  int64_t loops = 0;
  backend.attend_cached_prefix(
      one_shot.q, d_cache.view(), k_scale,
      [&](const TensorView& l, const TensorView& k, const TensorView& v) {
        ++loops;
        expand.on_device(l, k, v, c.v_layout);
      },
      PrefixScratch{s_latent.view(), s_k.view(), s_v.view(), s_out.view(), s_lse.view(), c.v_layout}, out.view(),
      lse.view(), scale);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
  EXPECT_EQ(loops, md.chunks.num_loops) << name;
  const PrefillResult chunked{out.to_host(), lse.to_host()};

  one_shot.run(spec);
  const PrefillErrors vs_gpu = compare_prefill(pb, chunked, one_shot.download());
  const PrefillErrors vs_ref = compare_prefill(pb, chunked, prefill_reference(pb));
  report(pb, vs_ref.worst_out, vs_ref.worst_lse, "(chunked, " + std::to_string(loops) + " loops)");
  std::printf("[ prefill-chunked ] %s vs one-shot GPU: out rel_l2=%.3g lse max_abs=%.3g\n", spec.label().c_str(),
              vs_gpu.worst_out, vs_gpu.worst_lse);
  expect_within(pb, vs_ref, reference_bounds(c.dtype));
  expect_within(pb, vs_gpu, one_shot_bounds(c.dtype));
  if (n_dec == 0) return;

  // The decode rows of the mixed batch, against the CPU backend on the same batch.
  HostTensor q_dec(DType::kBFloat16, {n_dec, kHeads, kCacheRowDim});
  fill_uniform(q_dec, rng, -1.0, 1.0);
  MlaBackend cpu(config_for(c, Device{}));
  cpu.init_forward_metadata(bs, n_ext, pool.view(), lens.view(), ForwardMode::kMixed, req_to_page.view(),
                            MlaBackend::ExtendLens{prefix.view(), fresh.view()});
  HostTensor expected(DType::kBFloat16, {n_dec, kHeads, kLatentDim});
  cpu.forward_decode(q_dec.view(), cache.view(), n_dec, expected.view(), scaling, k_scale);
  const DeviceTensor d_q_dec(q_dec);
  DeviceTensor d_out_dec(DType::kBFloat16, {n_dec, kHeads, kLatentDim});
  d_out_dec.fill_bytes(0xFF);
  backend.forward_decode(d_q_dec.view(), d_cache.view(), n_dec, d_out_dec.view(), scaling, k_scale);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess) << name;
  const ErrorStats err = compare(d_out_dec.to_host(), expected);
  EXPECT_EQ(err.nonfinite, 0) << name;
  EXPECT_LT(err.rel_l2, decode_bound(c.dtype)) << name << " decode rows: " << err.summary();
}

class BackendPrefillGpu : public DtypeGpuTest {};

// Five extend requests (one without a prefix, one with a single new token), 512 prefix tokens
// per loop: 102 per request, so the 1000-token prefix takes ten loops and most loops hold
// requests of unequal chunk lengths.
TEST_P(BackendPrefillGpu, ChunkedPrefixEqualsOneShot) {
  run_extend_case({dtype(), {300, 0, 1000, 64, 5}, {50, 7, 1, 129, 16}, {}, 512}, "chunked-prefix");
}

// The same extend rows first, then three decode requests.
TEST_P(BackendPrefillGpu, MixedBatchExtendRowsThenDecodeRows) {
  run_extend_case({dtype(), {300, 0, 1000, 64, 5}, {50, 7, 1, 129, 16}, {700, 33, 1}, 512}, "mixed");
}

// One request whose prefix fits in a single loop, one whose prefix is empty: no loop at all.
TEST_P(BackendPrefillGpu, SingleLoopAndNoLoop) {
  run_extend_case({dtype(), {200}, {65}, {}, 8192 * 4}, "one-loop");
  run_extend_case({dtype(), {0, 0}, {130, 1}, {}, 8192 * 4}, "no-loop");
}

// FP8 with values in the kFp8Transposed layout: the self-pass and every loop's expansion.
TEST(BackendPrefillGpuTransposedValues, ChunkedPrefixAndMixedBatch) {
  SPEEDMLA_REQUIRE_GPU();
  const PrefillValueLayout t = PrefillValueLayout::kFp8Transposed;
  run_extend_case({DType::kFloat8E4M3, {300, 0, 1000, 64, 5}, {50, 7, 1, 129, 16}, {}, 512, t}, "chunked-prefix-vt");
  run_extend_case({DType::kFloat8E4M3, {300, 0, 1000, 64, 5}, {50, 7, 1, 129, 16}, {700, 33, 1}, 512, t}, "mixed-vt");
  run_extend_case({DType::kFloat8E4M3, {200}, {65}, {}, 8192 * 4, t}, "one-loop-vt");
}

INSTANTIATE_TEST_SUITE_P(Types, BackendPrefillGpu, ::testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
