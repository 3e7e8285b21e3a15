// The SM90 MLA prefill kernel: ragged multi-head attention with d_qk = 192, d_v = 128, causal
// (bottom-right aligned) or not, BF16 or FP8 e4m3 tensor-core math.
//
// Persistent CTAs walk the work items in a fixed order (work_item: rounds of one item per CTA,
// alternating direction). An item is a pair of tiles (kTileRows query tokens of one head of one
// request), tile i and tile T - 1 - i of the request's T, whose causal costs add up to the same
// for every i (config.h). Heads outermost, so the CTAs running at once share one head's keys and
// values in L2; inside a head, slots from the last down (params.h says what a slot is).
//
//   warpgroup 0 (producer)   finds each tile's request (a warp-wide search over cu_seqlens_q),
//                            hands it to the consumers in shared memory with the query tile,
//                            and streams the request's key and value blocks through a ring of
//                            kStages stages by TMA (one thread issues). All four warps then make
//                            each value block ready: FP8 transposes it into the K-major V^T the
//                            P·V wgmma needs; BF16 zeroes the rows past the request's keys in its
//                            last block (P is 0 there, but 0 * NaN would not be). FP8 values
//                            that arrive transposed (PrefillFp8TransposedValuesTraits) are read
//                            as loaded, their blocks aligned to the layout's 16-token groups;
//                            only the tokens of other requests in a first or last block are
//                            zeroed.
//   warpgroups 1 and 2       the consumers, 64 query rows each, every key block of the tile:
//                            S = Q·K^T (wgmma from shared memory), masked online softmax in base
//                            2, O += P·V (P from registers). They take turns issuing their GEMMs
//                            (a named-barrier ping-pong), so one consumer's softmax runs while
//                            the tensor cores work for the other; and each issues S(j) together
//                            with P·V(j-1), so its own softmax of block j overlaps its P·V(j-1)
//                            (wholly where the traits' kWaitValuesAtLoopTop keeps ptxas from
//                            moving the wait for that P·V above the exponentials), and S(0) of
//                            its next tile right behind the last P·V of this one, so that the
//                            tile's epilogue overlaps tensor-core work too.
//
// Rows of a tile past the request's queries (and key rows past its keys) are whatever the
// tensors hold there or TMA's zeros past the tensor: scores of such keys are masked, such query
// rows are never written. Lengths read on the device are clamped to the tensors, so no
// cu_seqlens value can make the kernel read or write out of bounds.
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/prefill/sm90/config.h"
#include "kernels/prefill/sm90/params.h"
#include "kernels/sm90/attention/accumulator.cuh"
#include "kernels/sm90/attention/fp8_transpose.cuh"
#include "kernels/sm90/attention/online_softmax.cuh"
#include "kernels/sm90/attention/probabilities.cuh"
#include "kernels/sm90/attention/query_fragments.cuh"
#include "kernels/sm90/pipeline.cuh"
#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/swizzle.cuh"
#include "kernels/sm90/tensor_map.h"
#include "kernels/sm90/wgmma.cuh"
#include "speedmla/prefill.h"

