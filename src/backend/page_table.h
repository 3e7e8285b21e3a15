// Validation and CPU/GPU dispatch of the metadata kernels (kernels/backend/page_table.h).
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

namespace speedmla::detail {

// block_table[r, c] = req_to_page[req_pool_indices[r], c] for r < num_valid_rows and
// c < req_to_page.shape[1]; page 0 elsewhere and for pool indices outside [0, pool_size).
//   req_to_page      [pool_size, max_pages] int32, last dim contiguous (the engine's)
//   req_pool_indices [>= num_valid_rows] int32 or int64 (the engine's)
//   block_table      [rows, width] int32, the backend's (trusted)
// All on block_table's device. Throws Error naming `caller` for bad engine tensors.
void build_block_table(const char* caller, const TensorView& req_to_page,
                       const TensorView& req_pool_indices, int64_t num_valid_rows,
                       const TensorView& block_table, Stream stream);

// Cache slots of token ranges of batch rows (kernels::RangeSlotsParams):
//   ranges [num_ranges, 4] int64 {row, first position, count, first output}, slots [n] int64,
// both the backend's, on the device of req_to_page. Rows index req_pool_indices.
void build_range_slots(const char* caller, const TensorView& req_to_page,
                       const TensorView& req_pool_indices, int64_t num_rows,
                       const TensorView& ranges, int64_t page_size, const TensorView& slots,
                       Stream stream);

}  // namespace speedmla::detail
