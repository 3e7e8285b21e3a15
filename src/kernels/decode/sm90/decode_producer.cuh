// The producer warpgroup of the SM90 decode kernels: brings the KV blocks of a part (plan.cuh),
// in the order BlockCursor walks them, into a ring of K stages in shared memory, each stage in
// Traits::kLoadParts parts with a `full` barrier (the part's bytes landed) and a `kfree` barrier
// (its readers are done with it) each. The consumers own what happens to the stages; the
// producer only needs their addresses (Stages).
#pragma once

#include <cuda.h>

#include <cstdint>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"
#include "kernels/decode/sm90/plan.cuh"
#include "kernels/sm90/primitives.cuh"
#include "kernels/sm90/swizzle.cuh"

namespace speedmla::kernels::decode_sm90 {

// How the producer brings the cache's rows into the K stages (config.h, min_tma_page_tokens):
// TMA boxes of whole pages, or, for pages too small for a swizzled TMA box or too small for
// TMA to be quick, cp.async copies of each row. Two instantiations rather than a run-time
// branch: the copies' code in the same kernel moved ptxas's register allocation enough to spill
// the consumers.
enum class KvLoad { kTmaPages, kCopiedRows };

// Traits: kFp8, kElemBytes, kSwizzle (the K stages' layout), kKStages, kLoadParts.
template <typename Traits, KvLoad kLoad>
struct DecodeProducer {
  static constexpr int kE = Traits::kElemBytes;
  static constexpr int kChunkRowBytes = kChunkDims * kE;             // one swizzle row
  static constexpr int kChunkBytes = kBlockTokens * kChunkRowBytes;  // a 64-row chunk
  static constexpr int kTileBytes = kNumChunks * kChunkBytes;        // one K stage
  static constexpr int kPiecesPerChunkRow = kChunkRowBytes / 16;
  static constexpr int kKStages = Traits::kKStages;
  static constexpr int kLoadParts = Traits::kLoadParts;

  // The K stages and their barriers (kKStages x kLoadParts each), generic pointers.
  struct Stages {
    uint8_t* k;
    uint64_t* full;
    uint64_t* kfree;
  };

  // The load part (see Traits::kLoadParts) holding column chunk c of a K stage: BF16's two are
  // value chunks 4-7 (part 1) and the rest (part 0).
  static constexpr __device__ int part_of_chunk(int c) {
    return kLoadParts == 1 ? 0 : (c >= kValueChunks / 2 && c < kValueChunks ? 1 : 0);
  }

  // What the producer reads from global memory to load one block: the ids of every page that
  // holds one of its tokens below seq_len (up to kMaxBoxes: pages of 16 BF16 / 32 FP8 tokens
  // are the smallest on TMA). It reads them one block ahead, so that the reads' latency (an L2
  // round trip at least) overlaps the wait for a free K stage instead of adding to every
  // stage's turnaround: read at issue, each page past a block's first cost one round trip
  // more (BF16 H=128 s_k 8K: page 32 took 1.08x page 64's time, page 16 1.18x).
  static constexpr int kMaxBoxes = kBlockTokens / min_tma_page_tokens(Traits::kFp8);
  struct BlockLoad {
    int block, valid;      // the block, its tokens below seq_len
    int page[kMaxBoxes];   // ids of the pages of its first tokens (-1: past seq_len)
  };

  static __device__ BlockLoad fetch_block_load(const DecodeParams& p, const BlockCursor& cursor) {
    BlockLoad load;
    const int request = cursor.piece().request;
    load.block = cursor.block();
    load.valid = valid_tokens_in_block(p.seq_lens[request], load.block);
    const int box_tokens = min(p.page_size, kBlockTokens);
    const int32_t* table =
        p.block_table + request * p.block_table_stride + ((load.block * kBlockTokens) >> p.page_shift);
#pragma unroll
    for (int box = 0; box < kMaxBoxes; ++box) load.page[box] = box * box_tokens < load.valid ? table[box] : -1;
    return load;
  }

