// The SM90 MLA decode kernel: a warp-specialised, split-KV flash-decoding kernel.
//
// Grid: (row tiles, parts). A CTA computes kTileRows query rows of a request against a run of
// KV blocks given by the split-KV plan (plan.cuh), possibly covering several requests.
//
//   warpgroup 0 (producer)  TMA loads of whole cache rows (page by page) into a ring of K
//                           stages. FP8: all four warps also transpose value dims 0..255 of each
//                           block into a K-major V^T buffer (FP8 wgmma reads both operands
//                           K-major only), writing zeros for tokens past seq_len.
//   warpgroup 1 (scores)    S = Q·K^T (wgmma, both from shared memory), online softmax in base
//                           2, P kept in registers as the A operand of O[:, 0:256] += P·V. P
//                           and the per-row rescale factors go to warpgroup 2 through shared
//                           memory.
//   warpgroup 2 (values)    O[:, 256:512] += P·V for the same blocks. FP8: it transposes value
//                           dims 256..511 itself while it waits for P (it has the idle time;
//                           the producer alone could not keep up).
// Rows past seq_len in a sequence's last block hold whatever the cache holds there (NaN
// included) and 0 * NaN would leak into P·V: FP8 zeroes them in V^T, BF16 consumers zero their
// half of those value rows before their P·V.
//
// Synchronisation: mbarriers throughout — producer -> consumer data (full, vready), consumer ->
// producer buffer release (kfree, vfree), and the P hand-over from warp w of the scores
// warpgroup to warp w of the values warpgroup (they own the same 16 rows): pfull[w], pfree[w].
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/wgmma.cuh"

namespace speedmla::kernels::decode_sm90 {

struct Fp8Traits {
  static constexpr bool kFp8 = true;
  static constexpr int kElemBytes = 1;
  static constexpr int kKStages = 3;
  static constexpr int kVtStages = 2;
  static constexpr sm90::SmemLayout kSwizzle = sm90::SmemLayout::kSwizzle64B;
  static constexpr int kMmaK = 32;  // K of one wgmma, in elements (32 bytes)
  // P in [0, 256] instead of [0, 1] before the FP8 conversion: small probabilities stay normal
  // numbers (e4m3 subnormals start at 2^-6). It cancels in out = (P·V) / sum(P).
  static constexpr float kProbabilityLog2Bias = 8.f;
  using ScoreMma = sm90::gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
  using ValueMma = sm90::gmma::MMA_64x256x32_F32E4M3E4M3_RS_TN<>;
};

struct Bf16Traits {
  static constexpr bool kFp8 = false;
  static constexpr int kElemBytes = 2;
  static constexpr int kKStages = 2;
  static constexpr int kVtStages = 0;
  static constexpr sm90::SmemLayout kSwizzle = sm90::SmemLayout::kSwizzle128B;
  static constexpr int kMmaK = 16;
  static constexpr float kProbabilityLog2Bias = 0.f;
  using ScoreMma = sm90::gmma::MMA_64x64x16_F32BF16BF16_SS<sm90::gmma::Major::K, sm90::gmma::Major::K>;
  // V is read straight from the cache rows: N (value dims) is the contiguous dimension.
  using ValueMma = sm90::gmma::MMA_64x256x16_F32BF16BF16_RS<sm90::gmma::Major::K, sm90::gmma::Major::MN>;
};

template <typename Traits>
struct DecodeKernel {
  static constexpr int kE = Traits::kElemBytes;
  static constexpr int kChunkRowBytes = kChunkDims * kE;          // one swizzle row
  static constexpr int kChunkBytes = kBlockTokens * kChunkRowBytes;  // a 64-row chunk
  static constexpr int kTileBytes = kNumChunks * kChunkBytes;      // Q tile or one K stage
  static constexpr int kRowGroupBytes = 8 * kChunkRowBytes;        // wgmma stride-dim offset
  static constexpr int kStepsPerChunk = kChunkDims / Traits::kMmaK;
  static constexpr int kValueSteps = kBlockTokens / Traits::kMmaK;  // K steps of P·V per block
  static constexpr int kPRegs = 4 * kValueSteps;                    // P fragment registers
  static constexpr int kQPiecesPerRow = kRowDim * kE / 16;           // 16-byte pieces of a row
  static constexpr int kPiecesPerChunkRow = kChunkRowBytes / 16;

  // FP8 V^T: 512 value rows x 64 token positions, no swizzle. Core matrices (8 rows x 16 B) are
  // placed at kVtCoreStride along K and kVtGroupStride along rows. The odd strides (not 128 and
  // 512) spread the transposer's 4-byte stores over all 32 banks.
  static constexpr int kVtCoreStride = 144;
  static constexpr int kVtGroupStride = 592;
  static constexpr int kVtStageBytes = Traits::kFp8 ? (kLatentDim / 8) * kVtGroupStride : 0;

