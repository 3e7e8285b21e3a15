// Reference cache write and gather (speedmla/cache.h).
#include <limits>
#include <vector>

#include "reference/element.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla::reference {

// Serial, in row order: when two rows target one slot, the later row wins.
void kv_cache_write(const TensorView& kv_cache, const TensorView& slots, const TensorView& latent,
                    const TensorView& rope, float scale_inv) {
  const int64_t page_size = kv_cache.size(1), num_slots = kv_cache.size(0) * page_size;
  for (int64_t i = 0; i < slots.size(0); ++i) {
    const int64_t slot = load_index(slots, offset_of(slots, i));
    if (slot < 0 || slot >= num_slots) continue;
    const int64_t row = offset_of(kv_cache, slot / page_size, slot % page_size);
    convert_row(latent, offset_of(latent, i), kv_cache, row, kLatentDim, scale_inv);
    convert_row(rope, offset_of(rope, i), kv_cache, row + kLatentDim * kv_cache.stride(2), kRopeDim,
                scale_inv);
  }
}

void gather_cache(const TensorView& kv_cache, const TensorView& slots, const TensorView& out,
                  float scale) {
  const int64_t page_size = kv_cache.size(1), num_slots = kv_cache.size(0) * page_size;
  for (int64_t i = 0; i < slots.size(0); ++i) {
    const int64_t slot = load_index(slots, offset_of(slots, i));
    if (slot >= 0 && slot < num_slots) {
      convert_row(kv_cache, offset_of(kv_cache, slot / page_size, slot % page_size), out,
                  offset_of(out, i), kCacheRowDim, scale);
      continue;
    }
    // Padding (negative) reads as zeros; a slot past the cache cannot be honoured: NaN.
    const std::vector<double> fill(kCacheRowDim,
                                   slot < 0 ? 0.0 : std::numeric_limits<double>::quiet_NaN());
    store_row(out, offset_of(out, i), kCacheRowDim, fill.data());
  }
}

}  // namespace speedmla::reference
