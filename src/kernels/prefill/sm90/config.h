// Tile constants of the SM90 prefill kernel, shared by the host launcher and the kernel.
#pragma once

namespace speedmla::kernels::prefill_sm90 {

// A CTA tile is kTileRows query tokens of one head; each of the two consumer warpgroups owns
// kConsumerRows of them (the wgmma M). Keys and values stream in blocks of kBlockKeys tokens
// (the score GEMM's N and the P·V GEMM's K): at 128, a consumer holds 64 score and 64 output
// registers per thread, leaving room for the P fragments of the block in flight.
inline constexpr int kTileRows = 128;
inline constexpr int kConsumerRows = 64;
inline constexpr int kBlockKeys = 128;
// A persistent CTA's work item is a pair of a request's tiles of one head: tile i and tile
// T - 1 - i of its T. Under the causal mask their key blocks add up to the same count for every
// i, so equal-length requests give items of equal cost and plain striding balances the CTAs
// (single tiles in a cost-ordered walk left the busiest CTA 1.26x the mean at 16 x 1K and 1.69x
// at 1 x 16K with 16 heads: the walk's period aliased with the grid's).
inline constexpr int kPairRows = 2 * kTileRows;

inline constexpr int kQkDim = 192;  // 128 nope + 64 rope
inline constexpr int kVDim = 128;
// Q, K and V rows are staged as column chunks of kChunkDims features: one swizzle row each
// (BF16 128 bytes, SWIZZLE_128B; FP8 64 bytes, SWIZZLE_64B), the unit TMA writes and wgmma reads.
inline constexpr int kChunkDims = 64;
inline constexpr int kQkChunks = kQkDim / kChunkDims;  // 3
inline constexpr int kVChunks = kVDim / kChunkDims;    // 2

// A producer warpgroup (TMA loads; FP8: the V transposes) and two consumers.
inline constexpr int kWarpgroupThreads = 128;
inline constexpr int kThreads = 3 * kWarpgroupThreads;

}  // namespace speedmla::kernels::prefill_sm90
