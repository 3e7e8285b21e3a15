// Helpers of the backend tests: small integer tensors, the engine's page table, and reading
// integer views back (CPU and GPU tests).
#pragma once

#include <cstdint>
#include <vector>

#include <gtest/gtest.h>

#include <string>

#include "common/util.h"
#include "speedmla/backend.h"
#include "speedmla/error.h"

namespace speedmla::test {

// A 1-D int32 or int64 host tensor holding `values`.
inline HostTensor int_tensor(DType dtype, const std::vector<int64_t>& values) {
  HostTensor t(dtype, {static_cast<int64_t>(values.size())});
  for (size_t i = 0; i < values.size(); ++i) set(t, static_cast<int64_t>(i), static_cast<double>(values[i]));
  return t;
}

// The engine's req_to_page [pool_size, max_pages] int32 with a recognisable page id per entry:
// pool row p, page index i -> 100 * p + i + 1 (never 0, the null page).
inline HostTensor numbered_req_to_page(int64_t pool_size, int64_t max_pages) {
  HostTensor t(DType::kInt32, {pool_size, max_pages});
  for (int64_t p = 0; p < pool_size; ++p)
    for (int64_t i = 0; i < max_pages; ++i) t.data<int32_t>()[p * max_pages + i] = static_cast<int32_t>(100 * p + i + 1);
  return t;
}

// The elements of a CPU integer view (any strides), row-major.
inline std::vector<int64_t> int_values(const TensorView& t) {
  std::vector<int64_t> values;
  const int64_t cols = t.ndim == 2 ? t.shape[1] : 1;
  const int64_t col_stride = t.ndim == 2 ? t.strides[1] : 0;
  for (int64_t r = 0; r < t.shape[0]; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      const int64_t offset = r * t.strides[0] + c * col_stride;
      values.push_back(t.dtype == DType::kInt64 ? t.ptr<const int64_t>()[offset]
                                                : t.ptr<const int32_t>()[offset]);
    }
  return values;
}

// The block table the backend must build: row r = req_to_page[pool_row[r]] (numbered as
// above) over the first min(width, max_pages) columns, page 0 elsewhere; pool rows outside
// [0, pool_size) and rows >= valid_rows give all zeros.
inline std::vector<int64_t> expected_block_table(const std::vector<int64_t>& pool_rows,
                                                 int64_t pool_size, int64_t max_pages,
                                                 int64_t width, int64_t valid_rows) {
  std::vector<int64_t> table;
  for (int64_t r = 0; r < static_cast<int64_t>(pool_rows.size()); ++r)
    for (int64_t c = 0; c < width; ++c) {
      const int64_t p = pool_rows[r];
      const bool mapped = r < valid_rows && p >= 0 && p < pool_size && c < max_pages;
      table.push_back(mapped ? 100 * p + c + 1 : 0);
    }
  return table;
}

inline MlaBackendConfig small_config(Device device = {}) {
  MlaBackendConfig config;
  config.num_heads = 8;
  config.tp_size = 2;
  config.page_size = 64;
  config.kv_cache_dtype = DType::kBFloat16;
  config.context_len = 300;  // 5 pages -> width 6 (a multiple of 128 / 64 = 2)
  config.max_batch = 4;
  config.max_graph_batch = 4;
  config.device = device;
  return config;
}

// Expects `body` to throw an Error whose message contains `needle`.
template <typename Body>
void expect_error(const Body& body, const std::string& needle) {
  try {
    body();
    ADD_FAILURE() << "no error; expected \"" << needle << "\"";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

}  // namespace speedmla::test
