// The SM90 MLA decode kernel: a warp-specialised, split-KV flash-decoding kernel.
//
// Grid: (row tiles, parts). A CTA computes kTileRows query rows of a request against a run of
// KV blocks given by the split-KV plan (plan.cuh), possibly covering several requests.
//
//   warpgroup 0 (producer)   one thread issues TMA loads of whole cache rows (page by page)
//                            into a ring of K stages.
//   warpgroups 1 and 2       the consumers: consumer c owns output columns 256c..256c+255. A
//                            block's scorer computes S = Q·K^T and its online softmax (base 2)
//                            and hands P, the new row maxima and its partial row sums to the
//                            other consumer; both then add P·V of their column half.
//                            FP8, a seesaw: block b of a piece is scored by consumer b % 2.
//                            While one consumer runs its softmax the tensor cores run the
//                            other's GEMMs, and the scoring work is shared evenly. Each consumer
//                            first transposes its half of the block's values into its own
//                            half of a K-major V^T buffer (FP8 wgmma reads both operands
//                            K-major only);
//                            eight warps transposing keep up where the producer's four alone
//                            did not.
//                            BF16, sequential: consumer 0 scores every block, and consumer 1's
//                            P·V of a block runs during the softmax of the next (see
//                            Bf16Traits and consumer_warpgroup).
// Rows past seq_len in a sequence's last block hold whatever the cache holds there (NaN
// included) and 0 * NaN would leak into P·V: FP8 writes zeros for them into V^T, BF16
// consumers zero their half of those value rows in the K stage before their P·V.
//
// Synchronisation: mbarriers throughout — producer -> consumer data (full), consumer ->
// producer stage release (kfree), both per K stage and load part (Traits::kLoadParts), and one
// message channel per warp pair (warp w of each consumer owns the same 16 rows): see
// consumer_warpgroup.
#pragma once

#include <cuda.h>

#include <cstddef>
#include <cstdint>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/decode_producer.cuh"
#include "kernels/decode/sm90/fp8_format.cuh"
#include "kernels/decode/sm90/output_rows.cuh"
#include "kernels/decode/sm90/params.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/decode/sm90/query_tile.cuh"
#include "kernels/decode/sm90/slot_handover.cuh"
#include "kernels/sm90/attention/accumulator.cuh"
#include "kernels/sm90/attention/fp8_transpose.cuh"
#include "kernels/sm90/attention/online_softmax.cuh"
#include "kernels/sm90/attention/probabilities.cuh"
#include "kernels/sm90/attention/query_fragments.cuh"
#include "kernels/sm90/dependent_launch.cuh"
#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/swizzle.cuh"
#include "kernels/sm90/tensor_map.h"
#include "kernels/sm90/wgmma.cuh"

namespace speedmla::kernels::decode_sm90 {

struct Fp8Traits : Fp8Format {
  // Four K stages beside one V^T buffer (each consumer rewrites its half of it once its
  // previous P·V has retired). Three stages and two V^T buffers took the same time with TMA
  // pages and 3-5 % longer with copied rows (page 16, on the H200), whose loads take longer.
  static constexpr int kKStages = 4;
  static constexpr int kMmaK = 32;  // K of one wgmma, in elements (32 bytes)
  // The consumers take turns scoring blocks (the seesaw). V^T has its own buffer, so K
  // stages are released right after the scores and transposes, and the stages keep loads in
  // flight while two blocks are being computed.
  static constexpr bool kSeesaw = true;
  // A K stage lands and is released as a whole (after both consumers' transposes).
  static constexpr int kLoadParts = 1;
  using ScoreMma = sm90::gmma::MMA_64x64x32_F32E4M3E4M3_SS_TN<>;
  using ValueMma = sm90::gmma::MMA_64x256x32_F32E4M3E4M3_RS_TN<>;
  // The query's rope chunk stays in shared memory (both consumers score).
  static constexpr bool kRopeInRegisters = false;
};

struct Bf16Traits {
  static constexpr bool kFp8 = false;
  static constexpr int kElemBytes = 2;
  static constexpr int kKStages = 2;
  static constexpr sm90::SmemLayout kSwizzle = sm90::SmemLayout::kSwizzle128B;
  static constexpr sm90::TmaSwizzle kTmaSwizzle = sm90::TmaSwizzle::k128B;
  static constexpr sm90::TmaElement kTmaElement = sm90::TmaElement::kBFloat16;
  static constexpr int kMmaK = 16;
  static constexpr float kProbabilityLog2Bias = 0.f;
  static constexpr float kMaxSlackLog2 = 8.f;  // P below 2^8: nowhere near BF16's range
  // Consumer 0 scores every block. Values are read from the K stage and only two stages fit:
  // a block's values are held until both consumers' P·V of it, so computing two blocks at once
  // (the seesaw) would leave no load in flight — measured 20-35% slower on the H200.
  static constexpr bool kSeesaw = false;
  // A K stage lands and is released in two parts, one per consumer: part 0 = value chunks
  // 0-3 and the rope chunk (consumer 0, the scorer), part 1 = value chunks 4-7 (consumer 1).
  // The tensor cores run part 0 of S(b+1) before consumer 1's P·V(b), which overlaps the
  // softmax of b+1 (10 % faster at H = 128 than a whole stage held until both P·Vs, on the
  // H200); part 1 is then released last, and S(b+1) reads part 0 first.
  static constexpr int kLoadParts = 2;
  using ScoreMma = sm90::gmma::MMA_64x64x16_F32BF16BF16_SS<sm90::gmma::Major::K, sm90::gmma::Major::K>;
  // The scorer holds the query's rope chunk in registers (16, loaded once a piece), so the
  // rope's four score wgmmas read only K from shared memory.
  static constexpr bool kRopeInRegisters = true;
  using RopeScoreMma = sm90::gmma::MMA_64x64x16_F32BF16BF16_RS<sm90::gmma::Major::K, sm90::gmma::Major::K>;
  // V is read straight from the cache rows: N (value dims) is the contiguous dimension.
  using ValueMma = sm90::gmma::MMA_64x256x16_F32BF16BF16_RS<sm90::gmma::Major::K, sm90::gmma::Major::MN>;
};

template <typename Traits, KvLoad kLoad>
struct DecodeKernel {
  // The cache map's swizzle and element (launch_kernel.cuh encodes it from the traits) must be
  // the layout wgmma reads, and one chunk row must be one swizzle row.
  static_assert(sm90::tma_swizzle_bytes(Traits::kTmaSwizzle) == sm90::smem_swizzle_bytes(Traits::kSwizzle),
                "the TMA map must write the swizzle wgmma reads");
  static_assert(sm90::tma_element_bytes(Traits::kTmaElement) == Traits::kElemBytes, "TMA element size");
  static_assert(kChunkDims * Traits::kElemBytes == sm90::smem_swizzle_bytes(Traits::kSwizzle),
                "a chunk row is one swizzle row");
  using Producer = DecodeProducer<Traits, kLoad>;
  static constexpr int kE = Producer::kE;
  static constexpr int kChunkRowBytes = Producer::kChunkRowBytes;  // one swizzle row
  static constexpr int kChunkBytes = Producer::kChunkBytes;        // a 64-row chunk
  static constexpr int kTileBytes = Producer::kTileBytes;          // Q tile or one K stage
  static constexpr int kRowGroupBytes = 8 * kChunkRowBytes;        // wgmma stride-dim offset
  static constexpr int kStepsPerChunk = kChunkDims / Traits::kMmaK;
  static constexpr int kValueSteps = kBlockTokens / Traits::kMmaK;  // K steps of P·V per block
  static constexpr int kPRegs = 4 * kValueSteps;                    // P fragment registers
  static_assert(kPRegs == sm90::attention::kProbabilityRegs<Traits::kFp8, 32>);
  static constexpr int kPiecesPerChunkRow = Producer::kPiecesPerChunkRow;