namespace speedmla::kernels::prefill_sm90 {

namespace attention = sm90::attention;

struct PrefillBf16Traits {
  static constexpr bool kFp8 = false;
  static constexpr bool kValuesTransposed = false;  // V token-major, as loaded
  static constexpr int kElemBytes = 2;
  static constexpr int kStages = 2;  // 48 KB of keys + 32 KB of values each, beside a 48 KB query tile
  static constexpr sm90::SmemLayout kSwizzle = sm90::SmemLayout::kSwizzle128B;
  static constexpr sm90::TmaSwizzle kTmaSwizzle = sm90::TmaSwizzle::k128B;
  static constexpr int kMmaK = 16;
  static constexpr attention::SoftmaxConfig kSoftmax{8.f, 0.f};  // P below 2^8: far inside BF16
  // The CTA starts with 168 registers a thread (504 per lane of the three warpgroups); the
  // producer gives most of its share to the consumers (64 score + 64 output + 32 P registers).
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  static constexpr bool kQueryInRegisters = false;
  // Where the consumer waits for P·V(j - 1): see PrefillFp8TransposedValuesTraits. Here at the end
  // of block j's softmax, where ptxas hoists it to the row maxima: the wait at the loop's top
  // was 3-7 % slower back to back at H=128, 0.5 % rested (RESULTS.md, twenty-second session);
  // there ptxas sank 29 of the 32 conversions that pack P below the turn barrier, into the turn.
  static constexpr bool kWaitValuesAtLoopTop = false;
  using ScoreMma = sm90::gmma::MMA_64x128x16_F32BF16BF16_SS<sm90::gmma::Major::K, sm90::gmma::Major::K>;
  // V is read token-major as loaded: N (value dims) is its contiguous dimension.
  using ValueMma = sm90::gmma::MMA_64x128x16_F32BF16BF16_RS<sm90::gmma::Major::K, sm90::gmma::Major::MN>;
};

struct PrefillFp8Traits {
  static constexpr bool kFp8 = true;
  static constexpr bool kValuesTransposed = false;  // the producer transposes V
  static constexpr int kElemBytes = 1;
  static constexpr int kStages = 3;
  static constexpr sm90::SmemLayout kSwizzle = sm90::SmemLayout::kSwizzle64B;
  static constexpr sm90::TmaSwizzle kTmaSwizzle = sm90::TmaSwizzle::k64B;
  static constexpr int kMmaK = 32;
  // P scaled by 2^7 so small probabilities stay normal e4m3 numbers; the lazy-max slack keeps
  // P below 2^8.5 < 448 (online_softmax.cuh).
  // Every exponential on MUFU. Two of every 16 on the FMA pipe by a degree-2 polynomial (P needs
  // no MUFU precision at 2^-4 e4m3 steps) won 3 % at 1980 MHz, but a server runs prefill
  // power-capped (1600-1800 MHz), where MUFU-only, fewer instructions, won 1-2 % at 1x32K and at
  // H=16 1x16K (RESULTS.md, ninth session).
  // The normaliser is the exact FP32 sum of P. Summing P in the P·V itself (an all-ones V^T
  // column, N = 136) was tried: LSE errors grew to 0.55 on long and sharp rows, as the FP8
  // tensor cores' accumulation keeps only ~14 bits (DeepSeek-V3's finding), the worst case
  // being a large positive sum of small terms.
  static constexpr attention::SoftmaxConfig kSoftmax{1.5f, 7.f};
  // The producer's warps transpose every value block (a batch of four 16-byte loads in flight).
  static constexpr int kProducerRegs = 56;
  static constexpr int kConsumerRegs = 224;
  // The consumer's 64 query rows stay in registers for the tile (24 a thread): each S GEMM then
  // reads only the key block from shared memory, a third less than with Q there too. BF16's
  // query (48 registers) does not fit beside its P fragments.
  static constexpr bool kQueryInRegisters = true;
  // At the loop's top its consumers (224 registers) spill, and it ran ~1 % slower.
  static constexpr bool kWaitValuesAtLoopTop = false;
  using ScoreMma = sm90::gmma::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;
  using ValueMma = sm90::gmma::MMA_64x128x32_F32E4M3E4M3_RS_TN<>;
};

// FP8 with V^T arriving already transposed (prefill.h: PrefillValueLayout::kFp8Transposed; the
// positions of each 16-token group in the P fragments' order, probabilities.cuh): the P·V reads
// each value block as TMA wrote it. Without the V^T buffers (56 KB) a fourth stage fits.
struct PrefillFp8TransposedValuesTraits : PrefillFp8Traits {
  static constexpr bool kValuesTransposed = true;
  static constexpr int kStages = 4;
  // The producer only loads (and zeroes the foreign tokens of a first or last block), as BF16's;
  // the consumers' 8 more registers make room for the wait below without a spill.
  static constexpr int kProducerRegs = 40;
  static constexpr int kConsumerRegs = 232;
  // The wait for P·V(j - 1) opens iteration j + 1 instead of closing iteration j: written at
  // the end of block j's softmax, ptxas hoisted it to the row maxima, so the block's
  // exponentials waited for P·V(j - 1) instead of running under it; ptxas does not move it
  // across the loop's back edge. At H=128 1x16K 2 % faster rested and 4-6 % back to back, 1-3 %
  // at 1x8K, 2-3 % at H=16 1x16K; 16x1K within 1 % (RESULTS.md, twenty-second session).
  static constexpr bool kWaitValuesAtLoopTop = true;
};

// What the producer hands the consumers about a tile (and, with num_blocks = -1, that no tile
// is left).
struct TileInfo {
  int head;
  int q_begin;     // the request's first q row
  int len_q;       // its queries (clamped to the tensor)
  int m0;          // the tile's first query, within the request
  int len_k;       // its keys (clamped to the tensor)
  int k_begin;     // its first k row
  // Transposed values: the packed tokens of the request's first key block before k_begin
  // (blocks start on the layout's 16-token groups: k_begin - key_offset is a multiple of 16);
  // 0 otherwise. Key index i of block j is the request's key 128 j + i - key_offset.
  int key_offset;
  int num_blocks;  // key blocks the tile needs (causal: up to its last query's diagonal)
};

template <typename Traits>
struct PrefillKernel {
  static constexpr bool kFp8 = Traits::kFp8;
  static constexpr bool kValuesTransposed = Traits::kValuesTransposed;
  static constexpr bool kTransposeOnChip = kFp8 && !kValuesTransposed;  // the producer makes V^T
  static_assert(!kValuesTransposed || kFp8, "only FP8 values arrive transposed");
  static constexpr int kStages = Traits::kStages;
  static constexpr int kRowBytes = kChunkDims * Traits::kElemBytes;  // one swizzle row
  static_assert(kRowBytes == (kFp8 ? 64 : 128), "a chunk row must be exactly one swizzle span");
  static constexpr int kChunkBytes = kTileRows * kRowBytes;  // 128 rows of one chunk (Q tile or K/V block)
  static_assert(kTileRows == kBlockKeys, "Q tiles and K/V blocks share the chunk size");
  static constexpr int kRowGroupBytes = 8 * kRowBytes;  // wgmma stride-dimension offset
  static constexpr int kScoreStepsPerChunk = kChunkDims / Traits::kMmaK;
  static constexpr int kValueSteps = kBlockKeys / Traits::kMmaK;
  static constexpr int kAccRegs = kVDim / 2;        // 64 x 128 FP32 over 128 threads
  static constexpr int kScoreRegs = kBlockKeys / 2;  // 64 x 128 FP32
  static constexpr int kProbRegs = attention::kProbabilityRegs<kFp8, kScoreRegs>;
  static constexpr bool kQueryInRegisters = Traits::kQueryInRegisters;
  static constexpr bool kWaitValuesAtLoopTop = Traits::kWaitValuesAtLoopTop;
  // The query's A fragments: four registers per score K step (none when Q is read from shared memory).
  static constexpr int kQueryRegs = kQueryInRegisters ? 4 * kQkChunks * kScoreStepsPerChunk : 1;

  // FP8 V^T: 128 value dims x 128 token positions in core matrices of 8 dims x 16 positions,
  // kVtCoreStride apart along the positions (16 bytes of padding each) and kVtGroupStride apart
  // along the dims (not a multiple of 128: conflict-free stmatrix, fp8_transpose.cuh).
  static constexpr int kVtCoreStride = 144;
  static constexpr int kVtGroupStride = (kBlockKeys / 16) * kVtCoreStride + 16;
  static constexpr int kVtStageBytes = (kVDim / 8) * kVtGroupStride;

  static constexpr int kOutStageBytes = 16 * (kVDim / 2) * 2;  // 16 rows x 64 BF16 value dims
  static constexpr int kQBytes = kQkChunks * kChunkBytes;
  static constexpr int kKBytes = kQkChunks * kChunkBytes;
  static constexpr int kVBytes = kVChunks * kChunkBytes;
  static_assert(!kValuesTransposed || (kVDim == kTileRows && kVChunks * 64 == kBlockKeys),
                "transposed values: a chunk is 128 dim rows of 64 token positions, two a block");
  // The transposed values' token groups (the P fragments' position order repeats every 16).
  static constexpr int kValueGroupTokens = kFp8TransposedGroupTokens;