  // Issues the loads of one part of a 64-token block into K stage `stage`: every page that
  // holds a token below seq_len, the part's column chunks of each.
  static __device__ void load_block_part(const DecodeParams& p, const CUtensorMap* kv_map, const Stages& s, int stage,
                                         int part, const BlockLoad& load) {
    const int box_tokens = min(p.page_size, kBlockTokens);
    const int boxes = (load.valid + box_tokens - 1) / box_tokens;
    const int in_page = (load.block * kBlockTokens) & (p.page_size - 1);  // non-zero only for pages of 128
    int part_chunks = 0;
#pragma unroll
    for (int c = 0; c < kNumChunks; ++c) part_chunks += part_of_chunk(c) == part;
    uint64_t* full = &s.full[stage * kLoadParts + part];
    sm90::mbarrier_arrive_expect_tx(full, boxes * box_tokens * part_chunks * kChunkRowBytes);
    uint8_t* dst = s.k + stage * kTileBytes;
#pragma unroll
    for (int box = 0; box < kMaxBoxes; ++box) {
      if (box >= boxes) break;
#pragma unroll
      for (int c = 0; c < kNumChunks; ++c)
        if (part_of_chunk(c) == part)
          sm90::tma_load_3d(dst + c * kChunkBytes + box * box_tokens * kChunkRowBytes, kv_map, full, c * kChunkDims,
                            in_page, load.page[box]);
    }
  }

  // Pages below min_tma_page_tokens: producer warp w < kKStages · kCopyWarpsPerStage owns K
  // stage w % kKStages and copies rows of every block that goes there (blocks w, w + kKStages,
  // ... of the part) with cp.async, into the swizzled layout TMA writes for larger pages: all
  // of them (FP8: four stages, one warp each), or (BF16: two stages, two warps each) the half
  // of the rows w / kKStages names, so that each part of a block lands in half the time. A page
  // id outside [0, num_pages) reads zeros, as TMA's bounds check gives the larger pages.
  //
  // The memory system does not make small pages slow: random 576-byte rows read at 97 % of the
  // rate of whole pages on the H200 (`speedmla-bench --read-floor`). The producer's instruction
  // stream did (FP8, B=128 s_k 8K H=16, page 1 against page 64): one row per instruction, its
  // address worked out row by row, 3.7x; the mapping below at 24 producer registers, 1.28x (BF16
  // 1.7x); the same with four steps' page ids shuffled together and 40 producer registers
  // (copy_rows_part), 1.09x (BF16 1.20x).
  // Each instruction copies one chunk row (one swizzle row, kRowLanes lanes of 16 bytes) of
  // kStepRows rows: whole 64- or 128-byte segments of global memory, one 512-byte run of shared
  // memory, and every address a constant offset from one register per row (a lane's rows share
  // their place in the page, and their swizzle phase alternates at most). The next block's page
  // ids are read while a block's copies are in flight; each lane then waits for its copies,
  // makes them visible to the consumers' wgmma (written through the generic proxy, read through
  // the async one) and arrives on the part's `full`.
  static constexpr int kRowLanes = kPiecesPerChunkRow;  // lanes per row in one copy instruction
  static constexpr int kStepRows = 32 / kRowLanes;       // rows per copy instruction

  // The rows of one block a producer lane copies from: how many are below seq_len, and the
  // page ids of rows `lane` and `lane + 32` (-1 past seq_len, whose table entries are never read).
  struct RowsToCopy {
    int valid, page_low, page_high;
  };
  static constexpr int kCopyWarpsPerStage = 4 / kKStages;
  static_assert(kLoad == KvLoad::kTmaPages || kCopyWarpsPerStage == 1 || kCopyWarpsPerStage == 2,
                "rows of a block split in halves at most");
  // Arrivals that complete a part's `full`: the TMA issuer's expect-tx, or every lane of the
  // stage's copy warps (copy_rows_producer).
  static constexpr int kFullArrivals = kLoad == KvLoad::kCopiedRows ? 32 * kCopyWarpsPerStage : 1;

