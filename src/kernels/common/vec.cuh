// Loading and storing N contiguous elements as floats. When N * sizeof(T) is a multiple of 16
// they move as 16-byte accesses (LDG.E.128 / STG.E.128) and the address must be 16-byte
// aligned, which the host guarantees by choosing that path only for aligned tensors; otherwise
// (N = 1, the scalar path) element by element.
#pragma once

#include <cstdint>

#include "kernels/common/convert.cuh"
#include "speedmla/tensor.h"

namespace speedmla::kernels {

// One 16-byte store (STG.E.128) to global memory. Written in PTX because nvcc may split a plain
// uint4 assignment inside a loop into four 4-byte stores.
__device__ __forceinline__ void store_global_16(uint4* dst, uint4 value) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(value.x), "r"(value.y),
               "r"(value.z), "r"(value.w)
               : "memory");
}

template <int N, typename T>
inline constexpr bool kWholeVectors = N * sizeof(T) % 16 == 0;

template <int N, typename T>
__device__ __forceinline__ void load_floats(const T* src, float (&out)[N]) {
  if constexpr (kWholeVectors<N, T>) {
    uint32_t words[N / kPerWord<T>];
#pragma unroll
    for (int v = 0; v < N * sizeof(T) / 16; ++v) {
      const uint4 vec = reinterpret_cast<const uint4*>(src)[v];
      words[4 * v] = vec.x;
      words[4 * v + 1] = vec.y;
      words[4 * v + 2] = vec.z;
      words[4 * v + 3] = vec.w;
    }
    unpack_words<T>(words, out);
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = to_float(src[i]);
  }
}

template <int N, typename T>
__device__ __forceinline__ void store_floats(T* dst, const float (&in)[N]) {
  if constexpr (kWholeVectors<N, T>) {
    uint32_t words[N / kPerWord<T>];
    pack_words<T>(in, words);
#pragma unroll
    for (int v = 0; v < N * sizeof(T) / 16; ++v)
      store_global_16(reinterpret_cast<uint4*>(dst) + v,
                      make_uint4(words[4 * v], words[4 * v + 1], words[4 * v + 2], words[4 * v + 3]));
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) dst[i] = from_float<T>(in[i]);
  }
}

// load_floats for an activation tensor whose dtype (BF16, FP16 or FP32, validated on the host)
// is a launch argument: N elements starting `offset` elements after `base`.
template <int N>
__device__ __forceinline__ void load_floats(const void* base, DType dtype, int64_t offset,
                                            float (&out)[N]) {
  switch (dtype) {
    case DType::kBFloat16: return load_floats<N>(static_cast<const bf16*>(base) + offset, out);
    case DType::kFloat16: return load_floats<N>(static_cast<const __half*>(base) + offset, out);
    default: return load_floats<N>(static_cast<const float*>(base) + offset, out);  // kFloat32
  }
}

}  // namespace speedmla::kernels
