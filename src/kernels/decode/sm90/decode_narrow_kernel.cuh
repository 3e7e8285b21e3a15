// The SM90 FP8 decode kernel for requests of few query rows (H·q_len <= kRows, kRows = 16 or
// 32: a tensor-parallel rank of DeepSeek's 128 heads at q_len 1-2), where decode_kernel.cuh's
// 64-row tiles are three quarters padding and its per-block pipeline, not the DRAM, bounds the
// time (the same ~1.35 us a 64-token block at H = 16 as at H = 128, whose two row tiles share
// the KV through L2). It computes the transposed problem so that the query rows are the wgmma's
// N (16 or 32) instead of its M (64):
//
//   S^T = K·Q^T       wgmma m64 x kRows x 32, both operands in shared memory: A = the K stage
//                     (64 tokens x 576, K-major), B = the query tile (kRows x 576, K-major).
//   softmax           per query column over the block's 64 tokens (4 warps x 16 tokens).
//   O^T += V^T·P^T    wgmma m64 x kRows x 32, A = V^T in REGISTERS, built straight from the K
//                     stage by ldmatrix.trans and byte permutes (no V^T buffer, no stmatrix, no
//                     second read of V^T), B = P^T in shared memory (1 KB a block at 16 rows).
//
// Warpgroups: the producer (decode_producer.cuh, TMA pages) and two consumers that take a
// piece's blocks in turns (block b of the piece to consumer b % 2), each with its own
// softmax state and O^T over all 512 value dims: no hand-off between them within a piece. At a
// piece's end the two states meet in shared memory and are merged (the LSE merge) into the
// piece's output (merge_and_store).
//
// Orders the wgmma operands impose, and what they make of the output's layout:
// - V^T's A fragment: lane l holds rows l/4 and l/4 + 8 of its warp's 16, K positions
//   4(l%4)..+3 (+16). ldmatrix.trans of tokens 0-7 / 8-15 / 16-23 / 24-31 of a 32-token step,
//   one 16-byte piece (16 dims) of a swizzled cache row, gives lane l the dim pair
//   (2(l/4), 2(l/4) + 1) of tokens (2k, 2k + 1) of each matrix, k = l % 4; the permutes make one
//   register per dim of the four tokens (2k, 2k+1, 8+2k, 9+2k): A row r of warp w's 16 is dim
//   16w + 2r and row r + 8 is dim 16w + 2r + 1 of the M tile's 64 (chunk i: dims 64i..64i+63),
//   and K position 4k + 2a + b of each 16-token group is token 8a + 2k + b (fp8_transpose.cuh
//   derives the same).
// - P^T (B, K-major, no swizzle): core matrices of 8 query rows x 16 K positions, kPtCoreStride
//   bytes apart along K and kPtGroupStride along the rows; warp w's 16 tokens of S^T are K group
//   w of the block, in the position order above.
// - O^T accumulator register 4j + 2h + e of M tile i: dim 64i + 16w + 2(l/4) + h, query row
//   8j + 2(l%4) + e: the two h registers are adjacent dims, stored as one pair.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/decode_producer.cuh"
#include "kernels/decode/sm90/fp8_format.cuh"
#include "kernels/decode/sm90/output_rows.cuh"
#include "kernels/decode/sm90/params.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/decode/sm90/query_tile.cuh"
#include "kernels/decode/sm90/slot_handover.cuh"
#include "kernels/sm90/attention/accumulator.cuh"
#include "kernels/sm90/attention/online_softmax.cuh"
#include "kernels/sm90/dependent_launch.cuh"
#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/swizzle.cuh"
#include "kernels/sm90/tensor_map.h"
#include "kernels/sm90/wgmma.cuh"

