// gather_cache on the GPU: launch parameters and launcher.
#pragma once

#include <cstdint>

#include "kernels/cache/paged_cache.h"

namespace speedmla::kernels {

// out[i] = bf16(cache[slots[i]] × scale); a negative slot gives zeros, a slot >= num_slots NaN.
struct GatherCacheParams {
  PagedCache cache;      // read
  const int64_t* slots;  // [num_rows]
  int64_t slot_stride;   // elements between slots
  void* out;             // [num_rows, 576] BF16, last dim contiguous
  int64_t out_stride;    // elements between rows
  int64_t num_rows;
  float scale;           // multiplies every value before the conversion to BF16
};

void run_gather_cache(const GatherCacheParams& params, Stream stream);

}  // namespace speedmla::kernels