  // `row_half`: the rows of the block this warp copies, 0 (rows 0-31) or 1 (32-63) where two
  // warps share a stage; the other half's page id is left at -1 (never read).
  static __device__ RowsToCopy fetch_rows(const DecodeParams& p, const BlockCursor& cursor, int lane, int row_half) {
    const int request = cursor.piece().request, block = cursor.block();
    RowsToCopy rows;
    rows.valid = valid_tokens_in_block(p.seq_lens[request], block);
    const int32_t* table = p.block_table + request * p.block_table_stride;
    const int first_token = block * kBlockTokens;
    const bool low = kCopyWarpsPerStage == 1 || row_half == 0, high = kCopyWarpsPerStage == 1 || row_half == 1;
    rows.page_low = low && lane < rows.valid ? table[(first_token + lane) >> p.page_shift] : -1;
    rows.page_high = high && lane + 32 < rows.valid ? table[(first_token + lane + 32) >> p.page_shift] : -1;
    return rows;
  }

  // Where a lane's copies go and come from, the same for every step of every block up to the
  // step's parity: a step's first row is a multiple of kStepRows and copied pages hold at most
  // 2 kStepRows tokens, so a lane's row sits at one of two places in its page (one where pages
  // hold at most kStepRows), alternating with the step's parity, as the swizzle phase of its row
  // does (BF16: 4 rows a step, 8 rows a swizzle atom).
  static_assert(min_tma_page_tokens(Traits::kFp8) / 2 <= 2 * kStepRows, "a copied page spans two steps' rows at most");
  struct LaneCopy {
    uint32_t dst[2];   // shared-memory offset of the lane's piece at step 0 and step 1
    int64_t src;       // byte offset of the lane's piece in its page at even steps
    int32_t src_odd;   // what odd steps add to src (0 where pages hold at most kStepRows tokens)
  };
  static __device__ LaneCopy lane_copy(const DecodeParams& p, int lane) {
    const int piece = lane % kRowLanes, row = lane / kRowLanes;
    LaneCopy c;
    c.dst[0] = sm90::swizzled_piece_offset<Traits::kSwizzle>(row, piece);
    c.dst[1] = sm90::swizzled_piece_offset<Traits::kSwizzle>(row + kStepRows, piece);
    const int even_row = row & (p.page_size - 1), odd_row = (row + kStepRows) & (p.page_size - 1);
    c.src = even_row * (kRowDim * kE) + piece * 16;
    c.src_odd = (odd_row - even_row) * (kRowDim * kE);
    return c;
  }

  // Issues this lane's copies of one part of a block into the K stage at `stage_smem`, four
  // steps at a time: their page ids are shuffled out together, so that the shuffles' latency is
  // paid once per group rather than once per step. Rows past seq_len in a group that holds some
  // below it have page id -1 and are zero-filled.
  static constexpr int kGroupSteps = 4;
  static __device__ void copy_rows_part(const DecodeParams& p, uint32_t stage_smem, int part, const RowsToCopy& rows,
                                        const LaneCopy& at, int lane, int row_half) {
    constexpr int kSteps = kBlockTokens / kStepRows;
    static_assert(kSteps % kGroupSteps == 0 && (32 / kStepRows) % kGroupSteps == 0,
                  "a group's rows lie on one side of row 32");
#pragma unroll
    for (int group = 0; group < kSteps / kGroupSteps; ++group) {
      const int first_step = group * kGroupSteps;
      if (first_step * kStepRows >= rows.valid) break;
      if (kCopyWarpsPerStage == 2 && (first_step * kStepRows >= 32) != (row_half == 1)) continue;
      int page[kGroupSteps];
#pragma unroll
      for (int j = 0; j < kGroupSteps; ++j) {
        const int step = first_step + j;
        page[j] = __shfl_sync(0xffffffffu, step * kStepRows < 32 ? rows.page_low : rows.page_high,
                              (step * kStepRows) % 32 + lane / kRowLanes);
      }
#pragma unroll
      for (int j = 0; j < kGroupSteps; ++j) {
        const int step = first_step + j;
        const bool present = page[j] >= 0 && page[j] < p.num_pages;
        const uint8_t* src =
            p.kv_cache + at.src + (step % 2 ? at.src_odd : 0) + (present ? page[j] * p.kv_page_stride_bytes : 0);
        const uint32_t dst = stage_smem + at.dst[step % 2] + (step - step % 2) * kStepRows * kChunkRowBytes;
#pragma unroll
        for (int c = 0; c < kNumChunks; ++c)
          if (part_of_chunk(c) == part)
            sm90::cp_async_16(dst + c * kChunkBytes, src + c * kChunkRowBytes, present ? 16u : 0u);
      }
    }
  }

