// Thin wrappers over the Hopper (sm_90a) instructions the attention kernels use: mbarriers,
// TMA tensor loads, named barriers, proxy fences, register reallocation and wgmma descriptors.
// Each is one PTX instruction or a few; the wgmma MMA wrappers come from CuTe's arch headers.
#pragma once

#include <cstdint>

namespace speedmla::kernels::sm90 {

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// ---- thread index, read where it is used ----------------------------------------------------
// threadIdx.x as an opaque read: the compiler cannot hoist what is computed from it out of a loop,
// so per-lane addresses are rebuilt at each use instead of held in registers across the loop (the
// producer warps run with few registers).
__device__ __forceinline__ uint32_t thread_index_here() {
  uint32_t tid;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(tid));
  return tid;
}

// ---- global memory ----------------------------------------------------------------------
// One 16-byte store, kept whole: a plain uint4 store beside a 4-byte fallback path was merged by
// ptxas into four 4-byte stores on both paths.
__device__ __forceinline__ void st_global_v4(void* ptr, uint4 v) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// ---- shared memory through 32-bit shared-window addresses (pointers that travel through
// structs lose their address space and become slower generic accesses) ----------------------
__device__ __forceinline__ uint4 ld_shared_v4(uint32_t address) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}
__device__ __forceinline__ void st_shared_v4(uint32_t address, uint4 v) {
  asm volatile("st.shared.v4.u32 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}
__device__ __forceinline__ void st_shared_u8(uint32_t address, uint32_t v) {
  asm volatile("st.shared.u8 [%0], %1;" ::"r"(address), "r"(v) : "memory");
}
__device__ __forceinline__ float2 ld_shared_f32x2(uint32_t address) {
  float2 v;
  asm volatile("ld.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(address));
  return v;
}
__device__ __forceinline__ void st_shared_f32x2(uint32_t address, float2 v) {
  asm volatile("st.shared.v2.f32 [%0], {%1, %2};" ::"r"(address), "f"(v.x), "f"(v.y));
}
__device__ __forceinline__ float ld_shared_f32(uint32_t address) {
  float v;
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address));
  return v;
}
__device__ __forceinline__ void st_shared_f32(uint32_t address, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(address), "f"(v));
}

// 16 bytes from global to shared memory, asynchronously and through no register (cached in L2
// only). With src_bytes < 16 the rest of the 16 bytes are zeros (0: nothing is read).
__device__ __forceinline__ void cp_async_16(uint32_t address, const void* src, uint32_t src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(address), "l"(src), "r"(src_bytes) : "memory");
}
// Waits for all of this thread's cp_async_16 copies.
__device__ __forceinline__ void cp_async_wait_all() { asm volatile("cp.async.wait_all;" ::: "memory"); }

// Four 8x8 matrices of 16-bit elements: lanes 8i..8i+7 give the row addresses of matrix i
// (16 bytes each). Lane l receives, in register i, elements (l / 4, 2 (l % 4)) and
// (l / 4, 2 (l % 4) + 1) of matrix i (row, column; for 8-bit data: bytes 4 (l % 4) .. + 3 of
// row l / 4); transposed on the way (kTranspose), elements (2 (l % 4), l / 4) and
// (2 (l % 4) + 1, l / 4).
template <bool kTranspose>
__device__ __forceinline__ uint4 ldmatrix_x4(uint32_t address) {
  uint4 v;
  if constexpr (kTranspose)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}
// Four 8x8 matrices of 16-bit elements: lanes 8i..8i+7 give the row addresses of matrix i;
// lane l supplies, in register i, elements (l / 4, 2 (l % 4)) and (l / 4, 2 (l % 4) + 1).
__device__ __forceinline__ void stmatrix_x4(uint32_t address, uint4 v) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};" ::"r"(address), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w));
}

// ---- mbarrier -------------------------------------------------------------------------------
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(arrivals));
}
// Makes mbarrier initialisation visible to the async proxy (TMA) before first use.
__device__ __forceinline__ void fence_barrier_init() {
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbarrier_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.release.cta.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ void mbarrier_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.release.cta.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)),
               "r"(bytes) : "memory");
}
// Blocks until the phase with the given parity has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "wait_loop:\n"
      "mbarrier.try_wait.parity.acquire.cta.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra wait_loop;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// ---- TMA --------------------------------------------------------------------------------------
// Loads a 3-D box of the tensor described by `tensor_map` (a __grid_constant__ CUtensorMap) at
// coordinates (c0, c1, c2) into shared memory, completing `bytes` on `bar`.
__device__ __forceinline__ void tma_load_3d(void* smem_dst, const void* tensor_map, uint64_t* bar,
                                            int32_t c0, int32_t c1, int32_t c2) {
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%3, %4, %5}], [%2];" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1), "r"(c2)
      : "memory");
}

