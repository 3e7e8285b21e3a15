// Host-side creation of TMA tensor maps (cuTensorMapEncodeTiled through the runtime's driver
// entry point, so the library does not link libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace speedmla::kernels::sm90 {

enum class TmaElement { kUInt8, kBFloat16 };
// The shared-memory swizzle of the boxes TMA writes. The box's innermost extent, in bytes, must
// not exceed the swizzle span (kNone: 16..256 bytes, any multiple of 16).
enum class TmaSwizzle { kNone, k32B, k64B, k128B };
// How far past each access L2 fetches: larger promotions suit long contiguous rows (the 1152-byte
// BF16 cache rows of decode), kNone suits scattered small boxes.
enum class TmaL2Promotion { kNone, k64B, k128B, k256B };

inline constexpr int kMaxTmaRank = 5;

constexpr int tma_element_bytes(TmaElement element) { return element == TmaElement::kUInt8 ? 1 : 2; }

// Bytes of one swizzle row; 0 for kNone.
constexpr int tma_swizzle_bytes(TmaSwizzle swizzle) {
  switch (swizzle) {
    case TmaSwizzle::k32B: return 32;
    case TmaSwizzle::k64B: return 64;
    case TmaSwizzle::k128B: return 128;
    case TmaSwizzle::kNone: return 0;
  }
  return 0;
}

// A tiled tensor of `rank` (1..5) dimensions, dims[0] contiguous.
struct TensorMapDesc {
  int rank = 0;
  uint64_t dims[kMaxTmaRank] = {};                // extents in elements, each in [1, 2^32]
  uint64_t byte_strides[kMaxTmaRank - 1] = {};    // of dims 1..rank-1; multiples of 16, < 2^40
  uint32_t box[kMaxTmaRank] = {};                 // box extents in elements, each in [1, 256]
  TmaElement element = TmaElement::kBFloat16;
  TmaSwizzle swizzle = TmaSwizzle::k128B;
  TmaL2Promotion l2_promotion = TmaL2Promotion::k256B;
};

// Encodes `desc` over `base` (16-byte aligned; 128-byte for swizzled maps). Out-of-bounds box
// elements read as zeros. Returns the driver's error (0 on success; CUDA_ERROR_INVALID_VALUE for
// a rank outside 1..5, CUDA_ERROR_NOT_FOUND when the driver lacks the entry point).
int make_tensor_map(CUtensorMap* map, const void* base, const TensorMapDesc& desc);

// A 3-D tiled map over `base` with extents dims[0..2] (dims[0] contiguous) and byte strides
// for dims 1 and 2; boxes of box[0..2] elements, L2 promotion of 256 bytes. Returns the driver's
// error (0 on success).
int make_tensor_map_3d(CUtensorMap* map, const void* base, TmaElement element, const uint64_t dims[3],
                       const uint64_t byte_strides[2], const uint32_t box[3], TmaSwizzle swizzle);

}  // namespace speedmla::kernels::sm90