  // FP8 V^T: 512 value rows x 64 token positions, no swizzle. Core matrices (8 rows x 16 B) are
  // placed at kVtCoreStride along K and kVtGroupStride along rows. Each stmatrix matrix of the
  // transpose is 8 rows of one position group from two row groups: a group stride that is not
  // a multiple of 128 bytes puts them in distinct banks. (Any multiple of 16 works along K;
  // 144 is the measured one.)
  static constexpr int kVtCoreStride = 144;
  static constexpr int kVtGroupStride = 592;
  static constexpr int kVtBytes = Traits::kFp8 ? (kLatentDim / 8) * kVtGroupStride : 0;

  static constexpr int kKStages = Traits::kKStages;
  static constexpr int kLoadParts = Traits::kLoadParts;

  // The load part (see Traits::kLoadParts) holding the values of output half `half`.
  static constexpr __device__ int part_of_half(int half) { return kLoadParts == 1 ? 0 : half; }

  // Consumer message channel (one per warp pair): each lane's P fragment registers, its two
  // partial row sums, and the rows' new maxima (one float per row).
  static constexpr int kProbGroups = kPRegs / 4;  // 16-byte pieces of a lane's P
  static constexpr int kMessageProbBytes = 4 * kProbGroups * 32 * 16;
  // RowSums::exact of each thread, then (FP8 only: BF16's are the same) RowSums::weights.
  static constexpr int kMessageSumBytes = kWarpgroupThreads * 8 * (Traits::kFp8 ? 2 : 1);
  static constexpr int kMessageMaxBytes = kTileRows * 4;

  // Shared memory map from a 1024-byte aligned base (swizzle atoms need it): the compiler lays it
  // out; carve() turns its offsets into the pointers the kernel works with (pointers from
  // constant offsets, rather than member accesses through a struct reference, keep the
  // consumers' address arithmetic what ptxas schedules best: the FP8 consumer spilled with them).
  struct SharedLayout {
    uint8_t q[kTileBytes];
    uint8_t k[kKStages][kTileBytes];
    uint8_t vt[Traits::kFp8 ? kVtBytes : 16];  // BF16 has no V^T
    uint4 message_probs[kMessageProbBytes / 16];
    float2 message_sums[kMessageSumBytes / 8];
    float message_max[kTileRows];
    uint64_t full[kKStages * kLoadParts];   // TMA bytes of a stage's part landed
    uint64_t kfree[kKStages * kLoadParts];  // a stage's part may be overwritten
    uint64_t channel[4];                    // per warp pair: a message was written
    uint64_t channel_free[4];               // per warp pair: the message was read
  };
  static_assert(offsetof(SharedLayout, k) % 1024 == 0 && kTileBytes % 1024 == 0, "K stages on swizzle atoms");
  static constexpr int kSmemBytes = sizeof(SharedLayout) + 1024;  // + alignment of the dynamic base
  static_assert(kSmemBytes <= 227 * 1024, "decode kernel shared memory exceeds the SM90 limit");

  // Named barriers (0 is __syncthreads): one per consumer warpgroup, one for both consumers.
  static constexpr uint32_t kBarConsumer0 = 1, kBarConsumers = 3;
  static constexpr int kConsumerThreads = 2 * kWarpgroupThreads;

  // Register budgets after setmaxnreg. They must add up to what the CTA was given at launch
  // (168 per thread, 128 * 504 in all): increases are served only from what other warps of
  // the CTA released, so asking for more waits forever. A consumer holds a 64x256 FP32
  // accumulator (128 registers), the 64x64 scores (32), two sets of P fragments and the
  // softmax state; the producer only issues loads. Copied rows give the producer 40: at 24 it
  // kept its page ids and stage address in local memory and worked through one copy step at a
  // time (1.28x page 64's time where 40 gives 1.09x, FP8 page 1); the consumers fit 232 (FP8:
  // one 8-byte value kept in local memory across a tile, none for BF16).
  static constexpr int kProducerRegs = kLoad == KvLoad::kCopiedRows ? 40 : 24;
  static constexpr int kConsumerRegs = (3 * 168 - kProducerRegs) / 2;
  static_assert(kProducerRegs + 2 * kConsumerRegs == 3 * 168 && kConsumerRegs % 8 == 0);

  struct Smem {
    uint8_t* q;
    uint8_t* k;
    uint8_t* vt;
    uint4* message_probs;
    float2* message_sums;
    float* message_max;
    uint64_t* full;
    uint64_t* kfree;
    uint64_t* channel;
    uint64_t* channel_free;
  };

