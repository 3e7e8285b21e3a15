#include "kernels/cache/kv_cache_write.h"

#include "kernels/common/launch.cuh"
#include "kernels/common/vec.cuh"

namespace speedmla::kernels {
namespace {

// Elements per work item on the vector path: 16 FP8 (one 16-byte store) or 16 BF16 (two).
constexpr int kVectorChunk = 16;

// One work item is kChunk consecutive elements of one cache row; consecutive threads take
// consecutive chunks of a row, so every access of a warp is contiguous.
template <typename CacheT, int kChunk>
__global__ void __launch_bounds__(kElementwiseThreads)
    kv_cache_write_kernel(const KvCacheWriteParams p) {
  constexpr int kChunksPerRow = kCacheRowDim / kChunk;
  constexpr int kLatentChunks = kLatentDim / kChunk;
  const int64_t items = p.num_tokens * kChunksPerRow;
  for (int64_t i = global_thread_index(); i < items; i += global_thread_count()) {
    const int64_t token = i / kChunksPerRow;
    const int chunk = static_cast<int>(i % kChunksPerRow);
    const int64_t slot = p.slots[token * p.slot_stride];
    if (slot < 0 || slot >= p.cache.num_slots) continue;
    float values[kChunk];
    if (chunk < kLatentChunks)
      load_floats(p.latent, p.latent_dtype, token * p.latent_stride + chunk * kChunk, values);
    else
      load_floats(p.rope, p.rope_dtype, token * p.rope_stride + (chunk - kLatentChunks) * kChunk,
                  values);
#pragma unroll
    for (float& v : values) v *= p.scale_inv;
    store_floats(static_cast<CacheT*>(p.cache.data) + p.cache.row_offset(slot) + chunk * kChunk,
                 values);
  }
}

template <typename CacheT>
void launch(const KvCacheWriteParams& p, Stream stream) {
  // The cache is 16-byte aligned (validated); the inputs decide.
  if (aligned16(p.latent, p.latent_dtype, {p.latent_stride}) &&
      aligned16(p.rope, p.rope_dtype, {p.rope_stride}))
    launch_elementwise(kv_cache_write_kernel<CacheT, kVectorChunk>,
                       p.num_tokens * (kCacheRowDim / kVectorChunk), p, stream);
  else
    launch_elementwise(kv_cache_write_kernel<CacheT, 1>, p.num_tokens * kCacheRowDim, p, stream);
}

}  // namespace

void run_kv_cache_write(const KvCacheWriteParams& params, Stream stream) {
  if (params.cache.dtype == DType::kFloat8E4M3)
    launch<fp8_e4m3>(params, stream);
  else
    launch<bf16>(params, stream);
}

}  // namespace speedmla::kernels