  // Named barriers (0 is __syncthreads): consumer c may issue its GEMMs once barrier
  // kBarTurn0 + c completes, i.e. once the other consumer has issued its own.
  static constexpr uint32_t kBarTurn0 = 1;
  static constexpr int kTurnThreads = 2 * kWarpgroupThreads;
  // BF16: the producer warpgroup meets here once the issuer has seen a partial value block land
  // (prepare_values).
  static constexpr uint32_t kBarTailLanded = 3;

  static_assert(Traits::kProducerRegs + 2 * Traits::kConsumerRegs == 3 * 168 && Traits::kConsumerRegs % 8 == 0,
                "register budgets must add up to what the CTA is launched with");

  struct alignas(1024) SharedStorage {
    // Every tile buffer starts on a 1024-byte boundary (swizzle atoms); sizes are multiples.
    uint8_t q[kQBytes];
    uint8_t k[kStages][kKBytes];
    // As loaded: token-major (BF16: the P·V's operand; FP8: the transposes' source), or
    // transposed values: kVChunks chunks of 128 dim rows x 64 token positions, the K-major
    // operand itself.
    uint8_t v[kStages][kVBytes];
    alignas(16) uint8_t vt[kTransposeOnChip ? kStages : 1][kTransposeOnChip ? kVtStageBytes : 16];
    // Each consumer warp's output rows pass through here on their way out (store_tile): half
    // of its 16 rows' value dims at a time, so that the stores to global memory are whole
    // 128-byte row segments rather than 16-byte pieces of eight rows.
    alignas(128) uint8_t out_stage[2][4][kOutStageBytes];
    TileInfo tile;
    uint64_t q_full, q_free;
    uint64_t k_full[kStages], k_free[kStages];
    uint64_t v_landed[kStages];   // TMA bytes of the value block arrived
    uint64_t v_ready[kStages];    // readable by the P·V (transposed / tail zeroed)
    uint64_t v_free[kStages];     // the consumers' P·V of the stage's block completed
    uint64_t v_raw_free[kStages]; // FP8 transposed on chip: the transposes have read the loaded block
  };
  static constexpr int kSmemBytes = sizeof(SharedStorage) + 1024;  // + alignment of the dynamic base
  static_assert(kSmemBytes <= 227 * 1024, "prefill shared memory exceeds the SM90 limit");

  // Offsetting the __shared__ array itself (not a generic integer round trip) lets the compiler
  // keep every access in the shared window (LDS/STS rather than generic loads).
  static __device__ SharedStorage& carve(uint8_t* raw) {
    return *reinterpret_cast<SharedStorage*>(raw + ((1024u - (sm90::smem_u32(raw) & 1023u)) & 1023u));
  }

  static __device__ void init_barriers(SharedStorage& s) {
    sm90::mbarrier_init(&s.q_full, 1);
    // Barriers that order ordinary shared-memory accesses (the tile record, V^T, zeroed rows)
    // count every thread that made them: each thread's release orders its own accesses, with no
    // reliance on warp-synchronous cumulativity. Those that guard tensor-core and TMA traffic
    // only count one lane per warp, after the warp's wgmma wait.
    sm90::mbarrier_init(&s.q_free, 2 * kWarpgroupThreads);  // after the consumers' last score GEMM of the tile
    for (int i = 0; i < kStages; ++i) {
      sm90::mbarrier_init(&s.k_full[i], 1);
      sm90::mbarrier_init(&s.k_free[i], 8);
      sm90::mbarrier_init(&s.v_landed[i], 1);
      sm90::mbarrier_init(&s.v_ready[i], kWarpgroupThreads);  // every producer thread
      sm90::mbarrier_init(&s.v_free[i], 8);
      sm90::mbarrier_init(&s.v_raw_free[i], kWarpgroupThreads);
    }
    sm90::fence_barrier_init();
  }

  // ---------------------------------------------------------------------------------------
  // Tiles
  // ---------------------------------------------------------------------------------------

  // The request and head of work item `linear` (all of `t` but m0 and num_blocks); returns the
  // item's pair index within the request, or -1 for an idle slot. Called by a whole warp: the
  // request is found by a 32-way search over cu_seqlens_q (two rounds up to 1024 requests).
  static __device__ int find_item(const PrefillParams& p, int64_t linear, TileInfo& t) {
    const int lane = threadIdx.x % 32;
    const int head = static_cast<int>(linear / p.num_slots);
    const int slot = p.num_slots - 1 - static_cast<int>(linear % p.num_slots);
    // The request is the last b whose first slot, cu_q[b] / kPairRows + b, is <= slot: that
    // function of b increases strictly for valid cu_seqlens, and the search needs only that it
    // is monotone to end in [0, B) (invalid values give a wrong request, never a wild access).
    int lo = 0, hi = p.batch - 1;
    while (true) {
      const int step = (hi - lo + 32) / 32;  // ceil((hi - lo + 1) / 32)
      const int b = lo + lane * step;
      const bool at_or_below = b <= hi && __ldg(p.cu_seqlens_q + b) / kPairRows + b <= slot;
      const uint32_t ballot = __ballot_sync(0xffffffffu, at_or_below);
      if (ballot == 0) return -1;  // cu_seqlens_q[0] > 0: no request
      const int last = 31 - __clz(ballot);
      if (step == 1) {
        lo += last;
        break;
      }
      lo += last * step;
      hi = min(hi, lo + step - 1);
    }
    const int b = lo;
    const int slot_begin = __ldg(p.cu_seqlens_q + b) / kPairRows + b;  // <= slot (the search's condition)
    int q_begin = __ldg(p.cu_seqlens_q + b), q_end = __ldg(p.cu_seqlens_q + b + 1);
    int k_begin = __ldg(p.cu_seqlens_k + b), k_end = __ldg(p.cu_seqlens_k + b + 1);
    // Ends clamped before subtracting: an end near INT_MIN must give an empty request, not a
    // length that wrapped to ~2^31.
    q_begin = min(max(q_begin, 0), p.total_q);
    q_end = min(max(q_end, q_begin), p.total_q);
    k_begin = min(max(k_begin, 0), p.total_k);
    k_end = min(max(k_end, k_begin), p.total_k);
    t.head = head;
    t.q_begin = q_begin;
    t.len_q = q_end - q_begin;
    t.k_begin = k_begin;
    t.len_k = k_end - k_begin;
    t.key_offset = kValuesTransposed ? k_begin % kValueGroupTokens : 0;
    // In 64 bits: with a garbage cu_seqlens_q the slot can lie ~2^23 items past its request's first.
    const int64_t item = static_cast<int64_t>(slot) - slot_begin;
    return item * kPairRows < t.len_q ? static_cast<int>(item) : -1;
  }

