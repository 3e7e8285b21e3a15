#include "common/decode_problem.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <sstream>

#include "common/error_budget.h"

namespace speedmla::test {

std::string DecodeProblemSpec::name() const {
  std::ostringstream os;
  os << dtype_name(dtype) << "_B" << batch << "_q" << q_len << "_H" << heads << "_page" << page_size;
  if (page_stride_pad) os << "_strided";
  if (!seq_lens.empty()) {
    const auto [lo, hi] = std::minmax_element(seq_lens.begin(), seq_lens.end());
    os << "_len" << *lo << "-" << *hi;
  }
  os << "_seed" << seed;
  return os.str();
}

std::vector<int32_t> random_lengths(std::mt19937_64& rng, int64_t batch, int32_t lo, int32_t hi) {
  std::uniform_real_distribution<double> u(std::log(double(lo)), std::log(double(hi) + 1.0));
  std::vector<int32_t> lens(batch);
  for (auto& len : lens) len = std::clamp(static_cast<int32_t>(std::exp(u(rng))), lo, hi);
  return lens;
}

DecodeProblem make_decode_problem(const DecodeProblemSpec& spec) {
  DecodeProblem pb;
  pb.spec = spec;
  std::mt19937_64 rng(spec.seed);
  const int64_t B = spec.batch, ps = spec.page_size;

  std::vector<int64_t> pages_needed(B);
  int64_t max_pages = 1, total_pages = 0;
  for (int64_t b = 0; b < B; ++b) {
    pages_needed[b] = (std::max<int32_t>(spec.seq_lens[b], 0) + ps - 1) / ps;
    max_pages = std::max(max_pages, pages_needed[b]);
    total_pages += pages_needed[b];
  }
  pb.num_pages = 1 + total_pages + spec.spare_pages;  // page 0: the null page

  const int64_t page_stride = ps * kCacheRowDim + spec.page_stride_pad;
  pb.cache_storage = HostTensor(spec.dtype, {pb.num_pages * page_stride});
  fill_bytes(pb.cache_storage, 0xFF);  // NaN everywhere no request may read
  pb.kv_cache = pb.cache_storage.view();
  pb.kv_cache.ndim = 3;
  pb.kv_cache.shape = {pb.num_pages, ps, kCacheRowDim};
  pb.kv_cache.strides = {page_stride, kCacheRowDim, 1};

  // Pages 1.. in random order, so neighbouring blocks of a request are far apart.
  std::vector<int32_t> pool(total_pages + spec.spare_pages);
  std::iota(pool.begin(), pool.end(), 1);
  std::shuffle(pool.begin(), pool.end(), rng);

  const int64_t table_cols = max_pages + spec.table_pad_pages;
  pb.block_table = HostTensor(DType::kInt32, {B, table_cols});
  pb.seq_lens = HostTensor(DType::kInt32, {B});
  std::uniform_real_distribution<double> value(-1.0, 1.0);
  int64_t next = 0;
  for (int64_t b = 0; b < B; ++b) {
    pb.seq_lens.data<int32_t>()[b] = spec.seq_lens[b];
    int32_t* row = pb.block_table.data<int32_t>() + b * table_cols;
    std::fill(row, row + table_cols, 0);  // padding points at the null page
    for (int64_t i = 0; i < pages_needed[b]; ++i) {
      const int32_t page = pool[next++];
      row[i] = page;
      const int64_t tokens = std::min<int64_t>(ps, spec.seq_lens[b] - i * ps);
      for (int64_t t = 0; t < tokens; ++t)
        for (int64_t d = 0; d < kCacheRowDim; ++d)
          set(pb.cache_storage, page * page_stride + t * kCacheRowDim + d, value(rng));
    }
  }

  pb.q = HostTensor(spec.dtype, {B, spec.q_len, spec.heads, kCacheRowDim});
  fill_uniform(pb.q, rng, -1.0, 1.0);
  return pb;
}

DecodeResult run_reference(const DecodeProblem& pb) {
  const auto& s = pb.spec;
  DecodeResult r{HostTensor(DType::kBFloat16, {s.batch, s.q_len, s.heads, kLatentDim}),
                 HostTensor(DType::kFloat32, {s.batch, s.q_len, s.heads})};
  mla_decode(pb.q.view(), pb.kv_cache, pb.block_table.view(), pb.seq_lens.view(), r.out.view(), r.lse.view(),
             std::nullopt, s.softmax_scale, s.output_scale);
  return r;
}

DeviceProblem::DeviceProblem(const DecodeProblem& pb)
    : q(pb.q), cache_storage(pb.cache_storage), block_table(pb.block_table), seq_lens(pb.seq_lens) {
  const auto& s = pb.spec;
  kv_cache = pb.kv_cache;
  kv_cache.data = cache_storage.view().data;
  kv_cache.device = cache_storage.view().device;
  out = DeviceTensor(DType::kBFloat16, {s.batch, s.q_len, s.heads, kLatentDim});
  lse = DeviceTensor(DType::kFloat32, {s.batch, s.q_len, s.heads});
  const size_t bytes = mla_decode_workspace_size(s.batch, s.heads, s.q_len, device_sm_count(q.view().device.index));
  workspace = DeviceTensor(DType::kUInt8, {static_cast<int64_t>(bytes)});
}

void DeviceProblem::upload(const DecodeProblem& pb) {
  q.upload(pb.q);
  cache_storage.upload(pb.cache_storage);
  block_table.upload(pb.block_table);
  seq_lens.upload(pb.seq_lens);
}

void DeviceProblem::run(const DecodeProblemSpec& s, Stream stream,
                        const std::optional<DecodeContextParallel>& context_parallel) {
  mla_decode(q.view(), kv_cache, block_table.view(), seq_lens.view(), out.view(), lse.view(), workspace.view(),
             s.softmax_scale, s.output_scale, stream, context_parallel);
}

namespace {

// Element offset of token k of request b in a problem's cache storage.
int64_t cache_row_offset(const DecodeProblem& pb, int64_t b, int64_t k) {
  const int64_t ps = pb.spec.page_size;
  const int64_t page = pb.block_table.data<int32_t>()[b * pb.block_table.view().shape[1] + k / ps];
  return page * pb.kv_cache.strides[0] + (k % ps) * kCacheRowDim;
}

}  // namespace

CpRankProblem make_cp_rank_problem(const DecodeProblem& global, int world, int rank) {
  DecodeProblemSpec spec = global.spec;
  for (int32_t& len : spec.seq_lens) len = len > rank ? (len - rank + world - 1) / world : 0;
  spec.seed = global.spec.seed * 131 + static_cast<uint64_t>(world) * 17 + static_cast<uint64_t>(rank) + 1;
  CpRankProblem r{make_decode_problem(spec), HostTensor(DType::kInt32, {spec.batch}), world, rank};
  r.local.q = global.q;
  for (int64_t b = 0; b < spec.batch; ++b) {
    r.causal_seqs.data<int32_t>()[b] = global.spec.seq_lens[b];
    for (int64_t k = 0; k < spec.seq_lens[b]; ++k) {
      const int64_t from = cache_row_offset(global, b, rank + k * world), to = cache_row_offset(r.local, b, k);
      for (int64_t d = 0; d < kCacheRowDim; ++d) set(r.local.cache_storage, to + d, get(global.cache_storage, from + d));
    }
  }
  return r;
}

DecodeResult run_reference(const CpRankProblem& rank) {
  const DecodeProblem& pb = rank.local;
  const auto& s = pb.spec;
  DecodeResult r{HostTensor(DType::kBFloat16, {s.batch, s.q_len, s.heads, kLatentDim}),
                 HostTensor(DType::kFloat32, {s.batch, s.q_len, s.heads})};
  mla_decode(pb.q.view(), pb.kv_cache, pb.block_table.view(), pb.seq_lens.view(), r.out.view(), r.lse.view(),
             std::nullopt, s.softmax_scale, s.output_scale, nullptr,
             DecodeContextParallel{rank.causal_seqs.view(), rank.world, rank.rank});
  return r;
}

DecodeResult merge_partial_results(const std::vector<DecodeResult>& parts) {
  const TensorView shape = parts.at(0).out.view();
  DecodeResult merged{HostTensor(DType::kBFloat16, {shape.shape[0], shape.shape[1], shape.shape[2], kLatentDim}),
                      HostTensor(DType::kFloat32, {shape.shape[0], shape.shape[1], shape.shape[2]})};
  const int64_t rows = merged.lse.numel();
  std::vector<double> acc(kLatentDim);
  for (int64_t row = 0; row < rows; ++row) {
    double top = -INFINITY;
    for (const DecodeResult& part : parts) top = std::max(top, get(part.lse, row));
    std::fill(acc.begin(), acc.end(), 0.0);
    double total = 0;
    for (const DecodeResult& part : parts) {
      const double lse = get(part.lse, row);
      if (lse == -INFINITY) continue;  // no key in this part: its out may hold anything
      const double w = std::exp(lse - top);
      total += w;
      for (int64_t d = 0; d < kLatentDim; ++d) acc[d] += w * get(part.out, row * kLatentDim + d);
    }
    for (int64_t d = 0; d < kLatentDim; ++d) set(merged.out, row * kLatentDim + d, total > 0 ? acc[d] / total : 0.0);
    set(merged.lse, row, total > 0 ? top + std::log(total) : top);
  }
  return merged;
}

// Every request on its own, and every row's LSE: one entirely wrong request in a batch of 5000
// moves the batch's aggregate rel. L2 by ~0.014, well inside the FP8 bound. The aggregate is
// printed; the first few failing requests are named with their lengths.
void expect_matches(const DecodeResult& gpu, const DecodeResult& ref, const DecodeProblemSpec& spec) {
  const ErrorStats out = compare(gpu.out, ref.out);
  const ErrorStats lse = compare(gpu.lse, ref.lse);
  std::printf("[ decode ] %-60s out %s | lse max_abs=%.3g\n", spec.name().c_str(), out.summary().c_str(),
              lse.max_abs);
  int64_t wrong = 0;
  std::string first_wrong;
  double worst_rel_l2 = 0;
  for (int64_t b = 0; b < spec.batch; ++b) {
    const ErrorStats o = compare_rows(gpu.out, ref.out, b, b + 1);
    const ErrorStats l = compare_rows(gpu.lse, ref.lse, b, b + 1);  // max_abs: the worst row of b
    worst_rel_l2 = std::max(worst_rel_l2, o.rel_l2);
    const bool ok = o.nonfinite == 0 && o.mismatched_inf == 0 && o.rel_l2 < decode_bounds(spec.dtype).out_rel_l2 &&
                    l.nonfinite == 0 && l.mismatched_inf == 0 && l.max_abs < decode_bounds(spec.dtype).lse_max_abs;
    if (!ok && ++wrong <= 5)
      first_wrong += "\n  request " + std::to_string(b) + " (seq_len " + std::to_string(spec.seq_lens[b]) +
                     "): out " + o.summary() + " | lse " + l.summary();
  }
  record_error("mla_decode", spec.dtype, worst_rel_l2, out.max_abs, lse.max_abs);
  EXPECT_EQ(wrong, 0) << spec.name() << ": " << wrong << " of " << spec.batch
                      << " requests off (out rel_l2 bound " << decode_bounds(spec.dtype).out_rel_l2 << ", lse max_abs bound "
                      << decode_bounds(spec.dtype).lse_max_abs << "); the test's SPEEDMLA_TEST_SEED is printed above" << first_wrong;
}

}  // namespace speedmla::test
