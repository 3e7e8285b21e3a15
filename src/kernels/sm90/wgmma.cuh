// wgmma calls with the accumulator as an array. CuTe's arch structs spell every accumulator
// register as its own argument; these helpers expand an array into that list at compile time,
// so the registers stay registers (indices are constants).
#pragma once

#include <cute/arch/mma_sm90_gmma.hpp>

#include <cstdint>
#include <utility>

namespace speedmla::kernels::sm90 {

namespace gmma = cute::SM90::GMMA;

// Marks the start of a batch of wgmma instructions (orders earlier register writes before them).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
// Waits until at most kPending committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(kPending) : "memory");
}

// Stops the compiler from moving reads or writes of accumulator registers across a wgmma wait:
// to the compiler the asm below reads and writes each register.
template <int N>
__device__ __forceinline__ void fence_registers(float (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(regs[i])::"memory");
}
template <int N>
__device__ __forceinline__ void fence_registers(uint32_t (&regs)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+r"(regs[i])::"memory");
}

namespace detail {
template <typename Mma, int N, size_t... I>
__device__ __forceinline__ void mma_ss(uint64_t a, uint64_t b, float (&d)[N], bool accumulate,
                                       std::index_sequence<I...>) {
  Mma::fma(a, b, d[I]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
template <typename Mma, int N, size_t... I>
__device__ __forceinline__ void mma_rs(const uint32_t* a, uint64_t b, float (&d)[N], bool accumulate,
                                       std::index_sequence<I...>) {
  Mma::fma(a[0], a[1], a[2], a[3], b, d[I]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
}  // namespace detail

// D (+)= A·B with A and B in shared memory (descriptors).
template <typename Mma, int N>
__device__ __forceinline__ void mma_ss(uint64_t desc_a, uint64_t desc_b, float (&d)[N], bool accumulate) {
  detail::mma_ss<Mma>(desc_a, desc_b, d, accumulate, std::make_index_sequence<N>{});
}
// D (+)= A·B with A in registers (four 32-bit fragment registers) and B in shared memory.
template <typename Mma, int N>
__device__ __forceinline__ void mma_rs(const uint32_t* a, uint64_t desc_b, float (&d)[N], bool accumulate) {
  detail::mma_rs<Mma>(a, desc_b, d, accumulate, std::make_index_sequence<N>{});
}

}  // namespace speedmla::kernels::sm90