// ---- named barriers -------------------------------------------------------------------------
// id 0 is __syncthreads; callers use ids >= 1. `threads` counts every participant.
__device__ __forceinline__ void named_barrier_sync(uint32_t id, uint32_t threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// named_barrier_sync that also returns whether `pred` held in any participating thread: the
// same answer in all of them (a condition every warp of a warpgroup takes alike).
__device__ __forceinline__ bool named_barrier_or(uint32_t id, uint32_t threads, bool pred) {
  uint32_t any;
  asm volatile(
      "{\n .reg .pred p, q;\n setp.ne.u32 p, %1, 0;\n bar.red.or.pred q, %2, %3, p;\n selp.u32 %0, 1, 0, q;\n}"
      : "=r"(any)
      : "r"(static_cast<uint32_t>(pred)), "r"(id), "r"(threads)
      : "memory");
  return any != 0;
}
// Counts this thread towards the barrier without waiting for it (the producer side of a
// handshake whose other side calls named_barrier_sync with the same total).
__device__ __forceinline__ void named_barrier_arrive(uint32_t id, uint32_t threads) {
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Orders this thread's ordinary shared-memory writes before later reads by the async proxy
// (wgmma operands, TMA).
__device__ __forceinline__ void fence_proxy_async_smem() {
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// ---- register reallocation between warpgroups (needs a register cap at kernel entry) --------
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_alloc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void warpgroup_reg_dealloc() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(kRegs));
}

// ---- wgmma shared-memory matrix descriptors -------------------------------------------------
enum class SmemLayout : uint64_t { kInterleave = 0, kSwizzle128B = 1, kSwizzle64B = 2, kSwizzle32B = 3 };

// Bytes of one swizzle row of a layout (0: interleaved, no swizzle): what a TMA map writing the
// buffer must use (sm90::tma_swizzle_bytes), checked at compile time by the launchers.
constexpr int smem_swizzle_bytes(SmemLayout layout) {
  return layout == SmemLayout::kSwizzle128B ? 128
         : layout == SmemLayout::kSwizzle64B ? 64
         : layout == SmemLayout::kSwizzle32B ? 32
                                             : 0;
}

// Start address, leading- and stride-dimension byte offsets (all multiples of 16 bytes).
// For K-major swizzled layouts the leading offset is unused; the stride offset is the distance
// between groups of 8 rows. See the PTX ISA, "Matrix Descriptor Format".
__device__ __forceinline__ uint64_t make_smem_desc(const void* smem, uint32_t leading_bytes,
                                                   uint32_t stride_bytes, SmemLayout layout) {
  const uint64_t address = smem_u32(smem);
  return ((address & 0x3FFFF) >> 4) | (static_cast<uint64_t>(leading_bytes >> 4) << 16) |
         (static_cast<uint64_t>(stride_bytes >> 4) << 32) | (static_cast<uint64_t>(layout) << 62);
}
// Moves a descriptor's start address by `bytes` (a multiple of 16). The address field is the
// low 14 bits of the low word and shared-memory addresses stay below 2^18 bytes, so a 32-bit
// add on the low word suffices (half the instructions of a 64-bit add).
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  uint32_t lo, hi;
  asm("mov.b64 {%0, %1}, %2;" : "=r"(lo), "=r"(hi) : "l"(desc));
  lo += bytes >> 4;
  uint64_t result;
  asm("mov.b64 %0, {%1, %2};" : "=l"(result) : "r"(lo), "r"(hi));
  return result;
}

// ---- conversions ----------------------------------------------------------------------------
// Four floats to four FP8 e4m3 bytes (a in the lowest byte), round to nearest even, saturating.
__device__ __forceinline__ uint32_t pack_fp8x4(float a, float b, float c, float d) {
  uint16_t lo, hi;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(lo) : "f"(a), "f"(b));
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %2, %1;" : "=h"(hi) : "f"(c), "f"(d));
  return static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
}
// Two floats to a BF16 pair (a in the low half), round to nearest even.
__device__ __forceinline__ uint32_t pack_bf16x2(float a, float b) {
  uint32_t packed;
  asm("cvt.rn.bf16x2.f32 %0, %2, %1;" : "=r"(packed) : "f"(a), "f"(b));
  return packed;
}

// The four FP8 e4m3 numbers of a word, summed in pairs in FP16: (byte 0 + byte 2, byte 1 +
// byte 3) as an f16x2 word (byte 0's pair in the low half).
__device__ __forceinline__ uint32_t fp8x4_pair_sums(uint32_t packed) {
  uint32_t sums;
  asm("{\n\t.reg .b16 lo, hi;\n\t.reg .b32 a, b;\n\t"
      "mov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 a, lo;\n\tcvt.rn.f16x2.e4m3x2 b, hi;\n\t"
      "add.rn.f16x2 %0, a, b;\n\t}"
      : "=r"(sums) : "r"(packed));
  return sums;
}
__device__ __forceinline__ uint32_t add_f16x2(uint32_t a, uint32_t b) {
  uint32_t sum;
  asm("add.rn.f16x2 %0, %1, %2;" : "=r"(sum) : "r"(a), "r"(b));
  return sum;
}
// The two halves of an f16x2 word, summed in FP32.
__device__ __forceinline__ float f16x2_total(uint32_t pair) {
  float total;
  asm("{\n\t.reg .b16 lo, hi;\n\t.reg .f32 a, b;\n\t"
      "mov.b32 {lo, hi}, %1;\n\tcvt.f32.f16 a, lo;\n\tcvt.f32.f16 b, hi;\n\tadd.f32 %0, a, b;\n\t}"
      : "=f"(total) : "r"(pair));
  return total;
}

// 2^x with the hardware approximation (2 ulp), flushing denormal results to zero: exp2f adds
// range handling for denormals that softmax does not need.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// Byte permute: result byte i = byte selector_nibble_i of the 8-byte value {b, a}.
__device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t selector) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
  return r;
}

}  // namespace speedmla::kernels::sm90
