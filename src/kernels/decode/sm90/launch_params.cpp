// DecodeParams of a validated launch: every pointer and stride the three kernels see, the
// workspace carved by the same layout mla_decode_workspace_size reports.
#include <cstdint>

#include "kernels/decode/sm90/launch.h"

namespace speedmla::kernels::decode_sm90 {

DecodeParams make_decode_params(const DecodeLaunch& launch) {
  DecodeParams p{};
  p.batch = launch.batch;
  p.q_len = launch.q_len;
  p.num_heads = launch.num_heads;
  p.num_rows = p.q_len * p.num_heads;
  p.num_row_tiles = launch.layout.num_row_tiles;
  p.num_parts = launch.layout.num_parts;
  p.page_size = launch.page_size;
  p.page_shift = __builtin_ctz(static_cast<unsigned>(launch.page_size));
  p.max_pages = launch.max_pages;
  p.q = launch.q;
  p.q_stride_batch = launch.q_stride_batch;
  p.q_stride_token = launch.q_stride_token;
  p.q_stride_head = launch.q_stride_head;
  p.block_table = launch.block_table;
  p.block_table_stride = launch.block_table_stride;
  p.seq_lens = launch.seq_lens;
  p.kv_cache = static_cast<const uint8_t*>(launch.kv_cache);
  p.kv_page_stride_bytes = launch.kv_page_stride * (launch.fp8 ? 1 : 2);
  p.num_pages = static_cast<int>(launch.num_pages);
  p.causal_seqs = launch.causal_seqs;
  p.cp_rank = launch.cp_rank;
  p.cp_world_division = division_magic(static_cast<uint32_t>(launch.cp_world));
  p.out = launch.out;
  p.out_stride_batch = launch.out_stride_batch;
  p.out_stride_token = launch.out_stride_token;
  p.out_stride_head = launch.out_stride_head;
  p.lse = launch.lse;
  p.lse_stride_batch = launch.lse_stride_batch;
  p.lse_stride_token = launch.lse_stride_token;
  p.lse_stride_head = launch.lse_stride_head;
  auto* base = static_cast<uint8_t*>(launch.workspace);
  p.plan_header = reinterpret_cast<PlanHeader*>(base + launch.layout.header_offset);
  p.plans = reinterpret_cast<RequestPlan*>(base + launch.layout.plans_offset);
  p.part_first_request = reinterpret_cast<int*>(base + launch.layout.part_first_offset);
  p.partial_lse = reinterpret_cast<float*>(base + launch.layout.partial_lse_offset);
  p.partial_out = reinterpret_cast<float*>(base + launch.layout.partial_out_offset);
  p.num_slots = launch.layout.num_slots;
  p.split_requests = reinterpret_cast<SplitRequest*>(base + launch.layout.split_requests_offset);
  p.max_split_requests = launch.layout.max_split_requests;
  p.slot_writers = reinterpret_cast<int*>(base + launch.layout.slot_writers_offset);
  p.combine_finished = reinterpret_cast<int*>(base + launch.layout.combine_finished_offset);
  p.slot_cost_blocks = split_slot_cost(p.num_rows, launch.fp8 ? 1 : 2, launch.layout.num_parts);
  p.split_units = launch.split_units;
  p.score_scale_log2 = launch.softmax_scale * 1.4426950408889634f;  // log2(e)
  p.output_scale = launch.output_scale;
  return p;
}

}  // namespace speedmla::kernels::decode_sm90