  static constexpr int kKStages = Traits::kKStages;
  static constexpr int kVtStages = Traits::kVtStages;
  // FP8: value-ready/free barriers per V^T stage. BF16 reads values from the K stage.
  static constexpr int kVBarriers = kVtStages;

  // Shared memory map, offsets from a 1024-byte aligned base (swizzle atoms need it).
  static constexpr int kQOffset = 0;
  static constexpr int kKOffset = kQOffset + kTileBytes;
  static constexpr int kVtOffset = kKOffset + kKStages * kTileBytes;
  static constexpr int kPOffset = kVtOffset + kVtStages * kVtStageBytes;
  static constexpr int kPBytes = kTileRows * kBlockTokens * kE;
  static constexpr int kRowScaleOffset = kPOffset + kPBytes;
  static constexpr int kBarrierOffset = kRowScaleOffset + kTileRows * 4;
  static constexpr int kNumBarriers = 2 * kKStages + 2 * kVBarriers + 2 * 4;
  static constexpr int kSmemBytes = kBarrierOffset + kNumBarriers * 8 + 1024;  // + alignment slack

  // Named barriers inside one consumer warpgroup (0 is __syncthreads).
  static constexpr uint32_t kBarScoresWg = 1, kBarValuesWg = 2;

  // Register budgets after setmaxnreg. They must add up to what the CTA was given at launch
  // (168 per thread, 128 * 504 in all): increases are served only from what other warps of
  // the CTA released, so asking for more waits forever. Both consumers hold a 64x256 FP32
  // accumulator (128 registers) and P; the scores warpgroup also the 64x64 scores and the
  // softmax state.
  static constexpr int kProducerRegs = 56;
  static constexpr int kScoresRegs = 240;
  static constexpr int kValuesRegs = 208;
  static_assert(kProducerRegs + kScoresRegs + kValuesRegs == 3 * 168);

  struct Smem {
    uint8_t* q;
    uint8_t* k;
    uint8_t* vt;
    uint4* p_exchange;
    float* row_scale;
    uint64_t* full;    // [kKStages]   TMA bytes landed
    uint64_t* kfree;   // [kKStages]   K stage may be overwritten
    uint64_t* vready;  // [kVBarriers] FP8: V^T written
    uint64_t* vfree;   // [kVBarriers] FP8: V^T stage may be overwritten
    uint64_t* pfull;   // [4] per warp pair: a message (P or the final normalisers) is written
    uint64_t* pfree;   // [4] per warp pair: the message was read
  };

  static __device__ Smem carve(uint8_t* raw) {
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    Smem s;
    s.q = base + kQOffset;
    s.k = base + kKOffset;
    s.vt = base + kVtOffset;
    s.p_exchange = reinterpret_cast<uint4*>(base + kPOffset);
    s.row_scale = reinterpret_cast<float*>(base + kRowScaleOffset);
    s.full = reinterpret_cast<uint64_t*>(base + kBarrierOffset);
    s.kfree = s.full + kKStages;
    s.vready = s.kfree + kKStages;
    s.vfree = s.vready + kVBarriers;
    s.pfull = s.vfree + kVBarriers;
    s.pfree = s.pfull + 4;
    return s;
  }

  static __device__ void init_barriers(const Smem& s) {
    for (int i = 0; i < kKStages; ++i) {
      sm90::mbarrier_init(&s.full[i], 1);
      // Readers of a K stage, one arrival per warp. FP8: scores (4) + the two transposing
      // warpgroups (4 + 4). BF16: the two consumers after their P·V (4 + 4).
      sm90::mbarrier_init(&s.kfree[i], Traits::kFp8 ? 12 : 8);
    }
    for (int i = 0; i < kVBarriers; ++i) {
      sm90::mbarrier_init(&s.vready[i], 4);
      sm90::mbarrier_init(&s.vfree[i], 4);  // the scores warpgroup's P·V of the left half
    }
    // Every lane of the sending (reading) warp arrives: each orders its own shared-memory
    // accesses before the partner's, with no reliance on warp-synchronous cumulativity.
    for (int w = 0; w < 4; ++w) {
      sm90::mbarrier_init(&s.pfull[w], 32);
      sm90::mbarrier_init(&s.pfree[w], 32);
    }
    sm90::fence_barrier_init();
  }

  static __device__ int valid_tokens_in_block(int seq_len, int block) {
    return min(kBlockTokens, seq_len - block * kBlockTokens);
  }

  // ---------------------------------------------------------------------------------------
  // Producer: TMA loads
  // ---------------------------------------------------------------------------------------

