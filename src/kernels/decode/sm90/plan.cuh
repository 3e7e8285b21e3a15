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

// Every request costs at least one unit so that some CTA writes its (possibly empty) output.
__device__ __forceinline__ int request_units(int num_blocks) { return num_blocks > 1 ? num_blocks : 1; }

// Number of parts (splits) a request is cut into.
__device__ __forceinline__ int request_num_splits(const RequestPlan& plan, int units_per_part) {
  const int last_part = (plan.first_unit + request_units(plan.num_blocks) - 1) / units_per_part;
  return last_part - plan.first_part + 1;
}

// One request's share of a part: KV blocks [block_begin, block_end) and where the result goes.
struct PartPiece {
  int request;
  int block_begin, block_end;
  int num_blocks;    // of the whole request (-1: invalid request)
  int slot;          // partial-result slot, or -1 when this piece is the whole request
};

// Walks the pieces of one part in order. Usage:
//   for (PartWalker w(p, part); w.valid(); w.next()) { PartPiece piece = w.piece(); ... }
class PartWalker {
 public:
  __device__ PartWalker(const DecodeParams& p, int part) : p_(p) {
    const PlanHeader header = *p.plan_header;
    units_per_part_ = header.units_per_part;
    unit_begin_ = part * units_per_part_;
    unit_end_ = min(unit_begin_ + units_per_part_, header.total_units);
    part_ = part;
    request_ = unit_begin_ < unit_end_ ? p.part_first_request[part] : p.batch;
    load();
  }
  __device__ bool valid() const { return request_ < p_.batch && plan_.first_unit < unit_end_; }
  __device__ void next() {
    ++request_;
    load();
  }
  __device__ PartPiece piece() const {
    PartPiece piece;
    piece.request = request_;
    piece.num_blocks = plan_.num_blocks;
    const int lo = max(unit_begin_, plan_.first_unit) - plan_.first_unit;
    const int hi = min(unit_end_, plan_.first_unit + request_units(plan_.num_blocks)) - plan_.first_unit;
    const int blocks = plan_.num_blocks > 0 ? plan_.num_blocks : 0;
    piece.block_begin = min(lo, blocks);
    piece.block_end = min(hi, blocks);
    piece.slot = plan_.split_slot >= 0 ? plan_.split_slot + (part_ - plan_.first_part) : -1;
    return piece;
  }

 private:
  __device__ void load() {
    if (request_ < p_.batch) plan_ = p_.plans[request_];
  }
  const DecodeParams& p_;
  RequestPlan plan_{};
  int units_per_part_ = 1, unit_begin_ = 0, unit_end_ = 0, part_ = 0, request_ = 0;
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