  // Points `t` at tile `tile` (kTileRows queries from tile * kTileRows) of its request.
  static __device__ void set_tile(const PrefillParams& p, TileInfo& t, int tile) {
    t.m0 = tile * kTileRows;
    int visible = t.len_k;
    if (p.causal) {
      const int last_query = t.m0 + min(kTileRows, t.len_q - t.m0) - 1;
      visible = min(visible, max(t.len_k - t.len_q + last_query + 1, 0));  // no int overflow
    }
    t.num_blocks = visible > 0 ? (visible + t.key_offset + kBlockKeys - 1) / kBlockKeys : 0;
  }

  // The tokens of key block `block` that are the request's: [first, end) in block coordinates
  // (first > 0 only in block 0 with transposed values; end past kBlockKeys for a full block).
  struct BlockTokens {
    int first, end;
    __device__ bool complete() const { return first == 0 && end >= kBlockKeys; }
  };
  static __device__ BlockTokens block_tokens(const TileInfo& t, int block) {
    return {block == 0 ? t.key_offset : 0, t.len_k + t.key_offset - block * kBlockKeys};
  }

  // This CTA's work item in round `round` of the persistent loop. Rounds alternate direction
  // (CTA c takes item c of even rounds and item G - 1 - c of odd ones): one request's items cost
  // alike, but requests of different lengths do not, and a CTA that drew a long request's item in
  // one round tends to draw a shorter one in the next.
  static __device__ int64_t work_item(int round) {
    const unsigned in_round = round % 2 == 0 ? blockIdx.x : gridDim.x - 1 - blockIdx.x;
    return static_cast<int64_t>(round) * gridDim.x + in_round;
  }

  // ---------------------------------------------------------------------------------------
  // Producer
  // ---------------------------------------------------------------------------------------

  // Issues the loads of one key/value block (thread 0 of the producer only).
  static __device__ void load_block(const CUtensorMap* k_map, const CUtensorMap* v_map, SharedStorage& s,
                                    sm90::PipelineState<kStages> at, int kv_head, int first_key) {
    const int stage = at.stage();
    sm90::mbarrier_wait(&s.k_free[stage], at.free_parity());
    sm90::mbarrier_arrive_expect_tx(&s.k_full[stage], kKBytes);
#pragma unroll
    for (int c = 0; c < kQkChunks; ++c)
      sm90::tma_load_3d(s.k[stage] + c * kChunkBytes, k_map, &s.k_full[stage], c * kChunkDims, kv_head, first_key);
    // The value buffer is free once the P·V that read it completed (BF16, transposed values),
    // or once the transposes that read it did (FP8 transposed on chip: the P·V reads V^T).
    sm90::mbarrier_wait(kTransposeOnChip ? &s.v_raw_free[stage] : &s.v_free[stage], at.free_parity());
    sm90::mbarrier_arrive_expect_tx(&s.v_landed[stage], kVBytes);
#pragma unroll
    for (int c = 0; c < kVChunks; ++c) {
      if constexpr (kValuesTransposed)  // the map's dims: token positions, value dims, heads
        sm90::tma_load_3d(s.v[stage] + c * kChunkBytes, v_map, &s.v_landed[stage], first_key + 64 * c, 0, kv_head);
      else
        sm90::tma_load_3d(s.v[stage] + c * kChunkBytes, v_map, &s.v_landed[stage], c * kChunkDims, kv_head, first_key);
    }
  }

  // Transposed values: zeroes the positions of this thread's dim row (one per producer thread)
  // whose tokens are outside [first, end) of the block (another request's values, or the
  // layout's padding: P is 0 there, but 0 * NaN would not be). fp8_transposed_value_token says
  // which token a position holds; piece p of a 64-byte row r sits at p ^ ((r >> 1) & 3).
  static __device__ void zero_foreign_positions(uint32_t values, int first, int end) {
    const int r = static_cast<int>(threadIdx.x % kWarpgroupThreads);
#pragma unroll 1  // first and last blocks only: kept short
    for (int group = 0; group < kBlockKeys / kValueGroupTokens; ++group) {
      const int lo = first - kValueGroupTokens * group, hi = end - kValueGroupTokens * group;
      if (lo <= 0 && hi >= kValueGroupTokens) continue;  // the whole group is the request's
      uint32_t keep[4] = {0u, 0u, 0u, 0u};  // a byte mask per 4 positions
#pragma unroll
      for (int position = 0; position < kValueGroupTokens; ++position) {
        const int token = fp8_transposed_value_token(position);
        if (token >= lo && token < hi) keep[position / 4] |= 0xffu << (8 * (position % 4));
      }
      const int chunk = group / 4, piece = group % 4;
      const uint32_t at = values + chunk * kChunkBytes + r * 64 + ((piece ^ ((r >> 1) & 3)) << 4);
      const uint4 v = sm90::ld_shared_v4(at);
      sm90::st_shared_v4(at, make_uint4(v.x & keep[0], v.y & keep[1], v.z & keep[2], v.w & keep[3]));
    }
  }