namespace speedmla::kernels::decode_sm90 {

template <int kRows>
struct NarrowFp8Traits : Fp8Format {
  static_assert(kRows == 16 || kRows == 32, "query rows a narrow tile holds");
  // No V^T buffers: the stages take the shared memory (180 / 144 KB at 16 / 32 rows, beside the
  // query tile and the ~34 KB merge staging area).
  static constexpr int kKStages = kRows == 16 ? 5 : 4;
  static constexpr int kLoadParts = 1;
  using ScoreMma = std::conditional_t<kRows == 16, sm90::gmma::MMA_64x16x32_F32E4M3E4M3_SS_TN<>,
                                      sm90::gmma::MMA_64x32x32_F32E4M3E4M3_SS_TN<>>;
  using ValueMma = std::conditional_t<kRows == 16, sm90::gmma::MMA_64x16x32_F32E4M3E4M3_RS_TN<>,
                                      sm90::gmma::MMA_64x32x32_F32E4M3E4M3_RS_TN<>>;
};

template <int kRows>
struct NarrowDecodeKernel {
  using Traits = NarrowFp8Traits<kRows>;
  using Producer = DecodeProducer<Traits, KvLoad::kTmaPages>;
  static constexpr int kKStages = Traits::kKStages;
  static constexpr int kChunkRowBytes = Producer::kChunkRowBytes;  // 64: one swizzle row
  static constexpr int kChunkBytes = Producer::kChunkBytes;        // 64 tokens of one chunk
  static constexpr int kTileBytes = Producer::kTileBytes;          // one K stage
  static constexpr int kQChunkBytes = kRows * kChunkRowBytes;      // kRows rows of one chunk
  static constexpr int kQBytes = kNumChunks * kQChunkBytes;
  static constexpr int kRowGroupBytes = 8 * kChunkRowBytes;        // swizzle atom: 8 rows
  static constexpr int kStepsPerChunk = kChunkDims / 32;           // K = 32 bytes a wgmma

  static constexpr int kScoreRegs = kRows / 2;   // S^T: 64 x kRows over 128 threads
  static constexpr int kColumns = kRows / 4;     // query columns of a thread: 2 per 8
  static constexpr int kMTiles = kLatentDim / 64;  // O^T: 8 tiles of 64 dims
  static constexpr int kValueSteps = kBlockTokens / 32;
  // The consumers' O^T meet in kMergeRounds rounds of kMergeTiles M tiles (merge_and_store):
  // each round both stage their weighted tiles as rows of kStageStride floats (8 past the
  // tiles' dims: the eight (row, dim pair) stores of a warp then fall in distinct bank halves).
  static constexpr int kMergeTiles = kRows == 32 ? 2 : 4;
  static constexpr int kMergeRounds = kMTiles / kMergeTiles;
  static_assert(kMergeRounds % 2 == 0, "merge_and_store's barrier parities assume an even round count");
  static constexpr int kStageStride = kMergeTiles * 64 + 8;
  // The V^T fragments of a block take 64 registers; beside the 128 of O^T at 32 rows they do not
  // fit (halves of 32 spilled 108 bytes): there the block's O^T runs in four parts of two M
  // tiles, each part's fragments loaded once the previous part's wgmmas have read theirs.
  static constexpr int kFragParts = kRows == 32 ? 4 : 1;
  static constexpr int kFragTiles = kMTiles / kFragParts;

  // P^T: core matrices of 8 rows x 16 bytes; four K groups (64 tokens) a row group.
  static constexpr int kPtCoreStride = 128;
  static constexpr int kPtGroupStride = 4 * kPtCoreStride;
  static constexpr int kPtBytes = (kRows / 8) * kPtGroupStride;

  struct alignas(1024) SharedLayout {
    uint8_t k[kKStages][kTileBytes];
    uint8_t q[kQBytes];
    uint8_t pt[2][kPtBytes];                    // per consumer
    alignas(16) float stage[2][kRows][kStageStride];  // per consumer: a round's weighted O tiles, row-major
    float merge_max[2][kRows];                  // per consumer: its column maxima
    float warp_max[2][4][kRows];                // per consumer and warp: a block's column maxima
    float warp_sums[2][2][4][kRows];            // per consumer, sum kind (exact, weights), warp
    uint64_t full[kKStages];
    uint64_t kfree[kKStages];
    uint64_t merge_sums;  // both consumers' sums and maxima of the piece are in shared memory
    uint64_t staged;      // both consumers' tiles of a merge round are staged
    uint64_t copied;      // the round's stores have read the staged tiles
  };
  static_assert(offsetof(SharedLayout, q) % 1024 == 0 && kQBytes % 512 == 0, "swizzle atoms");
  static constexpr int kSmemBytes = sizeof(SharedLayout) + 1024;
  static_assert(kSmemBytes <= 227 * 1024, "narrow decode kernel shared memory exceeds the SM90 limit");

