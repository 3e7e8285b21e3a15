// The whole contract between the decode launcher and its three kernels (schedule, main,
// combine): every pointer, stride and size they see. Built and validated on the host
// (launch_params.cpp, from what src/api/decode.cpp validated), passed by value.
#pragma once

#include <cstdint>

namespace speedmla::kernels::decode_sm90 {

// Division of n in [0, 2^31) by a divisor d in [1, 2^16] fixed for a launch, without a division
// instruction: n / d = (umulhi(n, magic) + n) >> shift, shift = ceil(log2 d), magic =
// floor(2^32 (2^shift - d) / d) + 1 (Granlund and Montgomery's round-up method; the sum stays
// below 2^32 since umulhi(n, magic) <= n < 2^31). An integer division by a register takes a
// dozen instructions and several temporaries, enough to make the register-tight FP8 consumer
// spill; this takes three.
struct DivisionMagic {
  uint32_t magic;
  int shift;
};

inline DivisionMagic division_magic(uint32_t divisor) {  // divisor >= 1
  int shift = 0;
  while ((uint32_t{1} << shift) < divisor) ++shift;
  const uint64_t magic = (uint64_t{1} << 32) * ((uint64_t{1} << shift) - divisor) / divisor + 1;
  return {static_cast<uint32_t>(magic), shift};
}

// Split-KV plan of one request, written by the schedule kernel.
struct RequestPlan {
  int first_unit;    // index of the request's first work unit in the batch-wide unit sequence
  int num_blocks;    // KV blocks of kBlockTokens tokens; 0 for an empty request; -1 if invalid
  int first_piece;   // first_unit / piece_units: the plan's piece holding the request's first unit
  int split_slot;    // first partial-result slot when num_splits > 1; -1 otherwise
};

// Batch-wide numbers of the plan.
struct PlanHeader {
  int total_units;     // work units of the batch (see schedule.cu: each request's max(1, num_blocks),
                       // rounded up to a multiple of split_units in the batch-invariant policy)
  int units_per_part;  // chosen by the schedule kernel, >= ceil(total_units / num_parts)
  // Pieces are cut at every multiple of piece_units in the unit sequence: units_per_part in
  // the balanced policy (a part's pieces are its requests), split_units in the batch-invariant
  // one (a part may hold several pieces of one request; each has its own partial result).
  int piece_units;
  int num_split_requests;  // entries of DecodeParams::split_requests written by this plan
};

// A request the plan cut into num_splits > 1 pieces, whose partial results lie in slots
// [slot, slot + num_splits): the combine kernel's work list, compact so that none of its CTAs
// searches the batch for split requests.
struct SplitRequest {
  int request;
  int slot;
  int num_splits;
};

struct DecodeParams {
  // ---- problem sizes
  int batch;
  int q_len;
  int num_heads;
  int num_rows;        // q_len * num_heads: query rows per request, row = token * H + head
  int num_row_tiles;   // ceil(num_rows / kTileRows)
  int num_parts;       // CTAs per row tile: the split-KV partitions of the unit sequence
  int page_size;       // tokens per page (power of two, 1..128)
  int page_shift;      // log2(page_size)
  int max_pages;       // block_table row length; seq_len > max_pages * page_size is invalid

  // ---- inputs
  const void* q;       // [B, q_len, H, 576] element strides below; 16-byte aligned rows
  int64_t q_stride_batch, q_stride_token, q_stride_head;
  const int32_t* block_table;  // [B, max_pages]
  int64_t block_table_stride;
  const int32_t* seq_lens;     // [B]
  // The cache itself, for pages below min_tma_page_tokens, which the producer copies row by row
  // (larger pages come through the TMA map instead).
  const uint8_t* kv_cache;     // [num_pages, page_size, 576]
  int64_t kv_page_stride_bytes;
  int num_pages;
  // Decode context parallelism (speedmla/decode.h), off when causal_seqs is nullptr: row t of
  // request b sees local keys k < ceil((causal_seqs[b] - cp_rank - (q_len - 1) + t) / cp_world),
  // clamped to [max(0, seq_len - (q_len - 1) + t), seq_len]. 1 <= cp_world <= 2^16
  // (kMaxDecodeContextParallelWorld), 0 <= cp_rank < cp_world.
  const int32_t* causal_seqs;  // [B] global KV lengths, or nullptr
  int cp_rank;
  DivisionMagic cp_world_division;  // division by cp_world

  // ---- outputs
  uint16_t* out;       // [B, q_len, H, 512] BF16 bits; last dim contiguous
  int64_t out_stride_batch, out_stride_token, out_stride_head;
  float* lse;          // [B, q_len, H] or nullptr
  int64_t lse_stride_batch, lse_stride_token, lse_stride_head;

  // ---- workspace (see workspace.h)
  PlanHeader* plan_header;
  RequestPlan* plans;          // [B]
  int* part_first_request;     // [num_parts]: the request holding the part's first unit
  float* partial_out;          // [num_slots, num_rows, 512] normalised partial outputs
  float* partial_lse;          // [num_slots, num_rows] natural log
  int num_slots;
  SplitRequest* split_requests;  // [max_split_requests], the first PlanHeader::num_split_requests valid
  int max_split_requests;
  // Completion counters, zero between operations (the schedule kernel zeroes them, the combine
  // leaves them zero). slot_writers[slot]: the main kernel's consumer warps, over all row tiles,
  // that have written their rows of that slot (kSlotWriterWarps * num_row_tiles when complete):
  // the combine merges a piece as soon as it is complete, while the main kernel still runs.
  // combine_finished[index]: the combine CTAs done with split request `index`; the last one
  // zeroes both for that request.
  int* slot_writers;           // [num_slots]
  int* combine_finished;       // [max_split_requests]

  // ---- scalars
  // What one partial-result slot costs, in units of the time a part spends on one KV block:
  // the schedule kernel weighs it against longer parts (split_slot_cost in workspace.h).
  float slot_cost_blocks;
  // 0: the balanced policy (the schedule kernel weighs part sizes over the whole batch). > 0:
  // the batch-invariant policy: every request is cut into pieces of split_units KV blocks,
  // counted from its own first block, whatever else is in the batch.
  int split_units;
  float score_scale_log2;      // softmax_scale * log2(e): scores in base-2 units
  float output_scale;
};

}  // namespace speedmla::kernels::decode_sm90
