// Block tables and token slots on the GPU: one thread per table entry or slot.
#include "kernels/backend/page_table.h"
#include "kernels/common/launch.cuh"

namespace speedmla::kernels {
namespace {

__global__ void build_block_table_kernel(BlockTableParams p) {
  const int64_t entries = p.num_rows * p.block_table_width;
  for (int64_t i = global_thread_index(); i < entries; i += global_thread_count()) {
    const int64_t row = i / p.block_table_width, column = i % p.block_table_width;
    p.block_table[row * p.block_table_stride + column] = block_table_entry(p, row, column);
  }
}

// One block per range: ranges are a request's share of a chunk loop, often thousands of tokens.
__global__ void range_slots_kernel(RangeSlotsParams p) {
  const int64_t* range = p.ranges + static_cast<int64_t>(blockIdx.x) * kRangeFields;
  const int64_t row = range[0], first_position = range[1], count = range[2], first_out = range[3];
  for (int64_t j = threadIdx.x; j < count; j += blockDim.x)
    p.slots[first_out + j] = range_slot(p, row, first_position + j);
}

constexpr int kRangeThreads = 256;

}  // namespace

void run_build_block_table(const BlockTableParams& params, Stream stream) {
  launch_elementwise(build_block_table_kernel, params.num_rows * params.block_table_width, params,
                     stream);
}

void run_range_slots(const RangeSlotsParams& params, Stream stream) {
  if (params.num_ranges == 0) return;
  range_slots_kernel<<<static_cast<unsigned>(params.num_ranges), kRangeThreads, 0, stream>>>(
      params);
}

}  // namespace speedmla::kernels
