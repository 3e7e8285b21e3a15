// kv_cache_write on the GPU: launch parameters and launcher.
#pragma once

#include <cstdint>

#include "kernels/cache/paged_cache.h"

namespace speedmla::kernels {

// cache[slots[t]] = convert(latent[t] ‖ rope[t], × scale_inv) for every token t whose slot is in
// [0, cache.num_slots); other slots (padding) are skipped.
struct KvCacheWriteParams {
  PagedCache cache;      // written
  const int64_t* slots;  // [num_tokens]
  int64_t slot_stride;   // elements between slots
  const void* latent;    // [num_tokens, 512], last dim contiguous
  DType latent_dtype;    // BF16, FP16 or FP32
  int64_t latent_stride;  // elements between tokens
  const void* rope;      // [num_tokens, 64], last dim contiguous
  DType rope_dtype;      // BF16, FP16 or FP32
  int64_t rope_stride;   // elements between tokens
  int64_t num_tokens;
  float scale_inv;       // multiplies every value before the conversion
};

void run_kv_cache_write(const KvCacheWriteParams& params, Stream stream);

}  // namespace speedmla::kernels
