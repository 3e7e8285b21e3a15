// speedmla/cache.h — writing to and gathering from the paged latent KV cache.
//
// The cache of one layer is kv_cache[num_pages, page_size, 576] (FP8 e4m3 or BF16), each row
// latent(512) ‖ rope(64). A token's slot is page * page_size + offset (int64: caches of more
// than 2^31 elements work). Pages may be a strided view; rows inside a page are contiguous.
#pragma once

#include "speedmla/tensor.h"

namespace speedmla {

// Writes rows into the cache: kv_cache[slot] = convert(latent[i] ‖ rope[i], × scale_inv).
//   kv_cache  [num_pages, page_size, 576] FP8 e4m3 or BF16 (written at the given slots).
//   slots     [T] int64. Negative slots are skipped (padding). Slots >= num_pages*page_size
//             are skipped as well (they cannot be checked on the host for device tensors).
//             Two rows naming the same slot: the CPU keeps the later one, the GPU either one
//             (engines never do this; slots of one step are distinct).
//   latent    [T, 512] and rope [T, 64]: BF16, FP16 or FP32 (may differ); last dim contiguous.
//   scale_inv multiplies each value before conversion; FP8 conversion rounds to nearest even
//             and saturates to ±448.
void kv_cache_write(const TensorView& kv_cache, const TensorView& slots, const TensorView& latent,
                    const TensorView& rope, float scale_inv = 1.0f, Stream stream = nullptr);

// Gathers cache rows, dequantised to BF16: out[i] = bf16(kv_cache[slots[i]] × scale).
//   kv_cache  as above;  slots [n] int64;  out [n, 576] BF16, last dim contiguous.
//   A negative slot gives a row of zeros; a slot >= num_pages*page_size a row of NaN.
void gather_cache(const TensorView& kv_cache, const TensorView& slots, const TensorView& out,
                  float scale = 1.0f, Stream stream = nullptr);

}  // namespace speedmla
