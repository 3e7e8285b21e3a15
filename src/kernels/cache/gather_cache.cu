#include "kernels/cache/gather_cache.h"

#include <cmath>

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

namespace speedmla::kernels {
namespace {

// Elements per work item on the vector path: 16 FP8 (one 16-byte load) or 16 BF16 (two), and
// 16 BF16 out (two 16-byte stores).
constexpr int kVectorChunk = 16;

// One work item is kChunk consecutive elements of one output row.
template <typename CacheT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads) gather_cache_kernel(const GatherCacheParams p) {
  constexpr int kChunksPerRow = kCacheRowDim / kChunk;
  const int64_t items = p.num_rows * kChunksPerRow;
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    const int64_t row = i / kChunksPerRow;
    const int chunk = static_cast<int>(i % kChunksPerRow);
    const int64_t slot = p.slots[row * p.slot_stride];
    float values[kChunk];
    if (slot >= 0 && slot < p.cache.num_slots) {
      load_floats(static_cast<const CacheT*>(p.cache.data) + p.cache.row_offset(slot) + chunk * kChunk,
                  values);
#pragma unroll
      for (float& v : values) v *= p.scale;
    } else {
#pragma unroll
      for (float& v : values) v = slot < 0 ? 0.f : NAN;  // padding reads 0; past the cache NaN
    }
    store_floats(static_cast<bf16*>(p.out) + row * p.out_stride + chunk * kChunk, values);
  }
}

template <typename CacheT>
void launch(const GatherCacheParams& p, Stream stream) {
  // The cache is 16-byte aligned (validated); the output decides.
  if (aligned16(p.out, DType::kBFloat16, {p.out_stride}))
    launch_elementwise(gather_cache_kernel<CacheT, kVectorChunk>,
                       p.num_rows * (kCacheRowDim / kVectorChunk), p, stream);
  else
    launch_elementwise(gather_cache_kernel<CacheT, 1>, p.num_rows * kCacheRowDim, p, stream);
}

}  // namespace

void run_gather_cache(const GatherCacheParams& params, Stream stream) {
  if (params.cache.dtype == DType::kFloat8E4M3)
    launch<fp8_e4m3>(params, stream);
  else
    launch<bf16>(params, stream);
}

}  // namespace speedmla::kernels