  static __device__ Smem carve(uint8_t* raw) {
    uint8_t* base = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(raw) + 1023) & ~uintptr_t(1023));
    Smem s;
    s.q = base + offsetof(SharedLayout, q);
    s.k = base + offsetof(SharedLayout, k);
    s.vt = base + offsetof(SharedLayout, vt);
    s.message_probs = reinterpret_cast<uint4*>(base + offsetof(SharedLayout, message_probs));
    s.message_sums = reinterpret_cast<float2*>(base + offsetof(SharedLayout, message_sums));
    s.message_max = reinterpret_cast<float*>(base + offsetof(SharedLayout, message_max));
    s.full = reinterpret_cast<uint64_t*>(base + offsetof(SharedLayout, full));
    s.kfree = reinterpret_cast<uint64_t*>(base + offsetof(SharedLayout, kfree));
    s.channel = reinterpret_cast<uint64_t*>(base + offsetof(SharedLayout, channel));
    s.channel_free = reinterpret_cast<uint64_t*>(base + offsetof(SharedLayout, channel_free));
    return s;
  }

  // TMA pages: the producer arms a part's `full` with the bytes of its loads. Copied rows: every
  // lane of the stage's producer warps arrives once its copies of the part have landed
  // (copy_rows_producer).
  static __device__ void init_barriers(const Smem& s) {
    for (int i = 0; i < kKStages * kLoadParts; ++i) {
      sm90::mbarrier_init(&s.full[i], Producer::kFullArrivals);
      // Readers of a K stage part, one arrival per warp once it is done with the part: FP8
      // both consumers after their transposes (the scorer's S before them), BF16 the part's
      // consumer after its P·V (the scorer's S of the block completed before its message).
      sm90::mbarrier_init(&s.kfree[i], kLoadParts == 1 ? 8 : 4);
    }
    // Every lane of the sending (reading) warp arrives: each orders its own shared-memory
    // accesses before the partner's, with no reliance on warp-synchronous cumulativity.
    for (int w = 0; w < 4; ++w) {
      sm90::mbarrier_init(&s.channel[w], 32);
      sm90::mbarrier_init(&s.channel_free[w], 32);
    }
    sm90::fence_barrier_init();
  }

  // FP8 V transpose (by the consumers): each consumer transposes its half of the block's values
  // (half 0 = dims 0..255, half 1 = 256..511) into its own half of V^T, warp w taking token group
  // w, in 8 steps of 32 dims (sm90/attention/fp8_transpose.cuh: the V^T positions follow the P
  // fragment's register order, so P never moves between threads). Four steps' loads are in
  // flight together (8 spills at 240 registers with more).
  static constexpr int kTransposeBatch = 4;
  template <bool kMasked>
  static __device__ void transpose_values(uint32_t k_stage, uint32_t vt, int valid, int half, int warp,
                                          int lane) {
    sm90::attention::transpose_fp8_values<kChunkBytes, kVtCoreStride, kVtGroupStride, 8, kTransposeBatch, kMasked>(
        k_stage, 4 * half, vt, 32 * half, warp, valid, lane);
  }

  // ---------------------------------------------------------------------------------------
  // Consumers
  // ---------------------------------------------------------------------------------------

  // A thread's share (its 16 columns) of its two rows' softmax sums: `exact` of the
  // probabilities as computed, for the LSE; `weights` of the probabilities as the P·V
  // multiplies them, the output's normaliser, so that each output row is a weighted mean with
  // exactly its own weights. They differ for FP8: normalising e4m3-rounded P by the exact sum
  // leaves a row off by the rounding of its dominant weights, up to 1/16 when one key dominates
  // and the lazy max has left its P off a power of two. BF16 P is within 2^-9 of the float, so
  // there both are the exact sum.
  struct RowSums {
    float exact[2];
    float weights[2];
  };

  // Stages the query tile of `request` (query_tile.cuh); called by all threads of both
  // consumers, between two pieces of a part, with the tensor cores idle.
  static __device__ void load_query(const DecodeParams& p, const Smem& s, int request, int row_tile) {
    stage_query_tile<kTileRows, kE, Traits::kSwizzle>(p, sm90::smem_u32(s.q), request, row_tile * kTileRows,
                                                      threadIdx.x - kWarpgroupThreads, kConsumerThreads);
  }

  // The query's rope chunk as score wgmma A fragments (Traits::kRopeInRegisters): four per K
  // step. FP8 keeps one unused register.
  static constexpr int kRopeRegs = Traits::kRopeInRegisters ? 4 * kStepsPerChunk : 1;

  // Loads the rope fragments from the staged query tile (its last chunk).
  static __device__ void load_rope(const Smem& s, uint32_t (&rope)[kRopeRegs]) {
    static_assert(Traits::kRopeInRegisters);
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    sm90::attention::load_a_fragments<Traits::kSwizzle, 1, kStepsPerChunk>(
        sm90::smem_u32(s.q) + (kNumChunks - 1) * kChunkBytes, kChunkBytes, 16 * warp, lane, rope);
  }

  // S = Q·K^T of block j (K stage j % kKStages) as one wgmma group: 9 chunks x (64 / kMmaK)
  // wgmma steps, each step's descriptors one 32-bit add away from the base ones (a rolled
  // loop makes ptxas fence and serialise the wgmmas), part by part as each part lands.
  // `after_first_part` runs once the first part's wgmmas are issued, before the wait for the
  // next part (see the BF16 scorer in consumer_warpgroup).
  template <typename AfterFirstPart>
  static __device__ void issue_scores(const Smem& s, int j, float (&scores)[32], const uint32_t (&rope)[kRopeRegs],
                                      AfterFirstPart&& after_first_part) {
    const int stage = j % kKStages;
    const uint64_t q_desc = sm90::make_smem_desc(s.q, 16, kRowGroupBytes, Traits::kSwizzle);
    const uint64_t k_desc = sm90::make_smem_desc(s.k + stage * kTileBytes, 16, kRowGroupBytes, Traits::kSwizzle);
#pragma unroll
    for (int part = 0; part < kLoadParts; ++part) {
      sm90::mbarrier_wait(&s.full[stage * kLoadParts + part], (j / kKStages) & 1);
      sm90::wgmma_fence();
#pragma unroll
      for (int c = 0; c < kNumChunks; ++c) {
        if (Producer::part_of_chunk(c) != part) continue;
#pragma unroll
        for (int step = 0; step < kStepsPerChunk; ++step) {
          const uint32_t offset = c * kChunkBytes + step * 32;
          auto from_shared = [&] {
            sm90::mma_ss<typename Traits::ScoreMma>(sm90::desc_advance(q_desc, offset),
                                                    sm90::desc_advance(k_desc, offset), scores, c + step > 0);
          };
          if constexpr (Traits::kRopeInRegisters) {
            if (c == kNumChunks - 1)
              sm90::mma_rs<typename Traits::RopeScoreMma>(&rope[4 * step], sm90::desc_advance(k_desc, offset), scores,
                                                          true);
            else
              from_shared();
          } else {
            from_shared();
          }
        }
      }
      if (part == 0) after_first_part();
    }
    sm90::wgmma_commit();
  }

  // O_half += P·V_half for block j, K steps (kMmaK tokens each) kFirstStep .. kFirstStep +
  // kSteps - 1 of it. half 0 = value dims 0..255, half 1 = 256..511.
  template <int kFirstStep = 0, int kSteps = kValueSteps>
  static __device__ void issue_values(const Smem& s, int j, int half, const uint32_t (&probs)[kPRegs], float (&acc)[128]) {
    static_assert(kFirstStep >= 0 && kSteps > 0 && kFirstStep + kSteps <= kValueSteps);
    if constexpr (Traits::kFp8) {
      const uint8_t* vt = s.vt + half * (kHalfValueDim / 8) * kVtGroupStride;
      const uint64_t desc = sm90::make_smem_desc(vt, kVtCoreStride, kVtGroupStride, sm90::SmemLayout::kInterleave);
#pragma unroll
      for (int step = kFirstStep; step < kFirstStep + kSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step], sm90::desc_advance(desc, 2 * step * kVtCoreStride),
                                                acc, true);
    } else {
      // V rows are the cache rows of the K stage (MN-major): N runs along the 64-dim chunks
      // (leading offset: one chunk), K along tokens (stride offset: 8 rows).
      const uint8_t* v = s.k + (j % kKStages) * kTileBytes + half * (kHalfValueDim / kChunkDims) * kChunkBytes;
      const uint64_t desc = sm90::make_smem_desc(v, kChunkBytes, kRowGroupBytes, Traits::kSwizzle);
#pragma unroll
      for (int step = kFirstStep; step < kFirstStep + kSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step],
                                                sm90::desc_advance(desc, step * Traits::kMmaK * kChunkRowBytes), acc, true);
    }
  }

  // The BF16 scorer's probabilities of K steps kFirstStep .. kFirstStep + kSteps - 1 (kMmaK
  // tokens each), 2^(s·scale - base), straight into the P·V fragments, and their share of the
  // row sums added to `sums`. The scores stay as they are: the scorer exponentiates its first
  // steps before it knows the block's maxima, and must start again from the scores when they
  // move (see consumer_warpgroup).
  template <int kFirstStep, int kSteps>
  static __device__ void exponentiate_steps(const DecodeParams& p, const float (&scores)[32],
                                            const float (&exponent_base)[2], uint32_t (&probs)[kPRegs],
                                            float (&sums)[2]) {
    static_assert(!Traits::kFp8 && kFirstStep >= 0 && kSteps > 0 && kFirstStep + kSteps <= kValueSteps);
    const float score_scale_log2 = p.score_scale_log2;
#pragma unroll
    for (int step = kFirstStep; step < kFirstStep + kSteps; ++step) {
      // Registers 8 step + {0, 1, 4, 5} are row 0's, + {2, 3, 6, 7} row 1's (accumulator.cuh).
      float q[8];
#pragma unroll
      for (int r = 0; r < 8; ++r)
        q[r] = sm90::fast_exp2(fmaf(scores[8 * step + r], score_scale_log2, -exponent_base[(r / 2) % 2]));
#pragma unroll
      for (int k = 0; k < 4; ++k) probs[4 * step + k] = sm90::pack_bf16x2(q[2 * k], q[2 * k + 1]);
      sums[0] += (q[0] + q[1]) + (q[4] + q[5]);
      sums[1] += (q[2] + q[3]) + (q[6] + q[7]);
    }
  }

  // The BF16 scorer's P·V (consumer_warpgroup) from K step kFirstStep on, as its probabilities
  // are computed: exponentiates the scores of kScorerValueSteps steps and issues their wgmmas,
  // then the next steps' while those run, so that the tensor cores start on the block's first
  // tokens during the exponentials of its last (1 % faster at H = 128 than the whole P·V after
  // all of them; two steps a part measured alike). The caller has rescaled the output to the
  // block's maxima and made the values readable; it commits the group.
  static constexpr int kScorerValueSteps = 1;
  // K steps the BF16 scorer exponentiates before it knows whether the block moves its maxima.
  static constexpr int kSpeculativeSteps = 2;
  template <int kFirstStep>
  static __device__ void issue_values_as_exponentiated(const DecodeParams& p, const Smem& s, int j, int half,
                                                       const float (&exponent_base)[2], const float (&scores)[32],
                                                       uint32_t (&probs)[kPRegs], float (&sums)[2], float (&acc)[128]) {
    exponentiate_steps<kFirstStep, kScorerValueSteps>(p, scores, exponent_base, probs, sums);
    sm90::wgmma_fence();
    issue_values<kFirstStep, kScorerValueSteps>(s, j, half, probs, acc);
    if constexpr (kFirstStep + kScorerValueSteps < kValueSteps)
      issue_values_as_exponentiated<kFirstStep + kScorerValueSteps>(p, s, j, half, exponent_base, scores, probs, sums,
                                                                   acc);
  }

  // Makes this consumer's value half of block j readable by its P·V wgmma. FP8: transposes it
  // into the consumer's own half of V^T (its previous P·V, which read that half, has
  // completed), then releases the K stage: the consumer's scores of the block, if it
  // scored it, completed before. BF16: values are the K stage's rows; those past seq_len are
  // zeroed (score wgmmas of the other consumer may still read them: they are masked there, so
  // either value is harmless).
  static __device__ void prepare_values(const Smem& s, int j, int valid, int half) {
    const int stage = j % kKStages;
    sm90::mbarrier_wait(&s.full[stage * kLoadParts + part_of_half(half)], (j / kKStages) & 1);
    if constexpr (Traits::kFp8) {
      const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
      const uint32_t k_stage = sm90::smem_u32(s.k + stage * kTileBytes);
      const uint32_t vt = sm90::smem_u32(s.vt);
      if (valid < kBlockTokens) transpose_values<true>(k_stage, vt, valid, half, warp, lane);
      else transpose_values<false>(k_stage, vt, valid, half, warp, lane);
      sm90::fence_proxy_async_smem();
      __syncwarp();
      if (lane == 0) sm90::mbarrier_arrive(&s.kfree[stage * kLoadParts]);
      sm90::named_barrier_sync(kBarConsumer0 + half, kWarpgroupThreads);
    } else if (valid < kBlockTokens) {
      const uint32_t values = sm90::smem_u32(s.k + stage * kTileBytes) + half * kValueChunks / 2 * kChunkBytes;
      const int pieces = (kBlockTokens - valid) * kPiecesPerChunkRow;
      for (int i = threadIdx.x % kWarpgroupThreads; i < kValueChunks / 2 * pieces; i += kWarpgroupThreads)
        sm90::st_shared_v4(values + (i / pieces) * kChunkBytes + valid * kChunkRowBytes + (i % pieces) * 16,
                           make_uint4(0u, 0u, 0u, 0u));
      sm90::fence_proxy_async_smem();
      sm90::named_barrier_sync(kBarConsumer0 + half, kWarpgroupThreads);
    }
  }

  // BF16: releases this consumer's part of block j's K stage once its P·V of the block has
  // completed (one arrival per warp). FP8 released the stage after its transposes, and its
  // V^T half is its own.
  static __device__ void release_values(const Smem& s, int j, int half) {
    static_assert(!Traits::kFp8);
    if (threadIdx.x % 32 == 0) sm90::mbarrier_arrive(&s.kfree[(j % kKStages) * kLoadParts + part_of_half(half)]);
  }

  // Message slot of this thread for its P fragment registers, 16 bytes at a time.
  static __device__ uint32_t message_prob_slot(const Smem& s, int group) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    return sm90::smem_u32(s.message_probs + (warp * kProbGroups + group) * 32 + lane);
  }

  // Final output rows are staged (store_output_half) in each warp's part of the query tile, which
  // is free there: every score wgmma of the piece has retired in both consumers, and the next
  // piece's query is written only after both pass the consumers' barrier.
  static_assert(8 * kOutputStageWarpBytes <= kTileBytes, "the output stages of 8 warps must fit in the query tile");

  // Online softmax (base 2) of one block's scores, `block_scores`, into `probabilities` (the same
  // array, or registers of the caller's own: the seesaw's scorer writes them apart from the
  // registers its S wgmma wrote, which lets ptxas run this softmax under the scorer's P·V(b-1);
  // written in place there, ptxas serialised every wgmma, C7515), in steps that the BF16
  // scorer takes apart and interleaves with its P·V (consumer_warpgroup):
  // - mask_block copies the scores and masks keys past each row's limit (with context
  //   parallelism, the rank's bound: context_parallel_limit) to -inf;
  // - block_maxima finds the new row maxima (returned) and the exponents' base. A row's max
  //   moves only when the block exceeds it by more than kMaxSlackLog2 (the sums and outputs are
  //   relative to whichever max is used, so the result is the same);
  // - exponentiate turns the scores into probabilities (the BF16 scorer: exponentiate_steps);
  // - block_row_sums fills the block's exact sums (and, for BF16, the weights: see RowSums).
  static __device__ void mask_block(const DecodeParams& p, const float (&block_scores)[32], float (&probabilities)[32],
                                    const int (&limit)[2], int block, int request, int seq_len) {
    const int quad_col = 2 * (threadIdx.x % 4);
#pragma unroll
    for (int r = 0; r < 32; ++r) probabilities[r] = block_scores[r];
    if ((block + 1) * kBlockTokens > min(limit[0], limit[1])) {
      int bound[2] = {limit[0], limit[1]};
      if (p.causal_seqs != nullptr) {
#pragma unroll
        for (int i = 0; i < 2; ++i) bound[i] = context_parallel_limit(p, request, seq_len, limit[i]);
      }
#pragma unroll
      for (int n = 0; n < 8; ++n)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int token = block * kBlockTokens + 8 * n + quad_col + e;
          if (token >= bound[0]) probabilities[4 * n + e] = -INFINITY;
          if (token >= bound[1]) probabilities[4 * n + 2 + e] = -INFINITY;
        }
    }
  }

  static __device__ void block_maxima(const DecodeParams& p, const float (&probabilities)[32], const float (&row_max)[2],
                                      float (&new_max)[2], float (&exponent_base)[2]) {
    constexpr float kBias = Traits::kProbabilityLog2Bias;
    const float score_scale_log2 = p.score_scale_log2;
    // Maxima and sums as trees (depth 4 instead of 16 dependent instructions): the softmax is
    // on the path from one block's scores to the next P·V.
    float block_max[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) block_max[i] = sm90::attention::row_tree_reduce(probabilities, i, [](float a, float b) { return fmaxf(a, b); });
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffffu, block_max[i], 1));
      block_max[i] = fmaxf(block_max[i], __shfl_xor_sync(0xffffffffu, block_max[i], 2));
      new_max[i] = sm90::attention::lazy_max(block_max[i] * score_scale_log2, row_max[i], Traits::kMaxSlackLog2);
      exponent_base[i] = sm90::attention::exponent_base(new_max[i], kBias);
    }
  }

  static __device__ void exponentiate(const DecodeParams& p, float (&probabilities)[32], const float (&exponent_base)[2]) {
    const float score_scale_log2 = p.score_scale_log2;
#pragma unroll
    for (int r = 0; r < 32; ++r)
      probabilities[r] = sm90::fast_exp2(fmaf(probabilities[r], score_scale_log2, -exponent_base[(r / 2) % 2]));
  }

  static __device__ void block_row_sums(const float (&probabilities)[32], RowSums& block_sums) {
#pragma unroll
    for (int i = 0; i < 2; ++i) block_sums.exact[i] = sm90::attention::row_tree_reduce(probabilities, i, [](float a, float b) { return a + b; });
    if constexpr (!Traits::kFp8) {
      block_sums.weights[0] = block_sums.exact[0];
      block_sums.weights[1] = block_sums.exact[1];
    }
  }

  static __device__ void softmax_block(const DecodeParams& p, const float (&block_scores)[32], float (&probabilities)[32],
                                       const float (&row_max)[2], float (&new_max)[2], RowSums& block_sums,
                                       const int (&limit)[2], int block, int request, int seq_len) {
    float exponent_base[2];
    mask_block(p, block_scores, probabilities, limit, block, request, seq_len);
    block_maxima(p, probabilities, row_max, new_max, exponent_base);
    exponentiate(p, probabilities, exponent_base);
    block_row_sums(probabilities, block_sums);
  }

  // Moves the running softmax state to a block's new row maxima (advance_softmax) in steps that
  // the BF16 scorer takes apart: the factors from the old maxima to the new, the running sums
  // rescaled by them plus the block's sums, and the output half rescaled. Both consumers apply
  // every block's update in the same order and with the same operations, so their states stay
  // identical.
  static __device__ void rescale_factors(const float (&row_max)[2], const float (&new_max)[2], float (&factor)[2]) {
#pragma unroll
    for (int i = 0; i < 2; ++i) factor[i] = sm90::attention::rescale_factor(row_max[i], new_max[i]);
  }

  static __device__ void add_block_sums(RowSums& row_sums, const float (&factor)[2], const RowSums& block_sums) {
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      row_sums.exact[i] = fmaf(row_sums.exact[i], factor[i], block_sums.exact[i]);
      row_sums.weights[i] = fmaf(row_sums.weights[i], factor[i], block_sums.weights[i]);
    }
  }

  // Whether any row of the warp moves its max, from the maxima rather than the factors, so that
  // the vote does not wait for the factors' exponentials.
  static __device__ bool warp_maxima_move(const float (&row_max)[2], const float (&new_max)[2]) {
    return __any_sync(0xffffffffu, new_max[0] != row_max[0] || new_max[1] != row_max[1]);
  }

  static __device__ void rescale_to_maxima(float (&acc)[128], float (&row_max)[2], const float (&new_max)[2],
                                           const float (&factor)[2]) {
    const bool moved = warp_maxima_move(row_max, new_max);
#pragma unroll
    for (int i = 0; i < 2; ++i) row_max[i] = new_max[i];
    if (moved) sm90::attention::scale_rows<false>(acc, factor[0], factor[1]);
  }

  static __device__ void advance_softmax(float (&acc)[128], float (&row_max)[2], RowSums& row_sums,
                                         const float (&new_max)[2], const RowSums& block_sums) {
    float factor[2];
    rescale_factors(row_max, new_max, factor);
    add_block_sums(row_sums, factor, block_sums);
    rescale_to_maxima(acc, row_max, new_max, factor);
  }

  // A consumer warpgroup (`me` = 0 or 1): output columns 256·me .. 256·me+255 of every block,
  // and the scores and softmax of the blocks it scores: b % 2 == me in the seesaw (FP8),
  // all blocks for consumer 0 otherwise (BF16). Seesaw: right after its P·V of a scored block
  // a consumer issues the scores of its next one, so they run during the other's softmax.
  // BF16: the scorer writes P(b) while its P·V(b) runs but posts it only after issuing the
  // first part of S(b+1), so that the tensor cores run consumer 1's P·V(b) during the softmax
  // of b+1.
  //
  // Messages. Warp w of each consumer owns the same 16 rows, and the lane layouts match, so a
  // block's scorer hands its P fragments, partial row sums and new row maxima lane by lane to
  // the same warp and lane of the other consumer: one buffer per warp pair, message k
  // completes phase k of `channel` when written and of `channel_free` when read. Between
  // pieces both consumers meet at a barrier.
  static __device__ void consumer_warpgroup(const DecodeParams& p, const Smem& s, int row_tile, int part, int me) {
    constexpr bool kSeesaw = Traits::kSeesaw;
    // A consumer waits for its next scores' K stage right after its P·V: in the seesaw that
    // stage must not wait on the P·V (four K stages, values apart).
    static_assert(!kSeesaw || Traits::kFp8, "the seesaw needs a V^T buffer apart from the K stages");
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const RowInfo rows = row_info(p, row_tile, warp, lane);
    constexpr float kBias = Traits::kProbabilityLog2Bias;
    float acc[128];
    float scores[32];
    uint32_t my_probs[kPRegs], their_probs[kPRegs];
    int j = 0;        // block counter over the CTA's whole sequence (the same in every warpgroup)
    int message = 0;  // messages on this warp pair's channel
    // This thread's message slots (shared-window addresses: the Smem pointers are generic).
    const uint32_t sum_slot = sm90::smem_u32(s.message_sums + threadIdx.x % kWarpgroupThreads);
    const uint32_t max_slot[2] = {sm90::smem_u32(s.message_max + rows.local[0]),
                                  sm90::smem_u32(s.message_max + rows.local[1])};

    // A message is written (write_message), then posted (post_message): the BF16 scorer writes
    // it while its P·V runs and posts it once the next scores are issued.
    auto write_message = [&](const float (&new_max)[2], const RowSums& block_sums) {
      if (message > 0) sm90::mbarrier_wait(&s.channel_free[warp], (message - 1) & 1);
#pragma unroll
      for (int g = 0; g < kProbGroups; ++g)
        sm90::st_shared_v4(message_prob_slot(s, g),
                           make_uint4(my_probs[4 * g], my_probs[4 * g + 1], my_probs[4 * g + 2], my_probs[4 * g + 3]));
      sm90::st_shared_f32x2(sum_slot, make_float2(block_sums.exact[0], block_sums.exact[1]));
      if constexpr (Traits::kFp8)
        sm90::st_shared_f32x2(sum_slot + kWarpgroupThreads * 8, make_float2(block_sums.weights[0], block_sums.weights[1]));
      if (lane % 4 == 0) {
        sm90::st_shared_f32(max_slot[0], new_max[0]);
        sm90::st_shared_f32(max_slot[1], new_max[1]);
      }
    };
    auto post_message = [&] {
      sm90::mbarrier_arrive(&s.channel[warp]);
      ++message;
    };
    auto send = [&](const float (&new_max)[2], const RowSums& block_sums) {
      write_message(new_max, block_sums);
      post_message();
    };
    auto receive = [&](float (&new_max)[2], RowSums& block_sums) {
      sm90::mbarrier_wait(&s.channel[warp], message & 1);
#pragma unroll
      for (int g = 0; g < kProbGroups; ++g) {
        const uint4 v = sm90::ld_shared_v4(message_prob_slot(s, g));
        their_probs[4 * g] = v.x;
        their_probs[4 * g + 1] = v.y;
        their_probs[4 * g + 2] = v.z;
        their_probs[4 * g + 3] = v.w;
      }
      const float2 exact = sm90::ld_shared_f32x2(sum_slot);
      const float2 weights = Traits::kFp8 ? sm90::ld_shared_f32x2(sum_slot + kWarpgroupThreads * 8) : exact;
      block_sums = {{exact.x, exact.y}, {weights.x, weights.y}};
      new_max[0] = sm90::ld_shared_f32(max_slot[0]);
      new_max[1] = sm90::ld_shared_f32(max_slot[1]);
      sm90::mbarrier_arrive(&s.channel_free[warp]);
      ++message;
    };
    uint32_t rope[kRopeRegs];
    auto issue_block_scores = [&](int j_block) { issue_scores(s, j_block, scores, rope, [] {}); };
    // Waits for every wgmma of this warpgroup. The register fences tell the compiler that the
    // accumulators and both P fragment sets are live up to here: a P·V reads its P registers
    // asynchronously, and were they shared with the scores (dead to the compiler once packed)
    // the next S would overwrite them in flight; ptxas would then serialise every wgmma.
    // `scores_live` false: no wgmma writes the scores now, so they need not stay live across
    // the wait (the seesaw's scorer, between its softmax of S(b) and the issue of S(b + 2)).
    auto fence_value_registers = [&] {
      sm90::fence_registers(acc);
      sm90::fence_registers(my_probs);
      sm90::fence_registers(their_probs);
    };
    auto retire_wgmmas = [&](bool scores_live = true) {
      sm90::wgmma_wait<0>();
      fence_value_registers();
      if (scores_live) sm90::fence_registers(scores);
      if constexpr (Traits::kRopeInRegisters) sm90::fence_registers(rope);
    };
    // The seesaw's receiver, before it overwrites its half of V^T: waits for its P·V of the
    // block before, which reads that half, and leaves the group committed after it (the scores
    // of its next block, whose registers are not fenced: they are still being written) in
    // flight. (Where the scorer's step issued no scores, the receiver retires everything
    // instead: an empty group committed there made ptxas serialise every wgmma.)
    auto retire_values = [&] {
      sm90::wgmma_wait<1>();
      fence_value_registers();
    };
    auto issue_block_values = [&](int j_block, const uint32_t (&probs)[kPRegs]) {
      sm90::wgmma_fence();
      issue_values(s, j_block, me, probs, acc);
      sm90::wgmma_commit();
    };

    for (PartWalker walker(p, part); walker.valid(); walker.next()) {
      const PartPiece piece = walker.piece();
      const int seq_len = p.seq_lens[piece.request];
      // Both consumers are past the previous piece's score wgmmas before the query tile is
      // replaced, and past its messages before new ones are written.
      sm90::named_barrier_sync(kBarConsumers, kConsumerThreads);
      load_query(p, s, piece.request, row_tile);
      sm90::named_barrier_sync(kBarConsumers, kConsumerThreads);
      if constexpr (Traits::kRopeInRegisters) {
        if (me == 0) load_rope(s, rope);  // the scorer's
      }

      // Keys visible to each row: k < seq_len - (q_len - 1) + t (context parallelism widens it
      // inside softmax_block).
      const int limit[2] = {seq_len - p.q_len + 1 + rows.token[0], seq_len - p.q_len + 1 + rows.token[1]};
      float row_max[2] = {-INFINITY, -INFINITY};
      RowSums row_sums = {{0.f, 0.f}, {0.f, 0.f}};  // summed over the quad at the end
      sm90::attention::zero(acc);
      sm90::fence_registers(acc);  // the zeroing may not sink below the first score wgmmas

      const int num_blocks = max(piece.block_end - piece.block_begin, 0);
      // The first block this consumer scores.
      const int first_scored = kSeesaw ? me : (me == 0 ? 0 : num_blocks);
      if (first_scored < num_blocks) issue_block_scores(j + first_scored);
      if constexpr (kSeesaw) retire_wgmmas();  // the scorer's step expects its S retired
      // The seesaw runs in pairs of steps, the scorer's of block b then the receiver's of b + 1
      // (consumer 1 starts with the receiver's step of block 0), so that ptxas sees every
      // scorer's step reached from a receiver's (which retires S(b)) or from before the loop:
      // the scorer's softmax then runs while its P·V(b-1) does. With one step a loop iteration,
      // ptxas could not tell which group was in flight and serialised every wgmma.
      auto scorer_step = [&](int b) {
        const int j_block = j + b, block = piece.block_begin + b;
        float new_max[2];
        RowSums block_sums;
        // In flight: P·V(b-1) only.
        float probabilities[32];
        softmax_block(p, scores, probabilities, row_max, new_max, block_sums, limit, block, piece.request, seq_len);
        sm90::attention::pack_probabilities<Traits::kFp8>(probabilities, my_probs);
        if constexpr (Traits::kFp8) sm90::attention::fp8_probability_row_sums(my_probs, block_sums.weights);
        send(new_max, block_sums);
        // P·V(b-1), which read the half of V^T transposed next: S(b) was read by the softmax,
        // S(b + 2) comes below.
        retire_wgmmas(false);
        prepare_values(s, j_block, valid_tokens_in_block(seq_len, block), me);
        advance_softmax(acc, row_max, row_sums, new_max, block_sums);
        issue_block_values(j_block, my_probs);
        if (b + 2 < num_blocks) issue_block_scores(j_block + 2);
      };
      auto receiver_step = [&](int b) {
        const int j_block = j + b, block = piece.block_begin + b;
        float new_max[2];
        RowSums block_sums;
        // P·V(b-1); S(b+1), where the scorer issued it, runs on.
        if (b + 1 < num_blocks) retire_values();
        else retire_wgmmas();
        // While the scorer runs its softmax: this half of the values.
        prepare_values(s, j_block, valid_tokens_in_block(seq_len, block), me);
        retire_wgmmas();  // S(b+1)
        receive(new_max, block_sums);
        advance_softmax(acc, row_max, row_sums, new_max, block_sums);
        issue_block_values(j_block, their_probs);
      };
      if constexpr (kSeesaw) {
        int b = 0;
        if (me == 1 && num_blocks > 0) {
          receiver_step(0);
          b = 1;
        }
        for (; b < num_blocks; b += 2) {
          scorer_step(b);
          if (b + 1 >= num_blocks) break;
          receiver_step(b + 1);
        }
      } else {
        for (int b = 0; b < num_blocks; ++b) {
          const int j_block = j + b, block = piece.block_begin + b;
          const int valid = valid_tokens_in_block(seq_len, block);
          float new_max[2];
          RowSums block_sums;
          if (me == 0) {
            // The scorer. S(b) is the only group in flight. Its P·V of the block is issued step
            // by step as the probabilities are exponentiated (issue_values_as_exponentiated; the
            // block's sums come after), and retired at once so that its part of the stage loads
            // the next-but-one block early; part 0 of S(b+1) is issued before P(b) goes to
            // consumer 1, so that consumer 1's P·V of the block runs on the tensor cores during
            // the softmax of b+1, not before that part.
            retire_wgmmas();
            mask_block(p, scores, scores, limit, block, piece.request, seq_len);
            // The probabilities of the first kSpeculativeSteps K steps are computed against the
            // running maxima before the block's maxima are known: a row's max moves only when
            // the block exceeds it by more than the slack, rare after a piece's first block, and
            // the maxima's reductions and shuffles then run among those exponentials rather
            // than before them. A warp in which a row's max does move starts again from the
            // scores (the same probabilities as without the guess).
            float exponent_base[2], factor[2] = {1.f, 1.f}, sums[2] = {0.f, 0.f};
#pragma unroll
            for (int i = 0; i < 2; ++i) exponent_base[i] = sm90::attention::exponent_base(row_max[i], kBias);
            exponentiate_steps<0, kSpeculativeSteps>(p, scores, exponent_base, my_probs, sums);
            float moved_base[2];
            block_maxima(p, scores, row_max, new_max, moved_base);
            if (warp_maxima_move(row_max, new_max)) {
              rescale_factors(row_max, new_max, factor);
              sm90::attention::scale_rows<false>(acc, factor[0], factor[1]);
#pragma unroll
              for (int i = 0; i < 2; ++i) {
                exponent_base[i] = moved_base[i];
                sums[i] = 0.f;
              }
              exponentiate_steps<0, kSpeculativeSteps>(p, scores, exponent_base, my_probs, sums);
            }
#pragma unroll
            for (int i = 0; i < 2; ++i) row_max[i] = new_max[i];
            prepare_values(s, j_block, valid, me);
            sm90::wgmma_fence();
            issue_values<0, kSpeculativeSteps>(s, j_block, me, my_probs, acc);
            issue_values_as_exponentiated<kSpeculativeSteps>(p, s, j_block, me, exponent_base, scores, my_probs, sums,
                                                             acc);
            sm90::wgmma_commit();
            block_sums = {{sums[0], sums[1]}, {sums[0], sums[1]}};
            add_block_sums(row_sums, factor, block_sums);
            write_message(new_max, block_sums);  // while the P·V runs
            retire_wgmmas();
            release_values(s, j_block, me);
            // P(b) is posted once part 0 of S(b+1) is queued: consumer 1's P·V(b) then runs
            // behind that part, and ahead of part 1 if part 1 has not landed yet, rather than
            // after the load that part 1 waits for (posting after the whole S(b+1) took 4-5 %
            // longer at H = 128 on an H100; posting before any of it, 10 % longer at H=128 q2).
            if (b + 1 < num_blocks) issue_scores(s, j_block + 1, scores, rope, post_message);
            else post_message();
          } else {
            // Nothing of this warpgroup is in flight here (its P·V retired at the end of the last
            // block), but ptxas merges this path with the scorer's, which ends with S(b+1) in
            // flight, and would put a wait for it inside the rescale that only some warps run: a
            // warpgroup instruction the warps would not execute together. This uniform wait
            // (immediate) lets it prove the rescale safe.
            sm90::wgmma_wait<0>();
            receive(new_max, block_sums);
            prepare_values(s, j_block, valid, me);
            advance_softmax(acc, row_max, row_sums, new_max, block_sums);
            issue_block_values(j_block, their_probs);
            retire_wgmmas();
            release_values(s, j_block, me);
          }
        }
      }
      retire_wgmmas();
      j += num_blocks;

      float inv[2], lse[2];
      piece_normalisers(piece.num_blocks, row_sums.exact, row_sums.weights, row_max, kBias, inv, lse);
      const uint32_t warp_stage = sm90::smem_u32(s.q) + (4 * me + warp) * kOutputStageWarpBytes;
      store_output_half(p, warp_stage, piece, rows, row_tile, acc, inv, me);
      if (me == 0) store_lse(p, piece, rows, lse);
      if (piece.slot >= 0) count_slot_writer(p, piece.slot);  // the combine may merge it
    }
  }
};

