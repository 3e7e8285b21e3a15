// Host entry of the SM90 decode: plan, main kernel, combine — three launches on one stream (or
// the plan alone, or the other two on a plan made earlier), no allocation, no host synchronisation. The launcher owns every kernel detail: it fills the
// DecodeParams, encodes the cache's TMA map from the kernel traits and sets the kernel's
// shared-memory opt-in; the API layer (src/api/decode.cpp) only validates and dispatches.
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>

#include <cstdint>

#include "kernels/decode/sm90/params.h"
#include "kernels/decode/sm90/workspace.h"

namespace speedmla::kernels::decode_sm90 {

// A validated mla_decode call, as plain pointers, element strides and sizes (mla_decode checked
// every one of them: shapes, dtypes, alignment, ranges, the workspace size).
struct DecodeLaunch {
  bool fp8;                  // FP8 e4m3 q and cache; otherwise BF16
  int batch, q_len, num_heads;
  int page_size;             // power of two, 8..128
  int max_pages;             // block_table row length
  int64_t num_pages;         // < 2^31
  const void* q;             // [B, q_len, H, 576]
  int64_t q_stride_batch, q_stride_token, q_stride_head;
  const void* kv_cache;      // [num_pages, page_size, 576]
  int64_t kv_page_stride;    // elements between pages (rows inside a page are contiguous)
  const int32_t* block_table;  // [B, max_pages]
  int64_t block_table_stride;
  const int32_t* seq_lens;   // [B]
  const int32_t* causal_seqs = nullptr;  // [B] or nullptr: decode context parallelism off
  int cp_world = 1, cp_rank = 0;         // 1 and 0 when off
  uint16_t* out;             // [B, q_len, H, 512] BF16 bits
  int64_t out_stride_batch, out_stride_token, out_stride_head;
  float* lse;                // [B, q_len, H] or nullptr
  int64_t lse_stride_batch, lse_stride_token, lse_stride_head;
  void* workspace;           // layout.total_bytes or more, 256-byte aligned
  WorkspaceLayout layout;    // workspace_layout(batch, num_heads, q_len, SMs of the device[, split])
  float softmax_scale, output_scale;
  int split_units;           // the planner's policy: 0 balanced, > 0 batch-invariant (DecodeParams)
};

// What failed, if anything: encoding the cache's TMA map (a CUresult), or a CUDA call (the
// opt-in or a launch). Both zero on success.
struct DecodeLaunchStatus {
  int tensor_map = 0;
  cudaError_t cuda = cudaSuccess;
};

// The kernels' parameters of a launch (launch_params.cpp).
DecodeParams make_decode_params(const DecodeLaunch& launch);

// The main kernel of one element type (one .cu per instantiation). prepare_* encodes the
// cache's TMA map with the kernel traits' swizzle and box and sets the kernel's shared-memory
// opt-in on the current device; launch_* launches it.
// The *_copied_rows instantiations serve pages below min_tma_page_tokens (no TMA map).
// FP8 requests of at most 16 / 32 query rows (num_heads · q_len), TMA pages: the narrow kernel
// (decode_narrow_kernel.cuh).
DecodeLaunchStatus prepare_decode_fp8_narrow16(const DecodeLaunch& launch, CUtensorMap* kv_map);
DecodeLaunchStatus prepare_decode_fp8_narrow32(const DecodeLaunch& launch, CUtensorMap* kv_map);
cudaError_t launch_decode_fp8_narrow16(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
cudaError_t launch_decode_fp8_narrow32(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
DecodeLaunchStatus prepare_decode_fp8(const DecodeLaunch& launch, CUtensorMap* kv_map);
DecodeLaunchStatus prepare_decode_bf16(const DecodeLaunch& launch, CUtensorMap* kv_map);
DecodeLaunchStatus prepare_decode_fp8_copied_rows(const DecodeLaunch& launch, CUtensorMap* kv_map);
DecodeLaunchStatus prepare_decode_bf16_copied_rows(const DecodeLaunch& launch, CUtensorMap* kv_map);
cudaError_t launch_decode_fp8(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
cudaError_t launch_decode_bf16(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
cudaError_t launch_decode_fp8_copied_rows(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream);
cudaError_t launch_decode_bf16_copied_rows(const CUtensorMap& kv_map, const DecodeParams& params,
                                           cudaStream_t stream);

// Which launches of the operation run: all three; the planner alone, writing the plan into the
// workspace (mla_decode_plan: only the sizes, seq_lens, the workspace and split_units of the
// launch are read); or the main kernel and the combine on a plan that the planner wrote
// into this workspace earlier on the stream (mla_decode_with_plan).
enum class DecodeSteps { kAll, kPlan, kWithPlan };

// Schedule + main + combine (or the part `steps` names) on the current device. The map and the
// opt-in come first: when either fails nothing is launched.
DecodeLaunchStatus run_decode(const DecodeLaunch& launch, cudaStream_t stream, DecodeSteps steps = DecodeSteps::kAll);

}  // namespace speedmla::kernels::decode_sm90