  // Named barriers (0 is __syncthreads): one per consumer, one for both.
  static constexpr uint32_t kBarConsumer0 = 1, kBarConsumers = 3;
  static constexpr int kConsumerThreads = 2 * kWarpgroupThreads;
  // Consumers hold O^T (64 / 128 registers), the V^T fragments of a block (64) and the scores.
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = (3 * 168 - kProducerRegs) / 2;

  // Offsetting the __shared__ array itself keeps every access in the shared window (as the
  // prefill kernel's carve).
  static __device__ SharedLayout& carve(uint8_t* raw) {
    return *reinterpret_cast<SharedLayout*>(raw + ((1024u - (sm90::smem_u32(raw) & 1023u)) & 1023u));
  }

  // A stage is read by one consumer: released by its four warps. The merge's barriers take an
  // arrival from every consumer thread (each releases its own writes or reads).
  static __device__ void init_barriers(SharedLayout& s) {
    for (int i = 0; i < kKStages; ++i) {
      sm90::mbarrier_init(&s.full[i], Producer::kFullArrivals);
      sm90::mbarrier_init(&s.kfree[i], 4);
    }
    for (uint64_t* barrier : {&s.merge_sums, &s.staged, &s.copied}) sm90::mbarrier_init(barrier, kConsumerThreads);
    sm90::fence_barrier_init();
  }

  // The query rows of `request` (rows past num_rows zero) in the swizzled chunk layout the S^T
  // wgmma reads as its B operand; by both consumers. The thread index is read anew for each
  // piece: from threadIdx.x the compiler hoists the staging's per-thread offsets out of the piece
  // loop, and the 32-row consumer, with no register to hold them, spilled them.
  static __device__ void load_query(const DecodeParams& p, SharedLayout& s, int request) {
    uint32_t thread;
    asm volatile("mov.u32 %0, %%tid.x;" : "=r"(thread));
    stage_query_tile<kRows, 1, Traits::kSwizzle>(p, sm90::smem_u32(s.q), request, 0,
                                                 static_cast<int>(thread) - kWarpgroupThreads, kConsumerThreads);
  }

  // S^T(J) = K(J)·Q^T: 9 chunks x 2 steps.
  static __device__ void issue_scores(SharedLayout& s, int stage, float (&scores)[kScoreRegs]) {
    const uint64_t k_desc = sm90::make_smem_desc(s.k[stage], 16, kRowGroupBytes, Traits::kSwizzle);
    const uint64_t q_desc = sm90::make_smem_desc(s.q, 16, kRowGroupBytes, Traits::kSwizzle);
    sm90::wgmma_fence();
#pragma unroll
    for (int c = 0; c < kNumChunks; ++c)
#pragma unroll
      for (int step = 0; step < kStepsPerChunk; ++step)
        sm90::mma_ss<typename Traits::ScoreMma>(sm90::desc_advance(k_desc, c * kChunkBytes + step * 32),
                                                sm90::desc_advance(q_desc, c * kQChunkBytes + step * 32), scores,
                                                c + step > 0);
    sm90::wgmma_commit();
  }

