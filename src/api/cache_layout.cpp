#include "api/cache_layout.h"

#include "speedmla/decode.h"

namespace speedmla::detail {

CacheLayout check_cache_layout(const ArgChecker& check, const TensorView& kv_cache) {
  check.defined(kv_cache, "kv_cache", 3);
  check.dim(kv_cache, "kv_cache", 2, kCacheRowDim);
  const CacheLayout layout{kv_cache.size(0), kv_cache.size(1)};
  check.require(layout.page_size >= 1, "kv_cache.shape[1] (page_size) must be >= 1, got ", layout.page_size);
  check.last_dim_contiguous(kv_cache, "kv_cache");
  check.require(layout.page_size == 1 || kv_cache.stride(1) == kCacheRowDim,
                "kv_cache rows must be contiguous inside a page (stride(1) == ", kCacheRowDim, "), got ",
                kv_cache.stride(1));
  check.require(layout.num_pages <= 1 || kv_cache.stride(0) >= layout.page_size * kCacheRowDim,
                "kv_cache.stride(0) (the page stride) must be >= page_size * ", kCacheRowDim, " = ",
                layout.page_size * kCacheRowDim, ", got ", kv_cache.stride(0));
  return layout;
}

}  // namespace speedmla::detail