  // Makes a landed value block readable by the P·V: all four producer warps, in the same order
  // of blocks. FP8 transposes every block: each thread waits for its landing itself and arrives
  // on v_raw_free, which the issuer waits for before it reloads the stage, so no thread can fall
  // a whole phase of a stage behind (a parity wait two phases late would take the later phase
  // for its own, and zero or transpose a block TMA has not written yet, or hang at the end).
  // BF16 and transposed values read a complete block as loaded (wait_values) and have nothing to
  // do for it; only a partial block's foreign tokens are zeroed (BF16: the tail rows; transposed
  // values: zero_foreign_positions). No one waits for the other producer threads until then, so
  // they must not track v_landed's phases themselves: the issuer, who cannot lag (it reloads a
  // stage only after making this call for the block the stage held), waits for the landing and
  // lets them go through a named barrier.
  static __device__ void prepare_values(SharedStorage& s, sm90::PipelineState<kStages> at, BlockTokens tokens) {
    const int stage = at.stage();
    const int valid = tokens.end;  // token-major values: first is 0
    if constexpr (kTransposeOnChip) {
      // Lane addresses are rebuilt per block (sm90::thread_index_here): held across the producer's
      // loops they left it short of registers.
      const uint32_t tid = sm90::thread_index_here();
      const int warp = static_cast<int>(tid / 32), lane = static_cast<int>(tid % 32);
      sm90::mbarrier_wait(&s.v_landed[stage], at.full_parity());
      sm90::mbarrier_wait(&s.v_free[stage], at.free_parity());  // the P·V that read this V^T stage
      const uint32_t src = sm90::smem_u32(s.v[stage]), vt = sm90::smem_u32(s.vt[stage]);
      constexpr int kSteps = kVDim / 32;
#pragma unroll
      for (int g = 0; g < 2; ++g) {
        const int group = 2 * warp + g;
        if (valid >= kBlockKeys)
          attention::transpose_fp8_values<kChunkBytes, kVtCoreStride, kVtGroupStride, kSteps, 4, false>(src, 0, vt, 0,
                                                                                                       group, valid, lane);
        else
          attention::transpose_fp8_values<kChunkBytes, kVtCoreStride, kVtGroupStride, kSteps, 4, true>(src, 0, vt, 0,
                                                                                                      group, valid, lane);
      }
      sm90::mbarrier_arrive(&s.v_raw_free[stage]);
    } else {
      if (tokens.complete()) return;
      if (threadIdx.x == 0) sm90::mbarrier_wait(&s.v_landed[stage], at.full_parity());
      __syncwarp();  // bar.sync wants the whole warp converged
      sm90::named_barrier_sync(kBarTailLanded, kWarpgroupThreads);
      const uint32_t values = sm90::smem_u32(s.v[stage]);
      if constexpr (kValuesTransposed) {
        zero_foreign_positions(values, tokens.first, tokens.end);
      } else {
        const int pieces = (kBlockKeys - valid) * (kRowBytes / 16);  // per chunk; whole rows, so no swizzle
        for (int i = threadIdx.x; i < kVChunks * pieces; i += kWarpgroupThreads)
          sm90::st_shared_v4(values + (i / pieces) * kChunkBytes + valid * kRowBytes + (i % pieces) * 16,
                             make_uint4(0u, 0u, 0u, 0u));
      }
    }
    sm90::fence_proxy_async_smem();  // generic writes, then wgmma reads them
    sm90::mbarrier_arrive(&s.v_ready[stage]);
  }

  static __device__ void producer(const PrefillParams& p, const CUtensorMap* q_map, const CUtensorMap* k_map,
                                  const CUtensorMap* v_map, SharedStorage& s) {
    const bool issuer = threadIdx.x == 0;
    sm90::PipelineState<kStages> blocks;
    uint32_t tiles = 0;
    // At most 2^23 + B slots of 128 heads: the rounds fit an int.
    for (int round = 0; static_cast<int64_t>(round) * gridDim.x < p.total_items; ++round) {
      const int64_t linear = work_item(round);
      if (linear >= p.total_items) continue;
      TileInfo t;
      const int pair = find_item(p, linear, t);
      if (pair < 0) continue;
      const int kv_head = t.head / p.head_group;
      // The pair's heavier tile first; the middle tile of an odd count is a pair on its own.
      const int heavy = (t.len_q + kTileRows - 1) / kTileRows - 1 - pair;
      for (int k = 0; k < (heavy > pair ? 2 : 1); ++k) {
        set_tile(p, t, k == 0 ? heavy : pair);
        if (issuer) {
          if (tiles > 0) sm90::mbarrier_wait(&s.q_free, (tiles - 1) & 1);
          s.tile = t;  // published by the arrive below (release), read after the consumers' wait
          sm90::mbarrier_arrive_expect_tx(&s.q_full, kQBytes);
#pragma unroll
          for (int c = 0; c < kQkChunks; ++c)
            sm90::tma_load_3d(s.q + c * kChunkBytes, q_map, &s.q_full, c * kChunkDims, t.head, t.q_begin + t.m0);
        }
        ++tiles;
        // Block j's loads go out before block j - 1 is made ready, so that the transposes of one
        // block overlap the next one's transfer.
        for (int j = 0; j < t.num_blocks; ++j) {
          const sm90::PipelineState<kStages> at{blocks.count + j};
          if (issuer) load_block(k_map, v_map, s, at, kv_head, t.k_begin - t.key_offset + j * kBlockKeys);
          if (j > 0) prepare_values(s, sm90::PipelineState<kStages>{at.count - 1}, block_tokens(t, j - 1));
        }
        if (t.num_blocks > 0)
          prepare_values(s, sm90::PipelineState<kStages>{blocks.count + t.num_blocks - 1},
                         block_tokens(t, t.num_blocks - 1));
        blocks.advance(t.num_blocks);
      }
    }
    if (issuer) {
      if (tiles > 0) sm90::mbarrier_wait(&s.q_free, (tiles - 1) & 1);
      s.tile.num_blocks = -1;
      sm90::mbarrier_arrive(&s.q_full);
    }
  }

  // ---------------------------------------------------------------------------------------
  // Consumers
  // ---------------------------------------------------------------------------------------