  // The V^T A fragments of M tiles first_tile .. + kFragTiles - 1 (dims 64i..) of a block from
  // K stage `stage` (see the file comment): value step s (tokens 32s..), four registers each.
  // Tokens at or past `valid` read as zeros (the cache holds anything there, and 0 x NaN would
  // poison the sums).
  static __device__ void load_value_fragments(SharedLayout& s, int stage, int valid, int first_tile,
                                              uint32_t (&frag)[kFragTiles][kValueSteps][4]) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const uint32_t base = sm90::smem_u32(s.k[stage]);
    const int matrix = lane / 8, row = lane % 8;
    // Lanes 8m .. 8m + 7 address matrix m: tokens 8m .. 8m + 7 of the step; piece `warp` of the
    // 64-byte row, where the 64-byte swizzle puts piece p of row t at p ^ ((t >> 1) & 3).
    const int k = lane % 4;
#pragma unroll
    for (int step = 0; step < kValueSteps; ++step) {
      const int token = 32 * step + 8 * matrix + row;
      const uint32_t row_address = base + token * kChunkRowBytes + ((warp ^ ((token >> 1) & 3)) << 4);
      // Tokens of this lane's bytes in each 16-token group: 2k, 2k+1, 8+2k, 9+2k.
      uint32_t keep[2];
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const int first = 32 * step + 16 * g + 2 * k;
        keep[g] = (first < valid ? 0xffu : 0u) | (first + 1 < valid ? 0xff00u : 0u) |
                  (first + 8 < valid ? 0xff0000u : 0u) | (first + 9 < valid ? 0xff000000u : 0u);
      }
#pragma unroll
      for (int i = 0; i < kFragTiles; ++i) {
        const uint4 in = sm90::ldmatrix_x4<true>(row_address + (first_tile + i) * kChunkBytes);
        frag[i][step][0] = sm90::byte_perm(in.x, in.y, 0x6420u) & keep[0];
        frag[i][step][1] = sm90::byte_perm(in.x, in.y, 0x7531u) & keep[0];
        frag[i][step][2] = sm90::byte_perm(in.z, in.w, 0x6420u) & keep[1];
        frag[i][step][3] = sm90::byte_perm(in.z, in.w, 0x7531u) & keep[1];
      }
    }
  }

  // Query column c of this thread (c = 2j + e): row 8j + 2(l%4) + e of the tile.
  static __device__ int column_row(int c) { return 8 * (c / 2) + 2 * (threadIdx.x % 4) + c % 2; }

  // The consumer state of one piece.
  struct State {
    float max[kColumns];      // running max of each column (base 2, scaled); the same in all threads
    float exact[kColumns];    // this thread's share of the sums of P as computed (the LSE)
    float weights[kColumns];  // ... of P as rounded to e4m3 (the output's normaliser)
  };

  // One consumer warpgroup (me = 0 or 1): blocks b of each piece with b % 2 == me.
  static __device__ void consumer_warpgroup(const DecodeParams& p, SharedLayout& s, int part, int me) {
    constexpr float kBias = Traits::kProbabilityLog2Bias;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const int r = lane / 4;  // the thread's token (row of S^T) within its warp's 16: r and r + 8
    float out[kMTiles][kScoreRegs];
    float scores[kScoreRegs];
    uint32_t frag[kFragTiles][kValueSteps][4];
    const uint32_t pt = sm90::smem_u32(s.pt[me]);
    const uint64_t pt_desc = sm90::make_smem_desc(s.pt[me], kPtCoreStride, kPtGroupStride,
                                                  sm90::SmemLayout::kInterleave);
    float* warp_max = &s.warp_max[me][0][0];
    int j = 0;            // block counter over the CTA's whole sequence (the same in both consumers)
    int piece_index = 0;  // pieces merged so far: the merge barriers' phases

    auto retire_wgmmas = [&] {
      sm90::wgmma_wait<0>();
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) sm90::fence_registers(out[i]);
      sm90::fence_registers(scores);
#pragma unroll
      for (int i = 0; i < kFragTiles; ++i)
#pragma unroll
        for (int step = 0; step < kValueSteps; ++step) sm90::fence_registers(frag[i][step]);
    };

    for (PartWalker walker(p, part); walker.valid(); walker.next()) {
      const PartPiece piece = walker.piece();
      const int seq_len = p.seq_lens[piece.request];
      // Both consumers are done with the previous piece's query tile.
      sm90::named_barrier_sync(kBarConsumers, kConsumerThreads);
      load_query(p, s, piece.request);
      sm90::named_barrier_sync(kBarConsumers, kConsumerThreads);

      // Keys visible to each column's row t: k < seq_len - (q_len - 1) + t (context
      // parallelism: context_parallel_limit where a block needs masking).
      State st;
#pragma unroll
      for (int c = 0; c < kColumns; ++c) st.max[c] = -INFINITY, st.exact[c] = 0.f, st.weights[c] = 0.f;
#pragma unroll
      for (int i = 0; i < kMTiles; ++i) {
        sm90::attention::zero(out[i]);
        sm90::fence_registers(out[i]);
      }

      // Keys row t sees: seq_len - (q_len - 1) + t. Row 0 sees the fewest: blocks below its
      // limit need no masking.
      const int min_limit = seq_len - p.q_len + 1;
      const int num_blocks = max(piece.block_end - piece.block_begin, 0);
      // Block b of the piece to consumer b % 2: which blocks each consumer sums (and so the
      // result's bits) depends on the piece alone, not on what the part computed before it
      // (the batch-invariant mode relies on it).
      for (int b = me; b < num_blocks; b += 2) {
        const int J = j + b, block = piece.block_begin + b, ring = J % kKStages;
        const int valid = valid_tokens_in_block(seq_len, block);
        // With an odd stage count a stage's blocks alternate between the consumers, which run
        // apart: this one may reach block J while the other still waits for J - kKStages to
        // land, and the parity wait below would then pass on the phase of J - 2·kKStages. Block
        // J - kKStages's release (after it landed and was read) comes first: then the parity
        // names J's phase alone. (Even counts give each consumer its own stages.)
        if constexpr (kKStages % 2 == 1) {
          if (J >= kKStages) sm90::mbarrier_wait(&s.kfree[ring], (J / kKStages - 1) & 1);
        }
        sm90::mbarrier_wait(&s.full[ring], (J / kKStages) & 1);
        issue_scores(s, ring, scores);
        retire_wgmmas();  // S^T(J), and this consumer's O^T of its previous block
        // The stage's reads (S^T retired, the last fragments loaded) before TMA may overwrite it.
        auto release_stage = [&] {
          sm90::fence_proxy_async_smem();
          __syncwarp();
          if (lane == 0) sm90::mbarrier_arrive(&s.kfree[ring]);
        };
        // 16 rows: the block's fragments load during the softmax. 32 rows: part by part after
        // it, so that they and the softmax's temporaries are not live together beside O^T.
        if constexpr (kFragParts == 1) {
          load_value_fragments(s, ring, valid, 0, frag);
          release_stage();
        }

        // Mask keys past each column's limit.
        if ((block + 1) * kBlockTokens > min_limit) {
#pragma unroll
          for (int c = 0; c < kColumns; ++c) {
            const int limit = min_limit + column_row(c) / p.num_heads;
            const int bound =
                p.causal_seqs != nullptr ? context_parallel_limit(p, piece.request, seq_len, limit) : limit;
#pragma unroll
            for (int h = 0; h < 2; ++h) {
              const int token = block * kBlockTokens + 16 * warp + r + 8 * h;
              if (token >= bound) scores[4 * (c / 2) + 2 * h + c % 2] = -INFINITY;
            }
          }
        }
        // Column maxima over the warp's 16 tokens, then whether any warp raises a column's max.
        const float scale = p.score_scale_log2;
        float block_max[kColumns];
        bool raise = false;
#pragma unroll
        for (int c = 0; c < kColumns; ++c) {
          float m = fmaxf(scores[4 * (c / 2) + c % 2], scores[4 * (c / 2) + 2 + c % 2]);
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 4));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 8));
          m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, 16));
          block_max[c] = m * scale;
          raise |= sm90::attention::max_moves(block_max[c], st.max[c], Traits::kMaxSlackLog2);
        }
        float new_max[kColumns];
