// Layout of the caller-provided decode workspace. Host and device share it, so the size
// reported by mla_decode_workspace_size is exactly what the launcher carves up.
#pragma once

#include <cstddef>
#include <cstdint>

#include "kernels/decode/sm90/config.h"
#include "kernels/decode/sm90/params.h"

namespace speedmla::kernels::decode_sm90 {

struct WorkspaceLayout {
  int num_row_tiles = 0;
  int num_parts = 0;
  int num_slots = 0;
  int max_split_requests = 0;  // a split request takes at least two slots, and is one of the batch
  size_t header_offset = 0, plans_offset = 0, part_first_offset = 0, split_requests_offset = 0;
  size_t slot_writers_offset = 0, combine_finished_offset = 0;
  size_t partial_lse_offset = 0, partial_out_offset = 0, total_bytes = 0;
};

inline size_t align_up(size_t value, size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// One CTA per SM: the row tiles of a request run side by side (they share its KV through L2),
// and each row tile's work is cut into runs of equal length of the batch's unit sequence, at
// most num_parts of them (the schedule kernel picks the length, never below the even split).
// A request cut into k > 1 pieces stores k partial results. Every cut inside a request adds at
// most two such results (one per side), and there are at most num_parts - 1 cuts, so
// 2 * (num_parts - 1) slots always suffice, whatever the sequence lengths.
// The batch-invariant policy (split_blocks > 0) cuts each request into pieces of split_blocks
// blocks, so a batch whose requests all hold max_blocks blocks needs
// batch * ceil(max_blocks / split_blocks) slots when that ceiling exceeds 1 (none otherwise); the
// layout holds the larger of the two bounds, so that one workspace serves both policies.
inline WorkspaceLayout workspace_layout(int64_t batch, int64_t num_heads, int64_t q_len, int num_sms,
                                        int64_t split_blocks = 0, int64_t max_blocks = 0) {
  WorkspaceLayout w;
  const int64_t rows = num_heads * q_len;
  w.num_row_tiles = static_cast<int>((rows + kTileRows - 1) / kTileRows);
  w.num_parts = num_sms / w.num_row_tiles > 1 ? num_sms / w.num_row_tiles : 1;
  if (w.num_parts > kMaxParts) w.num_parts = kMaxParts;
  w.num_slots = 2 * (w.num_parts - 1);
  if (split_blocks > 0) {
    const int64_t blocks = max_blocks > 1 ? max_blocks : 1;
    const int64_t pieces = (blocks + split_blocks - 1) / split_blocks;
    if (pieces > 1 && batch * pieces > w.num_slots) w.num_slots = static_cast<int>(batch * pieces);
  }
  w.max_split_requests = static_cast<int>(batch < w.num_slots / 2 ? batch : w.num_slots / 2);
  size_t offset = 0;
  w.header_offset = offset;
  offset = align_up(offset + sizeof(PlanHeader), 256);
  w.plans_offset = offset;
  offset = align_up(offset + sizeof(RequestPlan) * static_cast<size_t>(batch), 256);
  w.part_first_offset = offset;
  offset = align_up(offset + sizeof(int) * static_cast<size_t>(w.num_parts), 256);
  w.split_requests_offset = offset;
  offset = align_up(offset + sizeof(SplitRequest) * static_cast<size_t>(w.max_split_requests), 256);
  w.slot_writers_offset = offset;
  offset = align_up(offset + sizeof(int) * static_cast<size_t>(w.num_slots), 256);
  w.combine_finished_offset = offset;
  offset = align_up(offset + sizeof(int) * static_cast<size_t>(w.max_split_requests), 256);
  w.partial_lse_offset = offset;
  offset = align_up(offset + sizeof(float) * static_cast<size_t>(w.num_slots) * rows, 256);
  w.partial_out_offset = offset;
  offset = align_up(offset + sizeof(float) * static_cast<size_t>(w.num_slots) * rows * kLatentDim, 256);
  w.total_bytes = offset;
  return w;
}

// What a partial-result slot costs, in units of the time a part spends on one KV block: a slot
// is written by the main kernel and read back by the combine kernel, 2 * rows * 512 FP32
// values, while each of the num_parts parts streams blocks of 64 cache rows. When memory
// is the limit (few heads), both share its bandwidth, so S slots delay the operation as much
// as S * slot_bytes / (num_parts * block_bytes) more blocks per part would. With many heads
// the blocks cost compute too, and the figure overstates slots a little: the plan then keeps
// whole requests together a little more readily than it needs to.
inline float split_slot_cost(int64_t num_rows, int elem_bytes, int num_parts) {
  const double rows = static_cast<double>(num_rows < kTileRows ? num_rows : kTileRows);
  const double slot_bytes = 2.0 * rows * kLatentDim * sizeof(float);
  const double block_bytes = static_cast<double>(kBlockTokens) * kRowDim * elem_bytes;
  return static_cast<float>(slot_bytes / (block_bytes * num_parts));
}

}  // namespace speedmla::kernels::decode_sm90