template <typename Traits, KvLoad kLoad>
__global__ void __launch_bounds__(kThreads, 1)
    decode_kernel(const __grid_constant__ CUtensorMap kv_map, const __grid_constant__ DecodeParams p) {
  using Kernel = DecodeKernel<Traits, kLoad>;
  extern __shared__ uint8_t smem_raw[];
  const typename Kernel::Smem s = Kernel::carve(smem_raw);
  if (threadIdx.x == 0) Kernel::init_barriers(s);
  __syncthreads();
  // Launched as a dependent of the schedule kernel: the set-up above overlapped it; the plan
  // (and, through it, the stream's earlier work) is complete past this point.
  sm90::grid_dependency_wait();
  // The combine kernel may be launched now: it merges each split piece once this grid has
  // counted it written (slot_handover.cuh).
  sm90::allow_dependent_launch();

  const int row_tile = blockIdx.x, part = blockIdx.y;
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    sm90::warpgroup_reg_dealloc<Kernel::kProducerRegs>();
    Kernel::Producer::run(p, &kv_map, {s.k, s.full, s.kfree}, part);
  } else {
    sm90::warpgroup_reg_alloc<Kernel::kConsumerRegs>();
    Kernel::consumer_warpgroup(p, s, row_tile, part, warpgroup - 1);
  }
}

}  // namespace speedmla::kernels::decode_sm90
