// Element conversions on the device, bit-identical to speedmla/numeric.h on the host:
// widening (FP8 e4m3, BF16, FP16 -> float) is exact; narrowing rounds to nearest even, FP8
// saturates to ±448 (±inf too) and NaN stays NaN. FP8 pairs use cvt.rn.satfinite.e4m3x2.f32.
#pragma once

#include <cstdint>
#include <type_traits>

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

namespace speedmla::kernels {

using fp8_e4m3 = __nv_fp8_e4m3;
using bf16 = __nv_bfloat16;

// ---- one element ------------------------------------------------------------------------------
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(fp8_e4m3 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.__x, __NV_E4M3)));
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ bf16 from_float<bf16>(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ fp8_e4m3 from_float<fp8_e4m3>(float x) {
  fp8_e4m3 result;
  result.__x = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return result;
}

// ---- 32-bit words, as they lie in memory (element 0 in the low bits) ---------------------------
template <typename T>
inline constexpr int kPerWord = 4 / sizeof(T);  // elements of T in one 32-bit word

// out[kPerWord<T> * w + i] = element i of words[w], as float.
template <typename T, int kWords>
__device__ __forceinline__ void unpack_words(const uint32_t (&words)[kWords],
                                             float (&out)[kWords * kPerWord<T>]) {
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    const uint32_t word = words[w];
    if constexpr (std::is_same_v<T, float>) {
      out[w] = __uint_as_float(word);
    } else if constexpr (std::is_same_v<T, bf16>) {  // a BF16 is the top half of its float
      out[2 * w] = __uint_as_float(word << 16);
      out[2 * w + 1] = __uint_as_float(word & 0xFFFF0000u);
    } else if constexpr (std::is_same_v<T, __half>) {
      out[2 * w] = __half2float(__ushort_as_half(static_cast<unsigned short>(word)));
      out[2 * w + 1] = __half2float(__ushort_as_half(static_cast<unsigned short>(word >> 16)));
    } else {
      static_assert(std::is_same_v<T, fp8_e4m3>);
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const __half2_raw halves = __nv_cvt_fp8x2_to_halfraw2(
            static_cast<__nv_fp8x2_storage_t>(word >> (16 * pair)), __NV_E4M3);
        out[4 * w + 2 * pair] = __half2float(__ushort_as_half(halves.x));
        out[4 * w + 2 * pair + 1] = __half2float(__ushort_as_half(halves.y));
      }
    }
  }
}

// words[w] = the conversions of in[kPerWord<T> * w ...] to T, packed.
template <typename T, int kWords>
__device__ __forceinline__ void pack_words(const float (&in)[kWords * kPerWord<T>],
                                           uint32_t (&words)[kWords]) {
#pragma unroll
  for (int w = 0; w < kWords; ++w) {
    if constexpr (std::is_same_v<T, float>) {
      words[w] = __float_as_uint(in[w]);
    } else if constexpr (std::is_same_v<T, bf16>) {
      const __nv_bfloat162 pair = __floats2bfloat162_rn(in[2 * w], in[2 * w + 1]);  // low = first
      words[w] = *reinterpret_cast<const uint32_t*>(&pair);
    } else {
      static_assert(std::is_same_v<T, fp8_e4m3>);
      const auto lo = __nv_cvt_float2_to_fp8x2(make_float2(in[4 * w], in[4 * w + 1]),
                                               __NV_SATFINITE, __NV_E4M3);  // low byte = first
      const auto hi = __nv_cvt_float2_to_fp8x2(make_float2(in[4 * w + 2], in[4 * w + 3]),
                                               __NV_SATFINITE, __NV_E4M3);
      words[w] = static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
    }
  }
}

}  // namespace speedmla::kernels