#pragma unroll
        for (int c = 0; c < kColumns; ++c) new_max[c] = st.max[c];
        if (sm90::named_barrier_or(kBarConsumer0 + me, kWarpgroupThreads, raise)) {
          // Rare with the lazy max: the warps' maxima meet in shared memory.
          if (r == 0) {
#pragma unroll
            for (int c = 0; c < kColumns; ++c) warp_max[warp * kRows + column_row(c)] = block_max[c];
          }
          sm90::named_barrier_sync(kBarConsumer0 + me, kWarpgroupThreads);
#pragma unroll
          for (int c = 0; c < kColumns; ++c) {
            float m = warp_max[column_row(c)];
#pragma unroll
            for (int w = 1; w < 4; ++w) m = fmaxf(m, warp_max[w * kRows + column_row(c)]);
            if (sm90::attention::max_moves(m, st.max[c], Traits::kMaxSlackLog2)) new_max[c] = m;
          }
          // The maxima are read before any warp writes the next block's (after its vote).
        }
        // P = 2^(S·scale - (max - bias)) to e4m3, stored as P^T; the sums of both kinds.
#pragma unroll
        for (int c = 0; c < kColumns; ++c) {
          const float base = sm90::attention::exponent_base(new_max[c], kBias);
          const float factor = sm90::attention::rescale_factor(st.max[c], new_max[c]);
          const int r0 = 4 * (c / 2) + c % 2;
          // In place: the scores' last writes before the next S^T are then on every path (a
          // masked score written only where a block needs masking made ptxas serialise the
          // wgmmas around it).
          scores[r0] = sm90::fast_exp2(fmaf(scores[r0], scale, -base));
          scores[r0 + 2] = sm90::fast_exp2(fmaf(scores[r0 + 2], scale, -base));
          const float p0 = scores[r0], p1 = scores[r0 + 2];
          const uint32_t bytes = sm90::pack_fp8x4(p0, p1, 0.f, 0.f);  // byte 0: token r, byte 1: r + 8
          st.exact[c] = fmaf(st.exact[c], factor, p0 + p1);
          st.weights[c] = fmaf(st.weights[c], factor, sm90::f16x2_total(sm90::fp8x4_pair_sums(bytes)));
          st.max[c] = new_max[c];
          // Row column_row(c) of P^T, K group `warp`, positions 4(r/2) + 2h + r%2.
          const int row = column_row(c);
          const uint32_t at = pt + (row / 8) * kPtGroupStride + warp * kPtCoreStride + (row % 8) * 16 + 4 * (r / 2) + r % 2;
          sm90::st_shared_u8(at, bytes & 0xffu);
          sm90::st_shared_u8(at + 2, (bytes >> 8) & 0xffu);
#pragma unroll
          for (int i = 0; i < kMTiles; ++i) {
            out[i][r0] *= factor;
            out[i][r0 + 2] *= factor;
          }
        }
        sm90::fence_proxy_async_smem();
        sm90::named_barrier_sync(kBarConsumer0 + me, kWarpgroupThreads);  // P^T complete
