// The paged latent-cache layout that every operation reading or writing the cache accepts:
// kv_cache [num_pages, page_size, 576], rows contiguous inside a page, pages at a stride of at
// least page_size * 576 elements (padding allowed). Element types and alignment are each
// operation's own checks.
#pragma once

#include <cstdint>

#include "api/check.h"
#include "speedmla/tensor.h"

namespace speedmla::detail {

struct CacheLayout {
  int64_t num_pages, page_size;
};

// Throws speedmla::Error naming kv_cache and what was expected when the layout does not hold.
CacheLayout check_cache_layout(const ArgChecker& check, const TensorView& kv_cache);

}  // namespace speedmla::detail
