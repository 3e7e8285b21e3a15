// Device-side view of the split-KV plan: which (request, KV block) pairs a CTA part processes.
// The schedule kernel writes the plan, the main kernel walks it, the combine kernel reads it;
// all three use these helpers so that they can never disagree.
#pragma once

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"

namespace speedmla::kernels::decode_sm90 {

// KV blocks of a request, or -1 when seq_len is outside [0, max_pages * page_size]: such a
// request produces NaN instead of reading past its block-table row.
__device__ __forceinline__ int request_num_blocks(const DecodeParams& p, int seq_len) {
  const bool valid = seq_len >= 0 && static_cast<int64_t>(seq_len) <=
                                         static_cast<int64_t>(p.max_pages) * p.page_size;
  return valid ? (seq_len + kBlockTokens - 1) / kBlockTokens : -1;
}

// Tokens of KV block `block` below seq_len (the block's last may be partial).
__device__ __forceinline__ int valid_tokens_in_block(int seq_len, int block) {
  return min(kBlockTokens, seq_len - block * kBlockTokens);
}

// Keys row i of a context-parallel request sees (decode.h): this rank's share of the global
// causal window, ceil((causal - rank - (q_len - 1) + t) / world), clamped to [max(0, limit),
// seq_len] where limit = seq_len - (q_len - 1) + t is the plain window of the local keys. A
// causal_seqs consistent with seq_len always lies inside, so the clamp only decides what an
// inconsistent one gives, and keeps every row's bound at or above the plain one: blocks the
// plain window shows whole need no masking either way. Computed only where a block is
// masked, from a fresh load of causal_seqs: a per-piece value held through the block loop
// costs the FP8 consumer registers it does not have (it spilled).
__device__ __forceinline__ int context_parallel_limit(const DecodeParams& p, int request, int seq_len, int limit) {
  // (causal - rank) + (t - (q_len - 1)): each part inside int (causal clamped to >= 0, rank <
  // 2^16, q_len <= 1024). Local key k (global rank + k·world) is seen iff k·world < global.
  const int global = (max(p.causal_seqs[request], 0) - p.cp_rank) + (limit - seq_len);
  const uint32_t n = static_cast<uint32_t>(global - 1);
  const int last = static_cast<int>((__umulhi(n, p.cp_world_division.magic) + n) >> p.cp_world_division.shift);
  return min(seq_len, max(limit, global <= 0 ? 0 : last + 1));
}

// Every request costs at least one unit so that some CTA writes its (possibly empty) output.
__device__ __forceinline__ int request_units(int num_blocks) { return num_blocks > 1 ? num_blocks : 1; }

// Number of pieces (splits) a request is cut into: those of the unit sequence's runs of
// piece_units (PlanHeader) that hold one of its units.
__device__ __forceinline__ int request_num_splits(const RequestPlan& plan, int piece_units) {
  const int last_piece = (plan.first_unit + request_units(plan.num_blocks) - 1) / piece_units;
  return last_piece - plan.first_piece + 1;
}

// One request's share of a part: KV blocks [block_begin, block_end) and where the result goes.
struct PartPiece {
  int request;
  int block_begin, block_end;
  int num_blocks;    // of the whole request (-1: invalid request)
  int slot;          // partial-result slot, or -1 when this piece is the whole request
};

// Walks the pieces of one part in order: its units [unit_begin, unit_end), cut where a request
// ends and at every multiple of piece_units (in the balanced policy that is the part's own
// end, so a piece is a request's share of the part). Usage:
//   for (PartWalker w(p, part); w.valid(); w.next()) { PartPiece piece = w.piece(); ... }
class PartWalker {
 public:
  __device__ PartWalker(const DecodeParams& p, int part) : p_(p) {
    const PlanHeader header = *p.plan_header;
    piece_units_ = header.piece_units;
    const int unit_begin = part * header.units_per_part;
    unit_end_ = min(unit_begin + header.units_per_part, header.total_units);
    request_ = unit_begin < unit_end_ ? p.part_first_request[part] : p.batch;
    load(unit_begin);
  }
  __device__ bool valid() const { return request_ < p_.batch && unit_ < unit_end_; }
  __device__ void next() {
    unit_ = piece_end();
    if (unit_ >= request_end()) {
      ++request_;
      load(unit_);  // the next request starts at or after this one's end
    } else {
      cut_ += piece_units_;
      if (slot_ >= 0) ++slot_;
    }
  }
  __device__ PartPiece piece() const {
    PartPiece piece;
    piece.request = request_;
    piece.num_blocks = num_blocks_;
    const int blocks = num_blocks_ > 0 ? num_blocks_ : 0;
    piece.block_begin = min(unit_ - first_unit_, blocks);
    piece.block_end = min(piece_end() - first_unit_, blocks);
    piece.slot = slot_;
    return piece;
  }

 private:
  __device__ int request_end() const { return first_unit_ + request_units(num_blocks_); }
  __device__ int piece_end() const { return min(min(unit_end_, request_end()), cut_); }
  // Enters request_, its first piece in this part starting at max(unit, its first unit). The
  // divisions happen once per request; the request's later pieces step cut_ and slot_.
  __device__ void load(int unit) {
    if (request_ >= p_.batch) return;
    const RequestPlan plan = p_.plans[request_];
    first_unit_ = plan.first_unit;
    num_blocks_ = plan.num_blocks;
    unit_ = max(unit, plan.first_unit);
    const int piece = unit_ / piece_units_;
    cut_ = (piece + 1) * piece_units_;
    slot_ = plan.split_slot >= 0 ? plan.split_slot + (piece - plan.first_piece) : -1;
  }
  const DecodeParams& p_;
  int piece_units_ = 1, unit_end_ = 0, request_ = 0;
  int first_unit_ = 0, num_blocks_ = 0;  // of request_
  int unit_ = 0;   // the current piece's first unit
  int cut_ = 0;    // the next multiple of piece_units_ after unit_
  int slot_ = -1;  // the current piece's partial-result slot, -1 when it is the whole request
};

// Walks the KV blocks of one part in order, skipping pieces without blocks: the sequence the
// producer loads and the consumers consume, block counter by block counter.
class BlockCursor {
 public:
  __device__ BlockCursor(const DecodeParams& p, int part) : walker_(p, part) { enter_piece(); }
  __device__ bool valid() const { return walker_.valid(); }
  __device__ void advance() {
    if (++block_ >= piece_.block_end) {
      walker_.next();
      enter_piece();
    }
  }
  __device__ const PartPiece& piece() const { return piece_; }
  __device__ int block() const { return block_; }

 private:
  __device__ void enter_piece() {
    for (; walker_.valid(); walker_.next()) {
      piece_ = walker_.piece();
      block_ = piece_.block_begin;
      if (block_ < piece_.block_end) return;
    }
  }
  PartWalker walker_;
  PartPiece piece_{};
  int block_ = 0;
};

}  // namespace speedmla::kernels::decode_sm90