#pragma unroll
        for (int part_index = 0; part_index < kFragParts; ++part_index) {
          if constexpr (kFragParts > 1) {
            if (part_index > 0) retire_wgmmas();  // the previous part has read its fragments
            load_value_fragments(s, ring, valid, part_index * kFragTiles, frag);
            if (part_index == kFragParts - 1) release_stage();
          }
          // The rescaled accumulators and the fragments are final here: without the fences the
          // compiler sinks the multiplications between the wgmmas, and ptxas serialises them.
#pragma unroll
          for (int i = 0; i < kMTiles; ++i) sm90::fence_registers(out[i]);
#pragma unroll
          for (int i = 0; i < kFragTiles; ++i)
#pragma unroll
            for (int step = 0; step < kValueSteps; ++step) sm90::fence_registers(frag[i][step]);
          sm90::wgmma_fence();
#pragma unroll
          for (int i = 0; i < kFragTiles; ++i)
#pragma unroll
            for (int step = 0; step < kValueSteps; ++step)
              sm90::mma_rs<typename Traits::ValueMma>(frag[i][step],
                                                      sm90::desc_advance(pt_desc, 2 * step * kPtCoreStride),
                                                      out[part_index * kFragTiles + i], true);
          sm90::wgmma_commit();
        }
      }
      retire_wgmmas();
      j += num_blocks;
      merge_and_store(p, s, piece, st, out, me, piece_index++);
    }
  }

  // The query token of tile row `row` (< 32): row / num_heads in floating point, exact for rows
  // this small (the quotient is at least 0.5 / num_heads from an integer), in five instructions
  // where the integer division takes ~20 (the merge runs from a cold instruction cache).
  static __device__ int row_token(const DecodeParams& p, int row) {
    return static_cast<int>(__fdividef(static_cast<float>(row) + 0.5f, static_cast<float>(p.num_heads)));
  }

  // Sums over the thread's column across its warp's tokens (lanes with the same l % 4).
  static __device__ float warp_column_sum(float v) {
    v += __shfl_xor_sync(0xffffffffu, v, 4);
    v += __shfl_xor_sync(0xffffffffu, v, 8);
    v += __shfl_xor_sync(0xffffffffu, v, 16);
    return v;
  }

  // The two consumers' states merged (the LSE merge) into the piece's output: final BF16 (x
  // output_scale) and LSE, or the FP32 partial and its LSE for the combine kernel. It runs once a
  // piece, from a cold instruction cache under the KV stream (ncu: its warps stalled on
  // instruction fetch; TRACE: 10-50 us a piece when it was ~2800 instructions unrolled per
  // column and per store path), so its code is kept short: a row's weights are computed once,
  // by the lane of that row, and the stores to global memory are one rolled loop over both
  // consumers' staged tiles, 16 bytes of output a thread and step. Both consumers run every
  // step. The hand-offs go through mbarriers that every thread of both arrives on (one phase a
  // piece, or a round): compute-sanitizer's racecheck reports hand-offs between the consumers
  // through a named barrier as races (d45, session 10; and this merge's first version, d54).
  // A thread waits only for a phase it has itself arrived on, so no barrier can run two phases
  // ahead of a parity wait.
  static __device__ void merge_and_store(const DecodeParams& p, SharedLayout& s, const PartPiece& piece, const State& st,
                                         const float (&out)[kMTiles][kScoreRegs], int me, int piece_index) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32, t = threadIdx.x % kWarpgroupThreads;
    // This consumer's sums of each column over its warps, and its maxima (the same in every warp).
    float* sums = &s.warp_sums[me][0][0][0];
