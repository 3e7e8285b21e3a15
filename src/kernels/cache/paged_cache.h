// The paged latent KV cache as the cache kernels see it (speedmla/cache.h).
#pragma once

#include <cstdint>

#include "speedmla/decode.h"
#include "speedmla/tensor.h"

namespace speedmla::kernels {

// kv_cache[num_pages, page_size, 576]: rows contiguous inside a page, pages page_stride apart.
struct PagedCache {
  void* data;           // FP8 e4m3 or BF16 elements, 16-byte aligned
  DType dtype;          // kFloat8E4M3 or kBFloat16
  int64_t page_stride;  // elements between pages (>= page_size * 576, a multiple of 16 bytes)
  int64_t page_size;    // rows per page (>= 1)
  int64_t num_slots;    // derived: num_pages * page_size; valid slots are [0, num_slots)

  // Element offset of the row of a valid slot (page = slot / page_size, row = slot % page_size).
  constexpr int64_t row_offset(int64_t slot) const {
    return slot / page_size * page_stride + slot % page_size * kCacheRowDim;
  }
};

}  // namespace speedmla::kernels
