// The shared-memory swizzles that TMA writes and wgmma reads (CU_TENSOR_MAP_SWIZZLE_64B/128B):
// within each 512-byte (64B) or 1024-byte (128B) atom, the 16-byte piece p of row r sits at
// piece p ^ (row bits), so the rows of an 8-row group fall in different banks. Atoms must start
// at 1024-byte aligned addresses.
#pragma once

#include <cstdint>

#include "kernels/sm90/primitives.cuh"

namespace speedmla::kernels::sm90 {

// Byte offset of 16-byte piece `piece` of row `row` in a K-major tile whose rows are one
// swizzle span long (64 bytes for kSwizzle64B, 128 bytes for kSwizzle128B).
template <SmemLayout kLayout>
__device__ __forceinline__ uint32_t swizzled_piece_offset(int row, int piece) {
  static_assert(kLayout == SmemLayout::kSwizzle64B || kLayout == SmemLayout::kSwizzle128B);
  if constexpr (kLayout == SmemLayout::kSwizzle64B)
    return row * 64 + ((piece ^ ((row >> 1) & 3)) << 4);
  else
    return row * 128 + ((piece ^ (row & 7)) << 4);
}

}  // namespace speedmla::kernels::sm90