  // The A fragments of this consumer's 64 query rows (kQueryInRegisters): four registers per
  // score step (32 features).
  static __device__ void load_query(SharedStorage& s, int me, uint32_t (&query)[kQueryRegs]) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    attention::load_a_fragments<Traits::kSwizzle, kQkChunks, kScoreStepsPerChunk>(
        sm90::smem_u32(s.q), kChunkBytes, me * kConsumerRows + 16 * warp, lane, query);
  }

  // S = Q·K^T of this consumer's 64 rows against the key block at `keys` (a K stage): one wgmma
  // group, each step's descriptors one 32-bit add away from the base ones.
  static __device__ void issue_scores(SharedStorage& s, const uint8_t* keys, int me, const uint32_t (&query)[kQueryRegs],
                                      float (&scores)[kScoreRegs]) {
    const uint64_t q_desc =
        sm90::make_smem_desc(s.q + me * kConsumerRows * kRowBytes, 16, kRowGroupBytes, Traits::kSwizzle);
    const uint64_t k_desc = sm90::make_smem_desc(keys, 16, kRowGroupBytes, Traits::kSwizzle);
    sm90::wgmma_fence();
#pragma unroll
    for (int c = 0; c < kQkChunks; ++c)
#pragma unroll
      for (int step = 0; step < kScoreStepsPerChunk; ++step) {
        const uint32_t offset = c * kChunkBytes + step * 32;
        if constexpr (kQueryInRegisters)
          sm90::mma_rs<typename Traits::ScoreMma>(&query[4 * (c * kScoreStepsPerChunk + step)],
                                                  sm90::desc_advance(k_desc, offset), scores, c + step > 0);
        else
          sm90::mma_ss<typename Traits::ScoreMma>(sm90::desc_advance(q_desc, offset),
                                                  sm90::desc_advance(k_desc, offset), scores, c + step > 0);
      }
    sm90::wgmma_commit();
  }

