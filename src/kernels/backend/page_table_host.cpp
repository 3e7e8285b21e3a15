// CPU twins of the metadata kernels: the same per-entry rules, in plain loops.
#include "kernels/backend/page_table.h"

namespace speedmla::kernels {

void build_block_table_on_host(const BlockTableParams& params) {
  for (int64_t row = 0; row < params.num_rows; ++row)
    for (int64_t column = 0; column < params.block_table_width; ++column)
      params.block_table[row * params.block_table_stride + column] =
          block_table_entry(params, row, column);
}

void range_slots_on_host(const RangeSlotsParams& params) {
  for (int64_t k = 0; k < params.num_ranges; ++k) {
    const int64_t* range = params.ranges + k * kRangeFields;
    for (int64_t j = 0; j < range[2]; ++j)
      params.slots[range[3] + j] = range_slot(params, range[0], range[1] + j);
  }
}

}  // namespace speedmla::kernels
