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
//                                    scores, -inf for a row that sees no key. A NaN score
//                                    (NaN in the query or a key the row sees) makes the
//                                    row's out and lse NaN, never a row that saw no key.
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

// ---- Plan once per step, run every layer on it ---------------------------------------------
//
// On the GPU, mla_decode makes three launches: a planner that reads seq_lens on the device and
// writes the split-KV plan (which KV blocks of which request each CTA processes) into the
// workspace, the attention kernel, and a combine of split requests' partial results (which
// merges each piece as soon as the attention kernel has written it, during that kernel's tail).
// The plan depends only on seq_lens, the batch, H, q_len, the block table's width, the page
// size, the dtype and the GPU, so it is the same for every layer of a model's decode step. An
// engine can make it once per step with mla_decode_plan and run each layer with
// mla_decode_with_plan: the planner then runs once per step instead of once per layer (a launch
// costs 1-3 us of host time, and the planner a few us on the GPU).
//
// The same plan call chooses the split policy:
//   balanced (invariant_split_tokens = 0, what mla_decode does): the planner spreads the whole
//     batch's KV blocks evenly over the SMs, so where a request is cut (and hence the rounding of
//     its output) depends on the other requests in the batch.
//   batch-invariant (invariant_split_tokens > 0, a multiple of 64): every request is cut into
//     pieces of invariant_split_tokens tokens counted from its own first token, each piece is
//     computed alone and the pieces are merged in their order, so a request's out and lse are
//     bit-identical whatever else is in the batch (same q, cache rows, length, H, q_len, dtype,
//     scales, block-table width and GPU). What it costs: a request is never cut finer than its own
//     pieces, so a small batch of long requests keeps fewer SMs busy than the balanced plan
//     would (B = 4 at 80K tokens with 4096-token pieces: 80 pieces for the H200's 132 SMs); a
//     CTA that holds several pieces of one request writes a partial result for each (written,
//     then read back by the combine); and the workspace grows with the batch times the pieces of
//     the longest request the block table can hold (mla_decode_workspace_size with
//     max_kv_tokens). Larger pieces need less workspace and fewer partial results; smaller ones
//     spread small batches over more SMs. Requests of at most one piece are never split.
// A reasonable piece size for the batch-invariant policy.
inline constexpr int64_t kDefaultInvariantSplitTokens = 4096;

// Bytes of workspace for a plan of either policy: mla_decode_workspace_size(batch, num_heads,
// q_len, num_sms) when invariant_split_tokens is 0, else also room for the batch-invariant
// plan's partial results: batch * ceil(max_kv_tokens / invariant_split_tokens) pieces of
// (num_heads * q_len * 2052 + 4) bytes (each row's 512 FP32 outputs and LSE, and the piece's
// completion counter), where max_kv_tokens = block_table.shape[1] * page_size (the
// most a request can hold). A workspace of this size also serves mla_decode. Throws Error unless
// the arguments of the four-argument form hold, max_kv_tokens >= 1 and invariant_split_tokens
// is 0 or a positive multiple of 64.
size_t mla_decode_workspace_size(int64_t batch, int64_t num_heads, int64_t q_len, int num_sms,
                                 int64_t max_kv_tokens, int64_t invariant_split_tokens);

// What a plan was made for, and where it lives. Returned by mla_decode_plan; the plan itself is
// in the workspace's first bytes, written on the device. mla_decode_with_plan compares every
// field with its own arguments and refuses a mismatch. Copyable; holds no memory.
struct DecodePlan {
  bool made = false;             // false for a default-constructed DecodePlan
  int64_t batch = 0, num_heads = 0, q_len = 0;
  int64_t max_pages = 0;         // block_table.shape[1]
  int64_t page_size = 0;
  DType dtype = DType::kBFloat16;  // of q and kv_cache
  Device device{};
  int num_sms = 0;               // of the device (0 on the CPU)
  int64_t invariant_split_tokens = 0;
  const void* seq_lens = nullptr;  // the address of the seq_lens it was made from
  std::optional<TensorView> workspace;  // the buffer it was written into (GPU)
};

// Makes the split-KV plan of a decode batch: launches only the planner, which reads seq_lens on
// the device and writes the plan into workspace. Nothing is read on the host, nothing
// allocated, no synchronisation: capturable in a CUDA graph, like mla_decode.
//   seq_lens      [B] int32, contiguous, on the device of the call; read by the planner.
//   block_table   [B, max_pages] int32: only its shape is used (the plan never reads it).
//   num_heads     H, in [1, 128];  q_len in [1, 1024].
//   dtype         kFloat8E4M3 or kBFloat16: the dtype of q and kv_cache of the calls to come.
//   page_size     tokens per cache page (GPU: a power of two in [1, 128]).
//   workspace     GPU: contiguous, 256-byte aligned, on the device, of at least
//                 mla_decode_workspace_size(B, H, q_len, SMs, max_pages * page_size,
//                 invariant_split_tokens) bytes, disjoint from seq_lens and block_table.
//                 CPU: not used (std::nullopt is fine); the CPU reference needs no plan.
//   invariant_split_tokens  0: the balanced policy of mla_decode; > 0 (a multiple of 64): the
//                 batch-invariant policy with pieces of that many tokens (see above).
// GPU: B * ceil(ceil(max_pages * page_size / 64) / split_blocks) * split_blocks < 2^30 with
// split_blocks = invariant_split_tokens / 64 (1 for the balanced policy: mla_decode's bound).
//
// The plan stays valid, for any number of mla_decode_with_plan calls, while (a) the values of
// seq_lens, (b) the workspace's contents and (c) the shapes above stay the same. The host checks
// (c) at every use, and that seq_lens is the same tensor (its address); it cannot see (a) or
// (b): new seq_lens values, or an mla_decode / mla_decode_plan call on the same workspace,
// invalidate the plan silently (wrong results; reads stay inside block_table and kv_cache only
// while the new lengths fit the block table). Make a new plan whenever seq_lens changes (each
// decode step). The plan belongs to its workspace: the layers of a step share it because they
// run one after another on one stream (a layer's partial results are overwritten only after the
// previous layer's combine has read them). Calls on another stream need their own workspace and
// plan, or events ordering them after the planner and apart from every other use of the
// workspace.
// Throws Error naming the argument for anything it can check.
DecodePlan mla_decode_plan(const TensorView& seq_lens, const TensorView& block_table, int64_t num_heads,
                           int64_t q_len, DType dtype, int64_t page_size, const std::optional<TensorView>& workspace,
                           int64_t invariant_split_tokens = 0, Stream stream = nullptr);

// mla_decode on a plan made by mla_decode_plan: the same arguments and result (for the
// balanced policy, the same bits as mla_decode), without the planner's launch; the workspace
// is the plan's. Checks everything mla_decode checks, then that the plan was made for these
// arguments: q's batch, heads, q_len and dtype, block_table.shape[1], kv_cache's page size, the
// device, and the same seq_lens tensor; Error names what differs. On the CPU the plan is
// checked the same way and the reference runs (it is batch-invariant by construction).
void mla_decode_with_plan(const DecodePlan& plan, const TensorView& q, const TensorView& kv_cache,
                          const TensorView& block_table, const TensorView& seq_lens, const TensorView& out,
                          const std::optional<TensorView>& lse, float softmax_scale, float output_scale = 1.0f,
                          Stream stream = nullptr);

}  // namespace speedmla