  // O (+)= P·V of the block in value stage `stage`; the tile's first P·V (accumulate false)
  // overwrites O, so the accumulators need no zeroing between tiles.
  static __device__ void issue_values(SharedStorage& s, int stage, const uint32_t (&probs)[kProbRegs],
                                      float (&acc)[kAccRegs], bool accumulate) {
    sm90::wgmma_fence();
    if constexpr (kValuesTransposed) {
      // K-major like a key block: 128 dim rows (N) of 64 token positions a chunk, two 32-position
      // steps a chunk.
      const uint64_t desc = sm90::make_smem_desc(s.v[stage], 16, kRowGroupBytes, Traits::kSwizzle);
#pragma unroll
      for (int step = 0; step < kValueSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step],
                                                sm90::desc_advance(desc, (step / 2) * kChunkBytes + (step % 2) * 32),
                                                acc, accumulate || step > 0);
    } else if constexpr (kFp8) {
      const uint64_t desc =
          sm90::make_smem_desc(s.vt[stage], kVtCoreStride, kVtGroupStride, sm90::SmemLayout::kInterleave);
#pragma unroll
      for (int step = 0; step < kValueSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step], sm90::desc_advance(desc, 2 * step * kVtCoreStride),
                                                acc, accumulate || step > 0);
    } else {
      // MN-major V: N runs along the 64-dim chunks (leading offset: one chunk), K along tokens
      // (stride offset: 8 rows).
      const uint64_t desc = sm90::make_smem_desc(s.v[stage], kChunkBytes, kRowGroupBytes, Traits::kSwizzle);
#pragma unroll
      for (int step = 0; step < kValueSteps; ++step)
        sm90::mma_rs<typename Traits::ValueMma>(&probs[4 * step],
                                                sm90::desc_advance(desc, step * Traits::kMmaK * kRowBytes), acc,
                                                accumulate || step > 0);
    }
    sm90::wgmma_commit();
  }

  // Keys a row may not see become -inf: those at or past its limit (the request's keys, and
  // under the causal mask its diagonal), in block coordinates (limits shifted by the tile's
  // key_offset), and with transposed values the packed tokens before the request's first
  // (`lower`, in block 0). Only blocks that reach a limit of this thread's rows pay for it.
  static __device__ void mask_block(float (&scores)[kScoreRegs], int block, const int (&limit)[2], int lower) {
    const int first = block * kBlockKeys;
    if (first + kBlockKeys <= min(limit[0], limit[1]) && (!kValuesTransposed || first >= lower)) return;
    const int base = first + 2 * (threadIdx.x % 4);
#pragma unroll
    for (int n = 0; n < kScoreRegs / 4; ++n)
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int key = base + 8 * n + e;
        const bool foreign = kValuesTransposed && key < lower;
        if (key >= limit[0] || foreign) scores[4 * n + e] = -INFINITY;
        if (key >= limit[1] || foreign) scores[4 * n + 2 + e] = -INFINITY;
      }
  }

  // Waits until value block `block` of the tile (in pipeline position `at`) may be read by the
  // P·V. FP8 transposed on chip reads the producer's V^T (v_ready completes once per use of a
  // stage). BF16 and transposed values read the block as TMA wrote it, so a complete block
  // waits for the transfer alone: the producer works
  // on a block only after issuing the next block's loads, which wait for an earlier P·V of both
  // consumers — that would put the other consumer's softmax on this one's path. A partial block
  // waits for its zeroed foreign tokens: v_ready completes only for those, so its phases are
  // counted per stage in `tail_phases` (a bit per stage; at most one is pending per stage, as the
  // stage is not reloaded before this P·V has read it).
  static __device__ void wait_values(SharedStorage& s, sm90::PipelineState<kStages> at, const TileInfo& t, int block,
                                     uint32_t& tail_phases) {
    const int stage = at.stage();
    if constexpr (kTransposeOnChip) {
      sm90::mbarrier_wait(&s.v_ready[stage], at.full_parity());
    } else if (block_tokens(t, block).complete()) {
      sm90::mbarrier_wait(&s.v_landed[stage], at.full_parity());
    } else {
      sm90::mbarrier_wait(&s.v_ready[stage], (tail_phases >> stage) & 1u);
      tail_phases ^= 1u << stage;
    }
  }

  static __device__ void release(uint64_t* bar) {
    if (threadIdx.x % 32 == 0) sm90::mbarrier_arrive(bar);
  }

  // Waits for the consumers' `tiles`-th tile record (num_blocks -1: no tile is left) and copies
  // it: the producer rewrites it only after both consumers' last score GEMM of the tile.
  static __device__ TileInfo next_tile(SharedStorage& s, uint32_t tiles) {
    sm90::mbarrier_wait(&s.q_full, tiles & 1);
    return s.tile;
  }

  // Issues S(0) of tile `t`, whose first key block is pipeline position `at`, in this consumer's
  // turn, then retires every older wgmma group (the last P·V of the tile before) while S(0) runs
  // on. A tile without keys, and the end, get the same GEMM over the query tile alone, outside
  // the turns, its scores unused: with a wgmma group issued on one path of a branch and not the
  // other, ptxas serialised every wgmma of the kernel. The consumers release the query tile only
  // once that group has retired, so nothing overwrites it meanwhile.
  static __device__ void start_tile(SharedStorage& s, const TileInfo& t, sm90::PipelineState<kStages> at, int me,
                                    uint32_t (&query)[kQueryRegs], float (&scores)[kScoreRegs]) {
    const bool keys = t.num_blocks > 0;
    if constexpr (kQueryInRegisters) load_query(s, me, query);
    if (keys) {
      sm90::mbarrier_wait(&s.k_full[at.stage()], at.full_parity());
      sm90::named_barrier_sync(kBarTurn0 + me, kTurnThreads);
    }
    issue_scores(s, keys ? s.k[at.stage()] : s.q, me, query, scores);
    if (keys) sm90::named_barrier_arrive(kBarTurn0 + (1 - me), kTurnThreads);
    sm90::wgmma_wait<1>();
  }

  // Each consumer runs one chain of GEMMs across its tiles: S(0) of the next tile is issued
  // right behind the last P·V of the current one, so the tensor cores work on it while this
  // consumer writes the current tile out (store_tile) — at 1K-token requests the epilogue and
  // the first block's lone S GEMM were a third of the consumers' time.
  static __device__ void consumer(const PrefillParams& p, SharedStorage& s, int me) {
    using Softmax = attention::OnlineSoftmax<Traits::kSoftmax>;
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    const uint32_t my_turn = kBarTurn0 + me, their_turn = kBarTurn0 + (1 - me);
    float acc[kAccRegs];
    float scores[kScoreRegs];
    uint32_t probs[kProbRegs];
    uint32_t query[kQueryRegs];  // kQueryInRegisters: this tile's query fragments (start_tile)
    Softmax softmax;
    sm90::PipelineState<kStages> blocks;
    uint32_t tail_phases = 0;  // BF16: wait_values
    // Consumer 0 issues first; its last turn is matched by a final wait below.
    if (me == 1) sm90::named_barrier_arrive(kBarTurn0, kTurnThreads);

    // Retires every wgmma group of this warpgroup. The register fences tell the compiler the
    // accumulators, P and the query are live up to here: a P·V reads P, an S GEMM the query,
    // asynchronously.
    auto retire_all = [&] {
      sm90::wgmma_wait<0>();
      sm90::fence_registers(acc);
      sm90::fence_registers(scores);
      sm90::fence_registers(probs);
      sm90::fence_registers(query);
    };

    // One place issues every tile's S(0) (start_tile, below): with more, ptxas joined their score
    // registers with moves and serialised every wgmma of the kernel.
    uint32_t tiles = 0;
    TileInfo t{};
    t.num_blocks = -1;  // no tile before the first
    while (true) {
      // This thread's rows (within the request) and the keys each may see.
      int row[2], limit[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) {
        row[i] = t.m0 + me * kConsumerRows + 16 * warp + lane / 4 + 8 * i;
        limit[i] = (p.causal ? min(t.len_k, max(t.len_k - t.len_q + row[i] + 1, 0)) : t.len_k) +
                   (kValuesTransposed ? t.key_offset : 0);
      }
      const int lower = kValuesTransposed ? t.key_offset : 0;
      softmax.reset();
      float factor[2];
      const int n = t.num_blocks;
      const sm90::PipelineState<kStages> last{blocks.count + max(n, 1) - 1};  // the tile's last block
      if (n == 0) {
        retire_all();  // the stand-in S(0) of start_tile reads the query tile
        sm90::mbarrier_arrive(&s.q_free);
      }
      if (n > 0) {
        // Block 0: its S (issued by start_tile), softmax only.
        int stage = blocks.stage();
        retire_all();
        release(&s.k_free[stage]);
        if (n == 1) sm90::mbarrier_arrive(&s.q_free);
        mask_block(scores, 0, limit, lower);
        softmax.step(scores, p.score_scale_log2, factor);
        if constexpr (!kWaitValuesAtLoopTop) attention::pack_probabilities<kFp8>(scores, probs);
        // Retires the last P·V issued (if there was one), frees its value stage and packs the
        // probabilities in `scores` for the next P·V.
        auto retire_values_and_pack = [&](bool issued, int value_stage) {
          retire_all();
          if (issued) release(&s.v_free[value_stage]);
          attention::pack_probabilities<kFp8>(scores, probs);
        };
        // The stage of the block before `blocks`: the one the last P·V read.
        auto previous_stage = [&] { return sm90::PipelineState<kStages>{blocks.count - 1}.stage(); };
        for (int j = 1; j < n; ++j) {
          if constexpr (kWaitValuesAtLoopTop) retire_values_and_pack(j > 1, previous_stage());
          const sm90::PipelineState<kStages> previous = blocks;
          blocks.advance();
          stage = blocks.stage();
          sm90::mbarrier_wait(&s.k_full[stage], blocks.full_parity());
          sm90::named_barrier_sync(my_turn, kTurnThreads);
          issue_scores(s, s.k[stage], me, query, scores);
          if (j > 1) attention::scale_rows<true>(acc, factor[0], factor[1]);  // to block j - 1's maxima
          wait_values(s, previous, t, j - 1, tail_phases);
          issue_values(s, previous.stage(), probs, acc, j > 1);
          sm90::named_barrier_arrive(their_turn, kTurnThreads);
          // S(j) is the older group in flight: wait for it alone; P·V(j - 1) runs on while
          // the softmax of block j does.
          sm90::wgmma_wait<1>();
          sm90::fence_registers(scores);
          sm90::fence_registers(query);
          release(&s.k_free[stage]);
          if (j == n - 1) sm90::mbarrier_arrive(&s.q_free);
          mask_block(scores, j, limit, lower);
          softmax.step(scores, p.score_scale_log2, factor);
          if constexpr (!kWaitValuesAtLoopTop) retire_values_and_pack(true, previous.stage());
        }
        // Unconditional: a wait on one path only made ptxas serialise every wgmma (C7514).
        if constexpr (kWaitValuesAtLoopTop) retire_values_and_pack(n > 1, previous_stage());
        if (n > 1) attention::scale_rows<false>(acc, factor[0], factor[1]);
        wait_values(s, last, t, n - 1, tail_phases);
        issue_values(s, last.stage(), probs, acc, n > 1);
        blocks.advance();
      }
      const TileInfo next = next_tile(s, tiles++);
      start_tile(s, next, blocks, me, query, scores);  // and retires the last P·V
      sm90::fence_registers(acc);
      sm90::fence_registers(probs);
      if (n > 0) release(&s.v_free[last.stage()]);
      if (n >= 0) store_tile(p, s, me, t, row, softmax, acc);
      if (next.num_blocks < 0) break;
      t = next;
    }
    retire_all();  // start_tile's stand-in S(0) for the end
    if (me == 0) sm90::named_barrier_sync(my_turn, kTurnThreads);
  }

  // Normalises and writes this thread's two rows of the tile (those inside the request): BF16
  // out (x output_scale) and the LSE. Rows that saw no key get 0 and -inf; rows with a NaN score
  // get NaN. The warp's 16 rows go out through its staging buffer, half of the value dims at a
  // time: stmatrix puts the fragments in row order (16-byte chunks XOR-swizzled by row: neither
  // side has bank conflicts), then each lane stores 16-byte pieces, four whole 128-byte row
  // segments a warp instruction.
  static __device__ void store_tile(const PrefillParams& p, SharedStorage& s, int me, const TileInfo& t,
                                    const int (&row)[2],
                                    const typename attention::OnlineSoftmax<Traits::kSoftmax>& softmax,
                                    const float (&acc)[kAccRegs]) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    bool seen[2];
    float scale[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
      const float sum = attention::quad_sum(softmax.row_sum[i]);
      seen[i] = softmax.has_output(i, sum);  // a NaN sum gives NaN rows
      scale[i] = seen[i] ? p.output_scale / sum : 0.f;
      if (p.lse != nullptr && lane % 4 == 0 && row[i] < t.len_q)
        p.lse[(t.q_begin + row[i]) * p.lse_stride_token + static_cast<int64_t>(t.head) * p.lse_stride_head] =
            softmax.lse(i, sum);
    }
    auto pack_row = [&](int n, int i) {
      return seen[i] ? sm90::pack_bf16x2(acc[4 * n + 2 * i] * scale[i], acc[4 * n + 2 * i + 1] * scale[i]) : 0u;
    };
    auto swizzled = [](int r, int chunk) { return r * 128 + ((chunk ^ (r % 8)) * 16); };
    const uint32_t stage = sm90::smem_u32(s.out_stage[me][warp]);
    const int first_row = t.m0 + me * kConsumerRows + 16 * warp;  // the warp's row 0, within the request
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      // Matrix mm of stmatrix m holds rows 8 (mm % 2) .. + 7, dims 8 (8 half + 2 m + mm / 2) .. + 7;
      // lane l gives the address of row l % 8 of matrix l / 8.