#pragma unroll
    for (int c = 0; c < kColumns; ++c) {
      const float exact = warp_column_sum(st.exact[c]), weights = warp_column_sum(st.weights[c]);
      if (lane < 4) {
        sums[warp * kRows + column_row(c)] = exact;
        sums[4 * kRows + warp * kRows + column_row(c)] = weights;
        if (warp == 0) s.merge_max[me][column_row(c)] = st.max[c];
      }
    }
    sm90::mbarrier_arrive(&s.merge_sums);
    sm90::mbarrier_wait(&s.merge_sums, piece_index & 1);  // both states in shared memory

    // Row `lane % kRows`: both states' scales to their common max, over the normaliser (every
    // lane computes them alike from the same values); this consumer's is then fetched for each
    // of the thread's columns.
    float my_weight;
    {
      const int row = lane % kRows;
      float exact[2] = {0.f, 0.f}, weights[2] = {0.f, 0.f};
#pragma unroll
      for (int c = 0; c < 2; ++c) {
        const float* state_sums = &s.warp_sums[c][0][0][0];
#pragma unroll
        for (int w = 0; w < 4; ++w) {
          exact[c] += state_sums[w * kRows + row];
          weights[c] += state_sums[4 * kRows + w * kRows + row];
        }
      }
      const float max0 = s.merge_max[0][row], max1 = s.merge_max[1][row];
      const float m = fmaxf(max0, max1);
      const float scale0 = max0 == -INFINITY ? 0.f : sm90::fast_exp2(max0 - m);
      const float scale1 = max1 == -INFINITY ? 0.f : sm90::fast_exp2(max1 - m);
      const float sum = exact[0] * scale0 + exact[1] * scale1;
      const float weight = weights[0] * scale0 + weights[1] * scale1;
      float inv, lse;
      row_normaliser(piece.num_blocks, sum, weight, m, Traits::kProbabilityLog2Bias, inv, lse);
      my_weight = (me == 0 ? scale0 : scale1) * inv;
      if (me == 0 && warp == 0 && lane < kRows && row < p.num_rows) {
        if (piece.slot >= 0) {
          p.partial_lse[static_cast<int64_t>(piece.slot) * p.num_rows + row] = lse;
        } else if (p.lse != nullptr) {
          const int token = row_token(p, row), head = row - token * p.num_heads;
          p.lse[piece.request * p.lse_stride_batch + token * p.lse_stride_token + head * p.lse_stride_head] = lse;
        }
      }
    }
    float weight[kColumns];
#pragma unroll
    for (int c = 0; c < kColumns; ++c) weight[c] = __shfl_sync(0xffffffffu, my_weight, column_row(c));

    // Register 4j + 2h + e of tile i is (row 8j + 2(l%4) + e, dim 64i + 16w + 2(l/4) + h): the
    // h pair is one 8-byte store, every store at a constant offset from the thread's first.
    const uint32_t stage_base = sm90::smem_u32(&s.stage[0][0][0]);
    const uint32_t my_stage = stage_base + me * kRows * kStageStride * 4 +
                              ((2 * (lane % 4)) * kStageStride + 16 * warp + 2 * (lane / 4)) * 4;
    constexpr int kUnitsPerRow = kMergeTiles * 64 / 8;  // 8 dims a unit: 16 bytes of BF16 output
    const int thread = t + me * kWarpgroupThreads;
