// Launch helpers for the elementwise kernels (cache, merge, quantize): grid-stride grids and
// the host's choice between the 16-byte vector path and the scalar path.
#pragma once

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <iterator>

#include <cuda_runtime.h>

#include "speedmla/tensor.h"

namespace speedmla::kernels {

inline constexpr int kElementwiseThreads = 256;
// Enough blocks to fill any GPU many times over; a grid-stride loop covers larger problems.
inline constexpr int64_t kMaxElementwiseBlocks = int64_t{1} << 16;

// True when `data` and every stride (in elements of `dtype`) are multiples of 16 bytes: then
// any chunk starting at a multiple of 16 bytes inside a row can use 16-byte accesses.
// `strides`: a braced list or an array of int64_t.
template <typename Strides = std::initializer_list<int64_t>>
bool aligned16(const void* data, DType dtype, const Strides& strides) {
  const auto element_bytes = static_cast<int64_t>(dtype_size(dtype));
  return reinterpret_cast<uintptr_t>(data) % 16 == 0 &&
         std::all_of(std::begin(strides), std::end(strides),
                     [&](int64_t stride) { return stride * element_bytes % 16 == 0; });
}

// The grid-stride loop of those kernels: for (i = global_thread_index(); i < items;
// i += global_thread_count()), in 64-bit (caches may exceed 2^31 elements).
__device__ __forceinline__ int64_t global_thread_index() {
  return static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
}
__device__ __forceinline__ int64_t global_thread_count() {
  return static_cast<int64_t>(gridDim.x) * blockDim.x;
}

// Launches `kernel(params)` for a grid-stride loop over `items` work items (none: no launch).
template <typename Params>
void launch_elementwise(void (*kernel)(Params), int64_t items, const Params& params,
                        Stream stream) {
  if (items <= 0) return;
  const int64_t blocks = std::min(kMaxElementwiseBlocks,
                                  (items + kElementwiseThreads - 1) / kElementwiseThreads);
  kernel<<<static_cast<unsigned>(blocks), kElementwiseThreads, 0, stream>>>(params);
}

}  // namespace speedmla::kernels