  // Issues the loads of one 64-token block into K stage `stage`: every page that holds a
  // token below seq_len, all 9 column chunks of each.
  static __device__ void load_block(const DecodeParams& p, const CUtensorMap* kv_map, const Smem& s,
                                    int stage, const PartPiece& piece, int block, int seq_len) {
    const int first_token = block * kBlockTokens;
    const int valid = valid_tokens_in_block(seq_len, block);
    const int box_tokens = min(p.page_size, kBlockTokens);
    const int boxes = (valid + box_tokens - 1) / box_tokens;
    const int32_t* table = p.block_table + piece.request * p.block_table_stride;
    const int in_page = first_token & (p.page_size - 1);  // non-zero only for pages of 128
    sm90::mbarrier_arrive_expect_tx(&s.full[stage], boxes * box_tokens * kRowDim * kE);
    uint8_t* dst = s.k + stage * kTileBytes;
    for (int box = 0; box < boxes; ++box) {
      const int page = table[(first_token >> p.page_shift) + box];
#pragma unroll
      for (int c = 0; c < kNumChunks; ++c)
        sm90::tma_load_3d(dst + c * kChunkBytes + box * box_tokens * kChunkRowBytes, kv_map,
                          &s.full[stage], c * kChunkDims, in_page, page);
    }
  }

  // Keeps up to kKStages blocks in flight ahead of the consumers.
  static __device__ void issue_loads_until(const DecodeParams& p, const CUtensorMap* kv_map, const Smem& s,
                                           BlockCursor& cursor, int& issued, int limit) {
    for (; cursor.valid() && issued < limit; cursor.advance(), ++issued) {
      const int stage = issued % kKStages;
      sm90::mbarrier_wait(&s.kfree[stage], ((issued / kKStages) & 1) ^ 1);
      load_block(p, kv_map, s, stage, cursor.piece(), cursor.block(), p.seq_lens[cursor.piece().request]);
    }
  }

  // ---------------------------------------------------------------------------------------
  // Producer: FP8 V transpose. Lane roles: gpar = lane & 1, q = (lane >> 1) & 3, cc = lane >> 3.
  // A thread reads 4 tokens x 16 value dims (16-byte loads) and writes 16 dims x 4 token
  // positions (4-byte stores). Token positions follow the order of the P fragment in registers
  // (see pack_probabilities), so P never has to move between threads:
  // position 4q + 2a + b within a 16-token group holds token 8a + 2q + b.
  // ---------------------------------------------------------------------------------------
  // Transposes one half of the block's values: half 0 = dims 0..255, half 1 = 256..511, four
  // warps of a warpgroup sharing the work.
  static __device__ void transpose_values(uint32_t k_stage, uint32_t vt_stage, int valid, int half, int warp,
                                          int lane) {
    const int gpar = lane & 1, q = (lane >> 1) & 3, cc = lane >> 3;
    // Odd-gpar lanes load their token pairs in swapped order (bank spread); their byte
    // selectors swap them back.
    const uint32_t select_low = gpar ? 0x1504u : 0x5140u;
    const uint32_t select_high = gpar ? 0x3726u : 0x7362u;
#pragma unroll
    for (int unit = 0; unit < 2; ++unit) {
      const int u = 8 * half + warp + 4 * unit;  // 16 units per block: 2 token halves x 8 column chunks
      const int g = 2 * (u & 1) + gpar, chunk = u >> 1;
      uint4 in[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int kk = k ^ gpar;
        const int token = 16 * g + ((kk & 2) ? 8 : 0) + 2 * q + (kk & 1);
        // 64-byte swizzle: piece cc of row `token` sits at cc ^ ((token >> 1) & 3) = cc ^ q.
        in[k] = token < valid ? sm90::ld_shared_v4(k_stage + chunk * kChunkBytes + token * kChunkRowBytes + ((cc ^ q) << 4))
                              : make_uint4(0u, 0u, 0u, 0u);
      }
      const uint32_t* w0 = reinterpret_cast<const uint32_t*>(&in[0]);
      const uint32_t* w1 = reinterpret_cast<const uint32_t*>(&in[1]);
      const uint32_t* w2 = reinterpret_cast<const uint32_t*>(&in[2]);
      const uint32_t* w3 = reinterpret_cast<const uint32_t*>(&in[3]);
#pragma unroll
      for (int dw = 0; dw < 4; ++dw) {
        const uint32_t x = sm90::byte_perm(w0[dw], w1[dw], select_low);
        const uint32_t y = sm90::byte_perm(w0[dw], w1[dw], select_high);
        const uint32_t z = sm90::byte_perm(w2[dw], w3[dw], select_low);
        const uint32_t v = sm90::byte_perm(w2[dw], w3[dw], select_high);
        const uint32_t out[4] = {sm90::byte_perm(x, z, 0x5410u), sm90::byte_perm(x, z, 0x7632u),
                                 sm90::byte_perm(y, v, 0x5410u), sm90::byte_perm(y, v, 0x7632u)};
#pragma unroll
        for (int bi = 0; bi < 4; ++bi) {
          const int dim = chunk * kChunkDims + 16 * cc + 4 * dw + bi;
          sm90::st_shared_u32(vt_stage + (dim >> 3) * kVtGroupStride + g * kVtCoreStride + (dim & 7) * 16 + 4 * q,
                              out[bi]);
        }
      }
    }
  }

