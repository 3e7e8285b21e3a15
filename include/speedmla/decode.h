// speedmla/decode.h — MLA decode and speculative verify over a paged latent KV cache.
//
// The "absorbed" form of Multi-head Latent Attention: every head's query lives in the 576-wide
// latent space (512 latent + 64 rope dims); keys are whole cache rows, values their first 512
// columns, and the output stays in latent space (the model applies W_UV afterwards).
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "speedmla/tensor.h"

namespace speedmla {

inline constexpr int kLatentDim = 512;                      // kv_lora_rank; also the output width
inline constexpr int kRopeDim = 64;                         // qk_rope_head_dim
inline constexpr int kCacheRowDim = kLatentDim + kRopeDim;  // 576: one cache row, one query row
inline constexpr int kMaxDecodeHeads = 128;

// Page sizes the decode kernels support: the powers of two from 1 to 128 (contract §3). Others
// (non-powers of two, above 128) are refused by mla_decode with an Error; the CPU reference takes
// any size.
bool decode_page_size_supported(int64_t page_size);

inline constexpr int kMaxDecodeQLen = 1024;  // query tokens per request (decode + draft)

// GPU bound on the batch: B * max(1, ceil(max_pages * page_size / 64)) < kMaxDecodeBlocks, the
// 64-token blocks the split-KV planner may have to count (in 32-bit integers). For example
// B < 2^24 with tables of 4096 tokens, B < 2^19 with tables of 128K tokens.
inline constexpr int64_t kMaxDecodeBlocks = int64_t{1} << 30;

// Bytes of workspace mla_decode needs on a GPU with `num_sms` multiprocessors for a batch of
// `batch` requests, `num_heads` heads and `q_len` query tokens per request. It is an upper bound
// that does not depend on sequence lengths, so a caller can allocate once for the largest batch
// and reuse the buffer (also inside CUDA-graph capture). The buffer needs no initialisation.
// Throws Error unless batch >= 1, 1 <= num_heads <= 128, 1 <= q_len <= 1024, num_sms >= 1.
size_t mla_decode_workspace_size(int64_t batch, int64_t num_heads, int64_t q_len, int num_sms);

// Number of multiprocessors of CUDA device `device` (cached after the first query; no sync).
int device_sm_count(int device);

// Decode context parallelism: the KV of each request is spread over `world` ranks round-robin
// by token, rank r holding global tokens r, r + world, r + 2·world, ... in its own paged cache
// (so its seq_lens[b] is the LOCAL length, ceil((global length - r) / world) for a full share).
// Each rank's mla_decode then returns its partial (out, lse); merging the ranks' partials by
// their LSE (merge_attn_states pairwise on [B·q_len, H, 512] views, or speedmla.cp in Python) gives the
// single-rank result over the whole request.
//
//   causal_seqs  [B] int32, contiguous, on q's device: the GLOBAL KV length of each request
//                (including its q_len new tokens). Read on the device only. Any value is
//                memory-safe: it only moves each row's bound inside the request (below).
//   world        number of ranks, 1 <= world <= kMaxDecodeContextParallelWorld.
//   rank         this rank, 0 <= rank < world.
// mla_decode throws Error naming context_parallel.causal_seqs, .world or .rank when one breaks
// these rules (causal_seqs must also not overlap out or lse).
//
// Query token t of request b then sees local keys
//   k < clamp(ceil((causal_seqs[b] - rank - (q_len - 1) + t) / world), lo, seq_lens[b]),
//   lo = max(0, seq_lens[b] - (q_len - 1) + t)   (the plain window of the local keys),
// i.e. exactly the global keys g = rank + k·world of the causal window g < causal_seqs[b] -
// (q_len - 1) + t. A causal_seqs[b] consistent with seq_lens[b] (seq_lens[b] =
// max(0, ceil((causal_seqs[b] - rank) / world))) always gives a bound inside [lo, seq_lens[b]],
// so the clamp only decides what an inconsistent value gives (the kernel relies on it: blocks
// the plain window shows whole are never masked). A row whose bound is 0 sees no key: out 0,
// lse -inf.
inline constexpr int kMaxDecodeContextParallelWorld = 1 << 16;  // keeps the bound's sums in int32

struct DecodeContextParallel {
  TensorView causal_seqs;
  int world = 1;
  int rank = 0;
};

// Decode / speculative verify.
//
//   q            [B, q_len, H, 576]  FP8 e4m3 or BF16; last dim contiguous, any other strides
//                                    (multiples of 16 bytes). 1 <= H <= 128, 1 <= q_len <= 1024;
//                                    GPU: B * max(1, ceil(max_pages * page_size / 64)) < 2^30
//                                    (kMaxDecodeBlocks).
//   kv_cache     [num_pages, page_size, 576]  same dtype as q. Rows contiguous inside a page;
//                                    page stride >= page_size*576 elements, 16-byte aligned.
//                                    Page 0 is the conventional null page for padding.
//   block_table  [B, max_pages] int32: page ids of each request, in order. Entries past a
//                                    request's length are never read (padding may be anything).
//   seq_lens     [B] int32: KV length of each request INCLUDING its q_len new tokens (already
//                                    written to the cache). Read on the device only.
//   out          [B, q_len, H, 512] BF16 (written), last dim contiguous (GPU: 16-byte aligned
//                                    rows).
//   lse          optional [B, q_len, H] FP32 (written): natural-log log-sum-exp of the scaled
//                                    scores, -inf for a row that sees no key.
//                                    out and lse must not address an element twice nor share a
//                                    byte with any other argument.
//   workspace    GPU: contiguous buffer of >= mla_decode_workspace_size(B, H, q_len, SMs) bytes
//                                    on the same device, 256-byte aligned, disjoint from every
//                                    other argument. CPU: not used (std::nullopt is fine).
//   softmax_scale  multiplies q·k (fold every q/k dequantisation scale into it).
//   output_scale   multiplies the output (where a V dequantisation scale goes).
//   stream       CUDA stream for device tensors.
//
//   context_parallel  optional: this call is one rank of a context-parallel decode (see
//                                    DecodeContextParallel above); std::nullopt: off.
//
// Query token t (0-based) of request b sees keys k < seq_lens[b] - (q_len - 1) + t, i.e. the
// causal mask inside the draft window, aligned to the end of the sequence (with
// context_parallel, the rank's bound given above instead):
//   out[b,t,h,:] = output_scale * sum_k softmax_k(softmax_scale * q[b,t,h,:]·kv[k,:]) * kv[k,0:512]
//
// On the GPU the call allocates nothing, never synchronises with the host and never reads
// seq_lens on the host, so it can be captured in a CUDA graph and replayed with new seq_lens,
// block tables and queries. Device-side values it cannot check on the host are made harmless:
// a seq_len below 0 or above max_pages*page_size gives NaN output and lse for that request
// (never an out-of-bounds read); out-of-range page ids read zeros.
// Throws Error for any shape, dtype, stride, alignment, device or size it can check.
void mla_decode(const TensorView& q, const TensorView& kv_cache, const TensorView& block_table,
                const TensorView& seq_lens, const TensorView& out,
                const std::optional<TensorView>& lse, const std::optional<TensorView>& workspace,
                float softmax_scale, float output_scale = 1.0f, Stream stream = nullptr,
                const std::optional<DecodeContextParallel>& context_parallel = std::nullopt);

}  // namespace speedmla
