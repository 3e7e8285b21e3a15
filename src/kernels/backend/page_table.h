// The backend's metadata kernels: block tables and token slots from the engine's page table.
//
// Each rule is one inline function used by both the GPU kernel and its CPU twin, so the two
// cannot disagree. Parameters are validated by src/backend/page_table.cpp.
#pragma once

#include <cstdint>

#include "speedmla/tensor.h"

#if defined(__CUDACC__)
#define SPEEDMLA_HOST_DEVICE __host__ __device__
#else
#define SPEEDMLA_HOST_DEVICE
#endif

namespace speedmla::kernels {

// The engine's page table and the pool row of each request of a batch.
struct PageTable {
  const int32_t* req_to_page;       // [pool_size, width] page ids
  int64_t row_stride;               // elements between pool rows (>= width)
  int64_t pool_size;
  int64_t width;                    // pages per pool row
  const void* req_pool_indices;     // [num_rows] int32 or int64: pool row of batch row r
  int64_t req_pool_indices_stride;  // elements between indices
  bool req_pool_indices_int64;

  // Pool row of batch row r, or -1 when the index is out of range (never read then).
  SPEEDMLA_HOST_DEVICE int64_t pool_row(int64_t r) const {
    const int64_t offset = r * req_pool_indices_stride;
    const int64_t index = req_pool_indices_int64
                              ? static_cast<const int64_t*>(req_pool_indices)[offset]
                              : static_cast<const int32_t*>(req_pool_indices)[offset];
    return index >= 0 && index < pool_size ? index : -1;
  }
};

// block_table[r, c] = req_to_page[pool_row(r), c] for valid rows, pool rows and columns;
// page 0 (the null page) everywhere else.
struct BlockTableParams {
  PageTable pages;
  int64_t num_rows;
  int64_t num_valid_rows;  // rows >= this are CUDA-graph padding
  int32_t* block_table;    // [num_rows, width]
  int64_t block_table_stride;
  int64_t block_table_width;
};

SPEEDMLA_HOST_DEVICE inline int32_t block_table_entry(const BlockTableParams& p, int64_t row,
                                                      int64_t column) {
  if (row >= p.num_valid_rows || column >= p.pages.width) return 0;
  const int64_t pool_row = p.pages.pool_row(row);
  return pool_row < 0 ? 0 : p.pages.req_to_page[pool_row * p.pages.row_stride + column];
}

// Slots of token ranges: range k = {batch row, first position, count, first output index}
// writes slots[first output + j] = page * page_size + (position % page_size) for the page
// holding position first position + j of that request. A row with an out-of-range pool index,
// or a position past the pool row's pages, gives slot -1 (gather_cache reads zeros there).
struct RangeSlotsParams {
  PageTable pages;
  const int64_t* ranges;  // [num_ranges, 4], contiguous
  int64_t num_ranges;
  int64_t page_size;
  int64_t* slots;         // contiguous
};

inline constexpr int kRangeFields = 4;

SPEEDMLA_HOST_DEVICE inline int64_t range_slot(const RangeSlotsParams& p, int64_t row,
                                               int64_t position) {
  const int64_t pool_row = p.pages.pool_row(row);
  const int64_t page_index = position / p.page_size;
  if (pool_row < 0 || page_index >= p.pages.width) return -1;
  const int64_t page = p.pages.req_to_page[pool_row * p.pages.row_stride + page_index];
  return page * p.page_size + position % p.page_size;
}

// GPU launchers (stream-ordered, no allocation, no sync) and their CPU twins.
void run_build_block_table(const BlockTableParams& params, Stream stream);
void build_block_table_on_host(const BlockTableParams& params);
void run_range_slots(const RangeSlotsParams& params, Stream stream);
void range_slots_on_host(const RangeSlotsParams& params);

}  // namespace speedmla::kernels