#pragma unroll
      for (int m = 0; m < 4; ++m) {
        const int n = 8 * half + 2 * m;
        const uint4 v = make_uint4(pack_row(n, 0), pack_row(n, 1), pack_row(n + 1, 0), pack_row(n + 1, 1));
        sm90::stmatrix_x4(stage + swizzled(8 * (lane / 8 % 2) + lane % 8, 2 * m + lane / 16), v);
      }
      __syncwarp();
      // All four pieces are read before the first store, so the stores do not each wait for
      // their own shared-memory load.
      uint4 pieces[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) pieces[k] = sm90::ld_shared_v4(stage + swizzled(4 * k + lane / 8, lane % 8));
      __syncwarp();  // the next half overwrites the buffer
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        const int r = 4 * k + lane / 8;
        if (first_row + r < t.len_q)
          store_out_piece(p.out + (t.q_begin + first_row + r) * p.out_stride_token +
                              static_cast<int64_t>(t.head) * p.out_stride_head + 64 * half + 8 * (lane % 8),
                          pieces[k], p.out_aligned16);
      }
    }
  }

  // 16 bytes of output; `aligned`: the address is 16-byte aligned (else 4-byte, as validated).
  static __device__ void store_out_piece(uint16_t* dst, uint4 v, bool aligned) {
    if (aligned) {
      sm90::st_global_v4(dst, v);
    } else {
      uint32_t* words = reinterpret_cast<uint32_t*>(dst);
      words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
    }
  }
};

template <typename Traits>
__global__ void __launch_bounds__(kThreads, 1)
    prefill_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                   const __grid_constant__ CUtensorMap v_map, const __grid_constant__ PrefillParams p) {
  using Kernel = PrefillKernel<Traits>;
  extern __shared__ uint8_t smem_raw[];
  typename Kernel::SharedStorage& s = Kernel::carve(smem_raw);
  if (threadIdx.x == 0) Kernel::init_barriers(s);
  __syncthreads();
  const int warpgroup = threadIdx.x / kWarpgroupThreads;
  if (warpgroup == 0) {
    sm90::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    Kernel::producer(p, &q_map, &k_map, &v_map, s);
  } else {
    sm90::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    Kernel::consumer(p, s, warpgroup - 1);
  }
}

}  // namespace speedmla::kernels::prefill_sm90