  static __device__ void producer_fp8(const DecodeParams& p, const CUtensorMap* kv_map, const Smem& s, int part) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    BlockCursor load_cursor(p, part);
    int issued = 0;
    int j = 0;
    for (BlockCursor cursor(p, part); cursor.valid(); cursor.advance(), ++j) {
      if (warp == 0 && lane == 0) issue_loads_until(p, kv_map, s, load_cursor, issued, j + kKStages);
      __syncwarp();
      const int stage = j % kKStages, vstage = j % kVtStages;
      sm90::mbarrier_wait(&s.full[stage], (j / kKStages) & 1);
      sm90::mbarrier_wait(&s.vfree[vstage], ((j / kVtStages) & 1) ^ 1);
      const int valid = valid_tokens_in_block(p.seq_lens[cursor.piece().request], cursor.block());
      transpose_values(sm90::smem_u32(s.k + stage * kTileBytes), sm90::smem_u32(s.vt + vstage * kVtStageBytes), valid,
                       0, warp, lane);
      sm90::fence_proxy_async_smem();
      __syncwarp();
      if (lane == 0) {
        sm90::mbarrier_arrive(&s.vready[vstage]);
        sm90::mbarrier_arrive(&s.kfree[stage]);
      }
    }
  }

  // BF16: one thread issues all loads; the other producer threads have nothing to do.
  static __device__ void producer_bf16(const DecodeParams& p, const CUtensorMap* kv_map, const Smem& s, int part) {
    if (threadIdx.x % kWarpgroupThreads == 0) {
      BlockCursor load_cursor(p, part);
      int issued = 0;
      issue_loads_until(p, kv_map, s, load_cursor, issued, 0x7fffffff);
    }
  }

  // ---------------------------------------------------------------------------------------
  // Consumers
  // ---------------------------------------------------------------------------------------

  // Rows of this thread in the tile: r0 and r0 + 8 (wgmma accumulator layout).
  struct RowInfo {
    int local[2];     // row within the tile
    bool valid[2];    // row < num_rows
    int token[2];     // query token t of the row
    int head[2];
  };