#pragma unroll
    for (int round = 0; round < kMergeRounds; ++round) {
      // The previous round's stores (this piece's or, at round 0, the previous piece's last) have
      // read the area: with an even round count that phase's parity is (round - 1) & 1.
      if (round > 0 || piece_index > 0) sm90::mbarrier_wait(&s.copied, (round + 1) & 1);
#pragma unroll
      for (int k = 0; k < kMergeTiles; ++k)
#pragma unroll
        for (int c = 0; c < kColumns; ++c) {
          const int r0 = 4 * (c / 2) + c % 2, i = round * kMergeTiles + k;
          sm90::st_shared_f32x2(my_stage + ((8 * (c / 2) + c % 2) * kStageStride + 64 * k) * 4,
                                make_float2(out[i][r0] * weight[c], out[i][r0 + 2] * weight[c]));
        }
      sm90::mbarrier_arrive(&s.staged);
      sm90::mbarrier_wait(&s.staged, round & 1);  // both consumers' tiles staged
      for (int unit = thread; unit < kRows * kUnitsPerRow; unit += kConsumerThreads) {
        const int row = unit / kUnitsPerRow, dim = (unit % kUnitsPerRow) * 8;
        if (row >= p.num_rows) break;
        const uint32_t at = stage_base + (row * kStageStride + dim) * 4;
        float v[8];
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const uint4 a = sm90::ld_shared_v4(at + 16 * half);
          const uint4 b = sm90::ld_shared_v4(at + 16 * half + kRows * kStageStride * 4);
          v[4 * half + 0] = __uint_as_float(a.x) + __uint_as_float(b.x);
          v[4 * half + 1] = __uint_as_float(a.y) + __uint_as_float(b.y);
          v[4 * half + 2] = __uint_as_float(a.z) + __uint_as_float(b.z);
          v[4 * half + 3] = __uint_as_float(a.w) + __uint_as_float(b.w);
        }
        const int first_dim = round * kMergeTiles * 64 + dim;
        if (piece.slot >= 0) {
          float4* dst = reinterpret_cast<float4*>(
              p.partial_out + (static_cast<int64_t>(piece.slot) * p.num_rows + row) * kLatentDim + first_dim);
          dst[0] = make_float4(v[0], v[1], v[2], v[3]);
          dst[1] = make_float4(v[4], v[5], v[6], v[7]);
        } else {
          const int token = row_token(p, row), head = row - token * p.num_heads;
          const float scale = p.output_scale;
          *reinterpret_cast<uint4*>(p.out + piece.request * p.out_stride_batch + token * p.out_stride_token +
                                    head * p.out_stride_head + first_dim) =
              make_uint4(sm90::pack_bf16x2(v[0] * scale, v[1] * scale), sm90::pack_bf16x2(v[2] * scale, v[3] * scale),
                         sm90::pack_bf16x2(v[4] * scale, v[5] * scale), sm90::pack_bf16x2(v[6] * scale, v[7] * scale));
        }
      }
      sm90::mbarrier_arrive(&s.copied);
    }
    if (piece.slot >= 0) count_slot_writer(p, piece.slot);  // the combine may merge it
  }
};

template <int kRows>
__global__ void __launch_bounds__(kThreads, 1)
    decode_narrow_kernel(const __grid_constant__ CUtensorMap kv_map, const __grid_constant__ DecodeParams p) {
  using Kernel = NarrowDecodeKernel<kRows>;
  extern __shared__ uint8_t smem_raw[];
  typename Kernel::SharedLayout& s = Kernel::carve(smem_raw);
  if (threadIdx.x == 0) Kernel::init_barriers(s);
  __syncthreads();
  // As decode_kernel: the plan is complete past the wait; the combine may launch after it.
  sm90::grid_dependency_wait();
  sm90::allow_dependent_launch();
  const int part = blockIdx.y;  // grid x: one row tile (dispatch sends requests of <= kRows rows)
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    sm90::warpgroup_reg_dealloc<Kernel::kProducerRegs>();
    Kernel::Producer::run(p, &kv_map, {&s.k[0][0], s.full, s.kfree}, part);
  } else {
    sm90::warpgroup_reg_alloc<Kernel::kConsumerRegs>();
    Kernel::consumer_warpgroup(p, s, part, warpgroup - 1);
  }
}

}  // namespace speedmla::kernels::decode_sm90
