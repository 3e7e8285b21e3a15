// Host-side creation of TMA tensor maps (cuTensorMapEncodeTiled through the runtime's driver
// entry point, so the library does not link libcuda).
#pragma once

#include <cuda.h>

#include <cstdint>

namespace speedmla::kernels::sm90 {

enum class TmaElement { kUInt8, kBFloat16 };
enum class TmaSwizzle { k64B, k128B };

// A 3-D tiled map over `base` with extents dims[0..2] (dims[0] contiguous) and byte strides
// for dims 1 and 2; boxes of box[0..2] elements. Returns the driver's error (0 on success).
int make_tensor_map_3d(CUtensorMap* map, const void* base, TmaElement element, const uint64_t dims[3],
                       const uint64_t byte_strides[2], const uint32_t box[3], TmaSwizzle swizzle);

}  // namespace speedmla::kernels::sm90