  static __device__ RowInfo row_info(const DecodeParams& p, int row_tile, int warp, int lane) {
    RowInfo r;
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      r.local[i] = 16 * warp + lane / 4 + 8 * i;
      const int row = row_tile * kTileRows + r.local[i];
      r.valid[i] = row < p.num_rows;
      r.token[i] = row / p.num_heads;
      r.head[i] = row % p.num_heads;
    }
    return r;
  }

  // Stages the query tile of `request` in the swizzled layout the score wgmma reads.
  static __device__ void load_query(const DecodeParams& p, const Smem& s, int request, int row_tile) {
    const int t = threadIdx.x % kWarpgroupThreads;
    const uint8_t* q = static_cast<const uint8_t*>(p.q);
    const uint32_t q_smem = sm90::smem_u32(s.q);
    for (int i = t; i < kTileRows * kQPiecesPerRow; i += kWarpgroupThreads) {
      const int r = i / kQPiecesPerRow, piece = i % kQPiecesPerRow;
      const int row = row_tile * kTileRows + r;
      uint4 value = make_uint4(0u, 0u, 0u, 0u);
      if (row < p.num_rows) {
        const int token = row / p.num_heads, head = row % p.num_heads;
        const int64_t element = request * p.q_stride_batch + token * p.q_stride_token + head * p.q_stride_head;
        value = __ldg(reinterpret_cast<const uint4*>(q + element * kE) + piece);
      }
      const int chunk = piece / kPiecesPerChunkRow, in_row = piece % kPiecesPerChunkRow;
      const int swizzle = Traits::kFp8 ? (r >> 1) & 3 : r & 7;
      sm90::st_shared_v4(q_smem + chunk * kChunkBytes + r * kChunkRowBytes + ((in_row ^ swizzle) << 4), value);
    }
    sm90::fence_proxy_async_smem();
  }

  static __device__ void zero(float (&acc)[128]) {
#pragma unroll
    for (int i = 0; i < 128; ++i) acc[i] = 0.f;
  }

  static __device__ void rescale(float (&acc)[128], float scale0, float scale1) {
    if (__all_sync(0xffffffffu, scale0 == 1.f && scale1 == 1.f)) return;  // common once maxima settle
#pragma unroll
    for (int i = 0; i < 32; ++i) {
      acc[4 * i + 0] *= scale0;
      acc[4 * i + 1] *= scale0;
      acc[4 * i + 2] *= scale1;
      acc[4 * i + 3] *= scale1;
    }
  }

  // S = Q·K^T for one K stage: 9 chunks x (64 / kMmaK) wgmma steps. The base descriptors pass
  // through an opaque move so the compiler derives each step's descriptor where it is used
  // instead of hoisting all 2 x 36 of them into registers for the whole loop.
  static __device__ void issue_scores(const Smem& s, int stage, float (&scores)[32]) {
    const uint64_t q_desc = sm90::opaque(sm90::make_smem_desc(s.q, 16, kRowGroupBytes, Traits::kSwizzle));
    const uint64_t k_desc =
        sm90::opaque(sm90::make_smem_desc(s.k + stage * kTileBytes, 16, kRowGroupBytes, Traits::kSwizzle));
#pragma unroll
    for (int c = 0; c < kNumChunks; ++c)
#pragma unroll
      for (int step = 0; step < kStepsPerChunk; ++step) {
        const uint32_t offset = c * kChunkBytes + step * 32;
        sm90::mma_ss<typename Traits::ScoreMma>(sm90::desc_advance(q_desc, offset), sm90::desc_advance(k_desc, offset),
                                                scores, c + step > 0);
      }
  }

  // O_half += P·V_half for block j. half 0 = value dims 0..255, half 1 = 256..511.
  static __device__ void issue_values(const Smem& s, int j, int half, const uint32_t (&probs)[kPRegs], float (&acc)[128]) {
    if constexpr (Traits::kFp8) {
      const uint8_t* vt = s.vt + (j % kVtStages) * kVtStageBytes + half * (kHalfValueDim / 8) * kVtGroupStride;
      const uint64_t desc = sm90::make_smem_desc(vt, kVtCoreStride, kVtGroupStride, sm90::SmemLayout::kInterleave);
#pragma unroll
      for (int step = 0; step < kValueSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step], sm90::desc_advance(desc, 2 * step * kVtCoreStride),
                                                acc, true);
    } else {
      // V rows are the cache rows of the K stage (MN-major): N runs along the 64-dim chunks
      // (leading offset: one chunk), K along tokens (stride offset: 8 rows).
      const uint8_t* v = s.k + (j % kKStages) * kTileBytes + half * (kHalfValueDim / kChunkDims) * kChunkBytes;
      const uint64_t desc = sm90::make_smem_desc(v, kChunkBytes, kRowGroupBytes, Traits::kSwizzle);
#pragma unroll
      for (int step = 0; step < kValueSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step],
                                                sm90::desc_advance(desc, step * Traits::kMmaK * kChunkRowBytes), acc, true);
    }
  }

  // Waits until the values of block j may be read by wgmma. FP8: the producer's transpose of
  // the left half (the values warpgroup transposes the right half itself). BF16: the block's K
  // stage has landed; the rows past seq_len of this warpgroup's value half are then zeroed.
  static __device__ void wait_values_ready(const Smem& s, int j, int valid, int half) {
    if constexpr (Traits::kFp8) {
      if (half == 0) sm90::mbarrier_wait(&s.vready[j % kVtStages], (j / kVtStages) & 1);
    } else {
      const int stage = j % kKStages;
      sm90::mbarrier_wait(&s.full[stage], (j / kKStages) & 1);
      if (valid < kBlockTokens) {
        // Score wgmmas may still read these rows of the stage (S(j) of the other half's
        // columns); they are masked, so either value is harmless there.
        const uint32_t values = sm90::smem_u32(s.k + stage * kTileBytes) + half * kValueChunks / 2 * kChunkBytes;
        const int pieces = (kBlockTokens - valid) * kPiecesPerChunkRow;
        for (int i = threadIdx.x % kWarpgroupThreads; i < kValueChunks / 2 * pieces; i += kWarpgroupThreads)
          sm90::st_shared_v4(values + (i / pieces) * kChunkBytes + valid * kChunkRowBytes + (i % pieces) * 16,
                             make_uint4(0u, 0u, 0u, 0u));
        sm90::fence_proxy_async_smem();
        sm90::named_barrier_sync(half == 0 ? kBarScoresWg : kBarValuesWg, kWarpgroupThreads);
      }
    }
  }

  // Releases block j's value buffer after the warpgroup's P·V (one arrival per warp). FP8:
  // the left half of V^T (the right half belongs to the values warpgroup alone). BF16: values
  // live in the K stage, so this is the consumer's release of the whole stage.
  static __device__ void release_values(const Smem& s, int j, int half) {
    if (threadIdx.x % 32 != 0) return;
    if constexpr (Traits::kFp8) {
      if (half == 0) sm90::mbarrier_arrive(&s.vfree[j % kVtStages]);
    } else {
      sm90::mbarrier_arrive(&s.kfree[j % kKStages]);
    }
  }

  // Probabilities of the accumulator layout -> A-operand fragments of the P·V wgmma.
  // BF16 (k16): the layouts coincide. FP8 (k32): a thread's four bytes of a k-group are the
  // tokens {2q, 2q+1, 8+2q, 9+2q} of two n8 accumulator blocks; the V^T positions are permuted
  // to match (transpose_values).
  static __device__ void pack_probabilities(const float (&pr)[32], uint32_t (&probs)[kPRegs]) {
    if constexpr (Traits::kFp8) {
#pragma unroll
      for (int step = 0; step < 2; ++step) {
        const float* f = &pr[16 * step];
        probs[4 * step + 0] = sm90::pack_fp8x4(f[0], f[1], f[4], f[5]);
        probs[4 * step + 1] = sm90::pack_fp8x4(f[2], f[3], f[6], f[7]);
        probs[4 * step + 2] = sm90::pack_fp8x4(f[8], f[9], f[12], f[13]);
        probs[4 * step + 3] = sm90::pack_fp8x4(f[10], f[11], f[14], f[15]);
      }
    } else {
#pragma unroll
      for (int step = 0; step < 4; ++step) {
        const float* f = &pr[8 * step];
        probs[4 * step + 0] = sm90::pack_bf16x2(f[0], f[1]);
        probs[4 * step + 1] = sm90::pack_bf16x2(f[2], f[3]);
        probs[4 * step + 2] = sm90::pack_bf16x2(f[4], f[5]);
        probs[4 * step + 3] = sm90::pack_bf16x2(f[6], f[7]);
      }
    }
  }

  // P hand-over slot of this thread: its fragment registers, 16 bytes at a time.
  static __device__ uint32_t exchange_slot(const Smem& s, int group) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    return sm90::smem_u32(s.p_exchange + (warp * (kPRegs / 4) + group) * 32 + lane);
  }

  // Writes this thread's half of the output rows: final BF16 (x output_scale) or an FP32
  // partial for the combine kernel.
  static __device__ void store_output(const DecodeParams& p, const PartPiece& piece, const RowInfo& rows,
                                      const float (&acc)[128], const float (&inv)[2], int half) {
    const int col0 = half * kHalfValueDim + 2 * (threadIdx.x % 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      if (!rows.valid[i]) continue;
      if (piece.slot < 0) {
        const float scale = inv[i] * p.output_scale;
        uint16_t* dst = p.out + piece.request * p.out_stride_batch + rows.token[i] * p.out_stride_token +
                        rows.head[i] * p.out_stride_head + col0;
#pragma unroll
        for (int n = 0; n < 32; ++n)
          *reinterpret_cast<uint32_t*>(dst + 8 * n) =
              sm90::pack_bf16x2(acc[4 * n + 2 * i] * scale, acc[4 * n + 2 * i + 1] * scale);
      } else {
        const int row = rows.token[i] * p.num_heads + rows.head[i];
        float* dst = p.partial_out + (static_cast<int64_t>(piece.slot) * p.num_rows + row) * kLatentDim + col0;
#pragma unroll
        for (int n = 0; n < 32; ++n)
          *reinterpret_cast<float2*>(dst + 8 * n) = make_float2(acc[4 * n + 2 * i] * inv[i], acc[4 * n + 2 * i + 1] * inv[i]);
      }
    }
  }

  // Online softmax (base 2) of one block's scores, in place: masks keys past each row's limit,
  // updates the running max and sum, and returns the factor that rescales earlier outputs.
  static __device__ void softmax_block(float (&scores)[32], float (&row_max)[2], float (&row_sum)[2],
                                       float (&row_rescale)[2], const int (&limit)[2], int block,
                                       float score_scale_log2) {
    constexpr float kBias = Traits::kProbabilityLog2Bias;
    const int quad_col = 2 * (threadIdx.x % 4);
    if ((block + 1) * kBlockTokens > min(limit[0], limit[1])) {
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = block * kBlockTokens + 8 * n + quad_col + e;
          if (token >= limit[0]) scores[4 * n + e] = -INFINITY;
          if (token >= limit[1]) scores[4 * n + 2 + e] = -INFINITY;
        }
    }
    float block_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 8; ++n) {
      block_max[0] = fmaxf(block_max[0], fmaxf(scores[4 * n], scores[4 * n + 1]));
      block_max[1] = fmaxf(block_max[1], fmaxf(scores[4 * n + 2], scores[4 * n + 3]));
    }
    float exponent_base[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffffu, block_max[i], 1));
      block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffffu, block_max[i], 2));
      const float new_max = fmaxf(row_max[i], block_max[i] * score_scale_log2);
      // A row that has seen no key yet keeps max -inf: nothing to rescale, exponents of -inf.
      row_rescale[i] = new_max == -INFINITY ? 1.f : sm90::fast_exp2(row_max[i] - new_max);
      exponent_base[i] = new_max == -INFINITY ? 0.f : new_max - kBias;
      row_max[i] = new_max;
      row_sum[i] *= row_rescale[i];
    }
