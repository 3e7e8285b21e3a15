// Tile constants of the SM90 decode kernel. One place, so the host-side workspace arithmetic
// and the kernel agree.
#pragma once

namespace speedmla::kernels::decode_sm90 {

// A CTA computes kTileRows query rows (flattened (token, head) pairs of one request) against
// the request's KV in blocks of kBlockTokens tokens. 64 is the wgmma M of the score GEMM and
// its N, and the K of the P·V GEMM.
inline constexpr int kTileRows = 64;
inline constexpr int kBlockTokens = 64;

// Cache rows and query rows are staged in shared memory as kNumChunks column chunks of
// kChunkDims features each, so that each chunk row is one swizzle row (64 BF16 = 128 B with the
// 128-byte swizzle, 64 FP8 = 64 B with the 64-byte swizzle) for both TMA and wgmma.
inline constexpr int kChunkDims = 64;

// Pages of fewer tokens than this are copied into the K stages with cp.async rather than loaded
// by TMA. TMA writes swizzled boxes only at swizzle-atom (8-row) boundaries, so pages below 8
// must be copied; larger ones are copied too where the copies beat TMA's small boxes. The copies
// take pages of up to two copy steps' rows (decode_kernel.cuh, LaneCopy: 16 FP8 rows, 8 BF16).
// B=128 s_k 8K on the H200, ms, TMA -> copied: BF16 page 8 H=16 0.454 -> 0.349, H=128 0.885 ->
// 0.578; FP8 page 16 H=16 0.232 -> 0.202, H=128 0.445 -> 0.369 (page 64: 0.325 / 0.501 BF16,
// 0.187 / 0.346 FP8). BF16 page 16 stays on TMA (0.593 at H=128, where page 1 copies take 0.60).
constexpr int min_tma_page_tokens(bool fp8) { return fp8 ? 32 : 16; }
// Query rows of the narrow FP8 kernel's tile (decode_narrow_kernel.cuh) for requests of `rows`
// query rows (H·q_len), or 0 where the request runs on the 64-row kernel: FP8 caches loaded by
// TMA, requests of at most 32 rows (H=16 q1 s_k 32K B=128: 0.614 ms against 0.662 on 64-row
// tiles; larger requests as 32-row tiles side by side took 1.6-1.8x as long, each tile reading
// the KV again; H200, 2026-12-02).
constexpr int narrow_tile_rows(bool fp8, int page_size, long long rows) {
  if (!fp8 || page_size < min_tma_page_tokens(true) || rows > 32) return 0;
  return rows <= 16 ? 16 : 32;
}
inline constexpr int kNumChunks = 9;        // 576 / 64
inline constexpr int kValueChunks = 8;      // the first 512 features are the values
inline constexpr int kLatentDim = 512;
inline constexpr int kRowDim = 576;
inline constexpr int kHalfValueDim = 256;   // each consumer warpgroup owns half of the output

// Three warpgroups: a producer (TMA loads) and two consumers, consumer c owning output
// columns 256c..256c+255 (decode_kernel.cuh says who scores which block).
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kThreads = 3 * kWarpgroupThreads;
// The consumer warps of either main kernel: each counts itself into a partial-result slot's
// writers once it has written its rows there (params.h, slot_writers).
inline constexpr int kSlotWriterWarps = 2 * kWarpgroupThreads / 32;

// Upper bound on split-KV parts per row tile (one CTA per SM; GPUs have far fewer SMs): it
// bounds the workspace whatever num_sms a caller passes.
inline constexpr int kMaxParts = 1024;

}  // namespace speedmla::kernels::decode_sm90