  static __device__ void copy_rows_producer(const DecodeParams& p, const Stages& s, int part) {
    const int warp = (threadIdx.x / 32) % 4, lane = threadIdx.x % 32;
    if (warp >= kKStages * kCopyWarpsPerStage) return;
    const int stage = warp % kKStages, row_half = warp / kKStages;
    BlockCursor cursor(p, part);
    for (int i = 0; i < stage && cursor.valid(); ++i) cursor.advance();
    if (!cursor.valid()) return;
    const uint32_t stage_smem = sm90::smem_u32(s.k + stage * kTileBytes);
    const LaneCopy copy = lane_copy(p, lane);
    RowsToCopy rows = fetch_rows(p, cursor, lane, row_half);
    for (int round = 0;; ++round) {
      bool more = true;
#pragma unroll
      for (int load_part = 0; load_part < kLoadParts; ++load_part) {
        sm90::mbarrier_wait(&s.kfree[stage * kLoadParts + load_part], (round & 1) ^ 1);
        copy_rows_part(p, stage_smem, load_part, rows, copy, lane, row_half);
        if (load_part == kLoadParts - 1) {
          for (int i = 0; i < kKStages && cursor.valid(); ++i) cursor.advance();
          more = cursor.valid();
          if (more) rows = fetch_rows(p, cursor, lane, row_half);
        }
        sm90::cp_async_wait_all();
        sm90::fence_proxy_async_smem();
        sm90::mbarrier_arrive(&s.full[stage * kLoadParts + load_part]);
      }
      if (!more) return;
    }
  }

  // The producer warpgroup's work on part `part`. TMA pages: one thread issues all loads, up to
  // kKStages blocks ahead of the consumers; the other producer threads have nothing to do.
  // Copied rows: copy_rows_producer.
  static __device__ void run(const DecodeParams& p, const CUtensorMap* kv_map, const Stages& s, int part) {
    if constexpr (kLoad == KvLoad::kCopiedRows) {
      copy_rows_producer(p, s, part);
    } else if (threadIdx.x % kWarpgroupThreads == 0) {
      BlockCursor cursor(p, part);
      BlockLoad next = cursor.valid() ? fetch_block_load(p, cursor) : BlockLoad{};
      for (int issued = 0; cursor.valid(); ++issued) {
        const BlockLoad load = next;
        cursor.advance();
        if (cursor.valid()) next = fetch_block_load(p, cursor);
        const int stage = issued % kKStages;
#pragma unroll
        for (int part = 0; part < kLoadParts; ++part) {
          sm90::mbarrier_wait(&s.kfree[stage * kLoadParts + part], ((issued / kKStages) & 1) ^ 1);
          load_block_part(p, kv_map, s, stage, part, load);
        }
      }
    }
  }

};

}  // namespace speedmla::kernels::decode_sm90