#pragma unroll
    for (int n = 0; n < 8; ++n)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int i = e / 2;
        scores[4 * n + e] = sm90::fast_exp2(fmaf(scores[4 * n + e], score_scale_log2, -exponent_base[i]));
        row_sum[i] += scores[4 * n + e];
      }
  }

  static __device__ void scores_warpgroup(const DecodeParams& p, const Smem& s, int row_tile, int part) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const RowInfo rows = row_info(p, row_tile, warp, lane);
    constexpr float kBias = Traits::kProbabilityLog2Bias;
    float acc[128];
    float scores[32];
    uint32_t probs[kPRegs];
    int j = 0;        // block counter over the CTA's whole sequence
    int message = 0;  // messages sent to the partner warp of the values warpgroup

    // Hands P (or, after the last block, the final row normalisers) to the partner warp.
    auto send = [&](const float (&row_value)[2], bool with_probs) {
      sm90::mbarrier_wait(&s.pfree[warp], (message & 1) ^ 1);  // the previous message was read
      if (with_probs)
#pragma unroll
        for (int g = 0; g < kPRegs / 4; ++g)
          sm90::st_shared_v4(exchange_slot(s, g), make_uint4(probs[4 * g], probs[4 * g + 1], probs[4 * g + 2], probs[4 * g + 3]));
      if (lane % 4 == 0) {
        s.row_scale[rows.local[0]] = row_value[0];
        s.row_scale[rows.local[1]] = row_value[1];
      }
      sm90::mbarrier_arrive(&s.pfull[warp]);
      ++message;
    };
    // P·V of the block with counter `previous` into the left half, then its buffer is released.
    auto finish_values = [&](int previous, int previous_valid) {
      wait_values_ready(s, previous, previous_valid, 0);
      sm90::wgmma_fence();
      issue_values(s, previous, 0, probs, acc);
      sm90::wgmma_commit();
      sm90::wgmma_wait<0>();
      sm90::fence_registers(acc);
      release_values(s, previous, 0);
    };
    // Scores of block j: wait for its K stage and issue S = Q·K^T (not committed).
    auto issue_block_scores = [&](int j_block) {
      const int stage = j_block % kKStages;
      sm90::mbarrier_wait(&s.full[stage], (j_block / kKStages) & 1);
      sm90::wgmma_fence();
      issue_scores(s, stage, scores);
      sm90::wgmma_commit();
    };
    auto release_keys = [&](int j_block) {
      if constexpr (Traits::kFp8) {
        if (lane == 0) sm90::mbarrier_arrive(&s.kfree[j_block % kKStages]);  // V^T is separate
      }
    };

    for (PartWalker walker(p, part); walker.valid(); walker.next()) {
      const PartPiece piece = walker.piece();
      const int seq_len = p.seq_lens[piece.request];
      // Every warp is past the previous piece's score wgmmas before the query tile is replaced.
      sm90::named_barrier_sync(kBarScoresWg, kWarpgroupThreads);
      load_query(p, s, piece.request, row_tile);
      sm90::named_barrier_sync(kBarScoresWg, kWarpgroupThreads);

      // Keys visible to each row: k < seq_len - (q_len - 1) + t.
      const int limit[2] = {seq_len - p.q_len + 1 + rows.token[0], seq_len - p.q_len + 1 + rows.token[1]};
      float row_max[2] = {-INFINITY, -INFINITY};
      float row_sum[2] = {0.f, 0.f};
      float row_rescale[2];
      zero(acc);

      if (piece.block_begin < piece.block_end) {
        // First block: scores only.
        issue_block_scores(j);
        sm90::wgmma_wait<0>();
        sm90::fence_registers(scores);
        release_keys(j);
        softmax_block(scores, row_max, row_sum, row_rescale, limit, piece.block_begin, p.score_scale_log2);
        pack_probabilities(scores, probs);
        send(row_rescale, true);
        int previous_valid = valid_tokens_in_block(seq_len, piece.block_begin);
        ++j;
        // Steady state: the P·V of the previous block goes first so that its buffer is freed
        // as early as possible (the next loads wait for it: measured 10-15% faster than letting
        // the softmax overlap that P·V), then this block's scores.
        for (int block = piece.block_begin + 1; block < piece.block_end; ++block, ++j) {
          wait_values_ready(s, j - 1, previous_valid, 0);
          sm90::wgmma_fence();
          issue_values(s, j - 1, 0, probs, acc);
          sm90::wgmma_commit();
          issue_block_scores(j);
          sm90::wgmma_wait<1>();
          sm90::fence_registers(acc);
          release_values(s, j - 1, 0);
          sm90::wgmma_wait<0>();
          sm90::fence_registers(scores);
          release_keys(j);
          softmax_block(scores, row_max, row_sum, row_rescale, limit, block, p.score_scale_log2);
          rescale(acc, row_rescale[0], row_rescale[1]);
          pack_probabilities(scores, probs);
          send(row_rescale, true);
          previous_valid = valid_tokens_in_block(seq_len, block);
        }
        finish_values(j - 1, previous_valid);
      }

      // Normalisers and LSE (natural log). Invalid seq_len: NaN rows.
      float inv[2], lse[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        float sum = row_sum[i];
        sum += __shfl_xor_sync(0xffffffffu, sum, 1);
        sum += __shfl_xor_sync(0xffffffffu, sum, 2);
        if (piece.num_blocks < 0) {
          inv[i] = lse[i] = NAN;
        } else if (sum > 0.f) {
          inv[i] = 1.f / sum;
          lse[i] = (row_max[i] - kBias + __log2f(sum)) * 0.69314718055994530942f;
        } else {
          inv[i] = 0.f;
          lse[i] = -INFINITY;
        }
      }
      send(inv, false);
      store_output(p, piece, rows, acc, inv, 0);
      if (lane % 4 == 0) {
#pragma unroll
        for (int i = 0; i < 2; ++i) {
          if (!rows.valid[i]) continue;
          if (piece.slot >= 0) {
            p.partial_lse[static_cast<int64_t>(piece.slot) * p.num_rows + rows.token[i] * p.num_heads + rows.head[i]] = lse[i];
          } else if (p.lse != nullptr) {
            p.lse[piece.request * p.lse_stride_batch + rows.token[i] * p.lse_stride_token +
                  rows.head[i] * p.lse_stride_head] = lse[i];
          }
        }
      }
    }
  }

  static __device__ void values_warpgroup(const DecodeParams& p, const Smem& s, int row_tile, int part) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const RowInfo rows = row_info(p, row_tile, warp, lane);
    float acc[128];
    uint32_t probs[kPRegs];
    int j = 0;

    int message = 0;
    auto receive = [&](float (&row_value)[2], bool with_probs) {
      sm90::mbarrier_wait(&s.pfull[warp], message & 1);
      if (with_probs)
#pragma unroll
        for (int g = 0; g < kPRegs / 4; ++g) {
          const uint4 v = sm90::ld_shared_v4(exchange_slot(s, g));
          probs[4 * g] = v.x;
          probs[4 * g + 1] = v.y;
          probs[4 * g + 2] = v.z;
          probs[4 * g + 3] = v.w;
        }
      row_value[0] = s.row_scale[rows.local[0]];
      row_value[1] = s.row_scale[rows.local[1]];
      sm90::mbarrier_arrive(&s.pfree[warp]);
      ++message;
    };

    for (PartWalker walker(p, part); walker.valid(); walker.next()) {
      const PartPiece piece = walker.piece();
      const int seq_len = p.seq_lens[piece.request];
      zero(acc);
      for (int block = piece.block_begin; block < piece.block_end; ++block, ++j) {
        if constexpr (Traits::kFp8) {
          // This half of V^T is written and read by this warpgroup alone: its previous P·V on
          // the buffer has completed (waited below), so no barrier guards the buffer.
          const int stage = j % kKStages;
          sm90::mbarrier_wait(&s.full[stage], (j / kKStages) & 1);
          transpose_values(sm90::smem_u32(s.k + stage * kTileBytes),
                           sm90::smem_u32(s.vt + (j % kVtStages) * kVtStageBytes),
                           valid_tokens_in_block(seq_len, block), 1, warp, lane);
          sm90::fence_proxy_async_smem();
          __syncwarp();
          if (lane == 0) sm90::mbarrier_arrive(&s.kfree[stage]);
          sm90::named_barrier_sync(kBarValuesWg, kWarpgroupThreads);
        }
        float row_rescale[2];
        receive(row_rescale, true);
        rescale(acc, row_rescale[0], row_rescale[1]);
        wait_values_ready(s, j, valid_tokens_in_block(seq_len, block), 1);
        sm90::wgmma_fence();
        issue_values(s, j, 1, probs, acc);
        sm90::wgmma_commit();
        sm90::wgmma_wait<0>();
        sm90::fence_registers(acc);
        release_values(s, j, 1);
      }
      float inv[2];
      receive(inv, false);
      store_output(p, piece, rows, acc, inv, 1);
    }
  }
};

template <typename Traits>
__global__ void __launch_bounds__(kThreads, 1)
    decode_kernel(const __grid_constant__ CUtensorMap kv_map, const __grid_constant__ DecodeParams p) {
  using Kernel = DecodeKernel<Traits>;
  extern __shared__ uint8_t smem_raw[];
  const typename Kernel::Smem s = Kernel::carve(smem_raw);
  if (threadIdx.x == 0) Kernel::init_barriers(s);
  __syncthreads();

  const int row_tile = blockIdx.x, part = blockIdx.y;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    sm90::warpgroup_reg_dealloc<Kernel::kProducerRegs>();
    if constexpr (Traits::kFp8) Kernel::producer_fp8(p, &kv_map, s, part);
    else Kernel::producer_bf16(p, &kv_map, s, part);
  } else if (warpgroup == 1) {
    sm90::warpgroup_reg_alloc<Kernel::kScoresRegs>();
    Kernel::scores_warpgroup(p, s, row_tile, part);
  } else {
    sm90::warpgroup_reg_alloc<Kernel::kValuesRegs>();
    Kernel::values_warpgroup(p, s, row_tile, part);
  }
}

}  // namespace speedmla::kernels::decode_sm90
