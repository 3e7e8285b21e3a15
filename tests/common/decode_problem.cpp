#include "common/decode_problem.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <sstream>

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

}  // namespace speedmla::test
