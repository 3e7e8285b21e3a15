// speedmla/backend.h — the engine-facing MLA attention backend (contract §5).
//
// An inference engine hands the backend a batch; the backend builds the per-batch metadata on the
// device (block tables from the engine's page table, cumulative lengths, the chunked-prefill
// plan), keeps static buffers for CUDA graphs, owns the decode workspace and runs decode, verify
// and prefill through the public operations. It re-creates TokenSpeed's `tokenspeed_mla` backend
// (CuteDSLMLABackend) with the same method names, for Hopper and without PyTorch.
//
// All tensors handed in stay owned by the caller. A metadata view the backend returns is valid
// until the call that replaces it; its `storage` member keeps the memory allocated beyond that
// (a later batch may overwrite the contents). Every method is stream-ordered on the given stream
// and never synchronises with the host, except init_forward_metadata for batches with extend
// requests (it uploads host-built lists). Every method throws speedmla::Error, naming the
// argument and the expected value, for anything it can check; a call its checks refuse leaves
// the previous metadata in place. Not thread-safe: one backend serves one engine thread.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "speedmla/chunked_prefill.h"
#include "speedmla/prefill.h"
#include "speedmla/tensor.h"

namespace speedmla {

// What a forward pass does; speculative verify is kDecode with q_len > 1.
enum class ForwardMode : uint8_t {
  kDecode,  // every request decodes q_len tokens against its cache
  kExtend,  // every request prefills new tokens (possibly after a cached prefix)
  kMixed,   // extend requests first (rows [0, num_extends)), decode requests after them
};
const char* forward_mode_name(ForwardMode mode);

// The engine's model and serving settings. Invalid values are rejected by the MlaBackend
// constructor, before any forward pass.
struct MlaBackendConfig {
  int64_t num_heads = 128;  // the model's attention heads (all tensor-parallel ranks together)
  int64_t tp_size = 1;      // attention tensor-parallel size; must divide num_heads, and this rank
                            // runs H = num_heads / tp_size heads, 1 <= H <= 128
  int64_t page_size = 64;   // tokens per KV-cache page; decode_page_size_supported() must hold
  DType kv_cache_dtype = DType::kFloat8E4M3;  // kFloat8E4M3 or kBFloat16
  int64_t context_len = 0;  // most tokens of one request (max_context_len), >= 1
  int64_t max_batch = 0;    // most requests of one forward outside CUDA graphs, >= 1
  int64_t max_graph_batch = 0;   // largest CUDA-graph batch; 0 disables graphs
  int64_t num_draft_tokens = 0;  // speculative decoding: query tokens per request in a verify step
                                 // (the decode q_len); 0 means plain decode (q_len 1)
  bool is_draft = false;         // the draft model's backend: also builds decode metadata for
                                 // extend batches, and may alias its target's graph block table
  bool seed_compatible = false;  // also enforce tokenspeed_mla's limits: FP8 cache, page 32 or 64
  int64_t chunked_prefill_capacity = kDefaultChunkedPrefillCapacity;  // prefix tokens per loop
  // Decode's split policy (speedmla/decode.h, mla_decode_plan): 0 balances each batch over the
  // SMs; > 0 (a multiple of 64, e.g. kDefaultInvariantSplitTokens) makes decode batch-invariant,
  // each request's out and lse bit-identical whatever else is in the batch, at the cost the
  // header describes (fewer SMs busy on small batches, and a workspace that grows with
  // max(batch) * context_len / invariant_split_tokens partial results).
  int64_t invariant_split_tokens = 0;
  Device device{};               // where metadata and workspace live (CPU runs the reference)

  int64_t num_local_heads() const { return tp_size > 0 ? num_heads / tp_size : 0; }
  int64_t decode_q_len() const { return num_draft_tokens > 1 ? num_draft_tokens : 1; }
};

// Width of a block table: ceil(context_len / page_size) pages, rounded up to a multiple of
// max(1, 128 / page_size) (the seed's TRT-LLM block constraint), at least 1.
// Throws Error if an argument is not positive.
int64_t padded_block_table_width(int64_t context_len, int64_t page_size);

// Metadata of the decode rows of a batch (what mla_decode reads).
struct DecodeMetadata {
  int64_t num_extends = 0;  // rows [0, num_extends) are extend requests; decode uses the rest
  int64_t max_seq_len = 0;  // context_len: a bound that needs no host sync (as the seed)
  TensorView block_table;   // [bs, block_table_width] int32: page ids of request row r, padded
                            // with page 0; a row whose pool index is out of range is all page 0
  TensorView seq_lens;      // [bs] int32: the caller's seq_lens (aliased, never written)
  std::shared_ptr<const void> storage;  // owns block_table's memory
};

// Metadata of the extend (prefill) rows of a batch, built from host copies of their lengths.
struct ExtendMetadata {
  int64_t num_extends = 0;
  int64_t max_seq_len = 0;         // context_len (as the seed)
  int64_t max_extend_seq_len = 0;  // most new tokens of one request
  TensorView cu_seq_lens;          // [n+1] int32: cumulative prefix + new tokens per request
  TensorView cu_extend_seq_lens;   // [n+1] int32: cumulative new tokens (cu_seqlens of q)
  ChunkedPrefillPlan chunks;       // the prefix loops (host)
  std::vector<TensorView> chunk_cu_seq_lens;  // [num_loops] x [n+1] int32: chunks.cu_seq_lens
  std::vector<TensorView> chunk_slots;  // [num_loops] x [tokens of loop i] int64: cache slot of
                                        // every prefix key of loop i, request by request
  std::shared_ptr<const void> storage;  // owns the memory of the views above
};

// The new tokens' cache rows that forward_decode writes before attending.
struct NewTokenKv {
  TensorView kv;     // [T, 576] or [T, 1, 576]: latent(512) ‖ rope(64); BF16, FP16 or FP32,
                     // last dim contiguous
  TensorView slots;  // [T] int64: cache slot of each row (out_cache_loc); negative = skip
};

// Up-projects one loop's gathered prefix rows to per-head keys and values (the model's kv_b_proj
// and the rope broadcast), writing every element of k and v:
//   latent [n, 576] BF16: dequantised cache rows, latent(512) ‖ rope(64)
//   k      [n, H, 192] in q's dtype: k_nope(128) ‖ rope(64) of each head
//   v      [n, H, 128] in q's dtype
// The views are valid only during the call. An exception propagates out of attend_cached_prefix.
using PrefixExpander =
    std::function<void(const TensorView& latent, const TensorView& k, const TensorView& v)>;

// Caller-owned scratch of attend_cached_prefix; rows = extend_metadata()->chunks.max_loop_tokens,
// total_q = the extend tokens. Same device as the backend, last dims contiguous.
struct PrefixScratch {
  TensorView latent;  // [>= rows, 576] BF16
  TensorView k;       // [>= rows, H, 192] q's dtype, contiguous
  TensorView v;       // [>= rows, H, 128] q's dtype, contiguous; or, with v_layout kFp8Transposed
                      // (FP8, prefill.h), [H, 128, P] with P >= rows a multiple of 16, which
                      // expand fills in that layout (pack_prefill_kv's v_layout) and is passed
                      // whole (positions past a loop's tokens are ignored)
  TensorView out;     // [>= total_q, H, 128] BF16: one loop's partial output
  TensorView lse;     // [>= total_q, H] FP32: its log-sum-exp
  PrefillValueLayout v_layout = PrefillValueLayout::kTokenMajor;
};

class MlaBackend {
 public:
  // Validates `config` (Error naming the field and the accepted values) and allocates the decode
  // block table [max_batch, block_table_width], zero-filled before this returns (it waits for the
  // legacy default stream, so that no later work on any stream can race the fill). Workspaces are
  // allocated on first use (per stream) and by init_cuda_graph_state (for graphs).
  explicit MlaBackend(const MlaBackendConfig& config);
  ~MlaBackend();
  MlaBackend(const MlaBackend&) = delete;
  MlaBackend& operator=(const MlaBackend&) = delete;

  const MlaBackendConfig& config() const;
  int64_t block_table_width() const;

  // ---- per-batch metadata ----------------------------------------------------------------

  // Host copies of the extend requests' lengths (the engine's *_cpu tensors).
  struct ExtendLens {
    TensorView prefix_lens;  // [num_extends] int32, CPU: cached prefix tokens per request
    TensorView extend_lens;  // [num_extends] int32, CPU: new tokens per request
  };

  // Builds the metadata of a batch of `bs` requests whose first `num_extends` rows are extends.
  //   req_pool_indices [bs] int32 or int64 (device): each request's row of req_to_page
  //   seq_lens         [bs] int32 (device): KV length of each request including its new tokens;
  //                    aliased by the decode metadata, so it must outlive the forward pass
  //   req_to_page      [pool_size, max_pages] int32 (device): page ids of every pool row; the
  //                    row stride may exceed max_pages
  //   extend           the extend rows' host lengths; required when mode is kExtend or kMixed
  // kDecode and kMixed (and kExtend for a draft backend) build the decode metadata on the device:
  // a kernel copies each row of req_to_page into the block table, so this never waits for the
  // device. kExtend and kMixed build the extend metadata and the chunk plan from the host
  // lengths (prefix + new must not exceed context_len) and upload them (one H2D copy).
  // bs <= max_batch; 0 <= num_extends <= bs (num_extends == bs for kExtend, 0 for kDecode).
  void init_forward_metadata(int64_t bs, int64_t num_extends, const TensorView& req_pool_indices,
                             const TensorView& seq_lens, ForwardMode mode,
                             const TensorView& req_to_page,
                             const std::optional<ExtendLens>& extend, Stream stream = nullptr);

  // The current metadata, or nullptr when the last batch had none of that kind.
  const DecodeMetadata* decode_metadata() const;
  const ExtendMetadata* extend_metadata() const;

  // Sets the decode metadata's num_extends (0 <= n <= its bs), returning the previous value.
  int64_t set_num_extends(int64_t num_extends);
  // Restores the previous num_extends when it goes out of scope.
  class ScopedNumExtends {
   public:
    ScopedNumExtends(MlaBackend& backend, int64_t num_extends);
    ~ScopedNumExtends();
    ScopedNumExtends(const ScopedNumExtends&) = delete;
    ScopedNumExtends& operator=(const ScopedNumExtends&) = delete;

   private:
    MlaBackend& backend_;
    int64_t previous_;
  };
  [[nodiscard]] ScopedNumExtends override_num_extends(int64_t num_extends);

  // ---- CUDA graphs (decode and verify) ------------------------------------------------------

  // Allocates the static block table [max_bs, block_table_width] (page 0 everywhere, filled
  // before this returns, as the constructor's) and aliases
  // seq_lens_buf ([>= max_bs] int32, device; the engine writes it, the backend never does).
  // 1 <= max_bs <= config.max_graph_batch. Also allocates the graphs' workspace for max_bs
  // requests of decode_q_len() tokens.
  void init_cuda_graph_state(int64_t max_bs, const TensorView& seq_lens_buf);

  // Makes this (draft) backend read the static block table of `target`, which then refreshes it
  // for both: replays here skip the refresh. Needs config.is_draft, this backend's graph state,
  // the target's graph state with at least as many rows, and the same page size and context.
  void alias_cuda_graph_block_table(const MlaBackend& target);

  // Before capturing the graph of batch size `bs`: the decode metadata becomes views of the
  // static buffers (rows [0, bs)), remembered for replay. mode must be kDecode.
  void init_forward_metadata_capture_cuda_graph(int64_t bs, ForwardMode mode = ForwardMode::kDecode);

  // Before replaying the graph of batch size `bs`: restores its metadata and refreshes its block
  // table in place from req_to_page (skipped without req_to_page, or when aliased). Rows
  // [num_real, bs) are graph padding: their block-table rows become page 0 and their pool
  // indices are not read; the engine sets their seq_lens to cuda_graph_seq_len_fill_value().
  // num_real < 0 means bs. mode must be kDecode.
  void init_forward_metadata_replay_cuda_graph(int64_t bs, const TensorView& req_pool_indices,
                                               const std::optional<TensorView>& req_to_page,
                                               int64_t num_real = -1,
                                               ForwardMode mode = ForwardMode::kDecode,
                                               Stream stream = nullptr);

  // seq_len of padded graph rows: one key, on the null page.
  static constexpr int32_t cuda_graph_seq_len_fill_value() { return 1; }

  // ---- forward --------------------------------------------------------------------------------

  // Decode / verify of `bs` requests, rows [num_extends, num_extends + bs) of the decode metadata.
  //   q        [bs*q_len, H, 576] or [bs, q_len, H, 576]: BF16, or FP8 e4m3 for an FP8 cache;
  //            q_len = rows / bs; last dim contiguous
  //   kv_cache [num_pages, page_size, 576] in the configured dtype and page size
  //   out      [bs*q_len, H, 512] or [bs, q_len, H, 512] BF16 (written)
  //   scaling  the attention scale of q·k (finite, > 0); k_scale the cache's dequantisation scale
  //            (FP8 only; finite, > 0)
  //   new_kv   written first with kv_cache_write (× 1/k_scale for an FP8 cache)
  //   lse      optional [bs*q_len, H] or [bs, q_len, H] FP32 (written)
  // FP8 cache: BF16 q is quantised (× 1) into the workspace, softmax_scale = k_scale · scaling
  // and output_scale = k_scale (V is the cache's latent part). BF16 cache: softmax_scale =
  // scaling, output_scale = 1.
  // The split-KV plan (mla_decode_plan) is made once per step: the first forward_decode after
  // the metadata was built makes it in the workspace it uses, and the step's later layers (the
  // same bs, q_len, rows and workspace) reuse it, launching only the attention kernel and the
  // combine. A graph's replay metadata call remakes the plan of that graph in place, so captured
  // graphs hold no planner. Hence seq_lens must keep its values from the metadata call to the
  // last forward_decode of the step (the engine's contract already: the metadata aliases it).
  // Workspace: this backend's own, one per stream (two batches on two streams, or a draft
  // backend on a side stream, never share scratch), or, when the decode metadata comes from a
  // CUDA-graph capture or replay, the one buffer of this backend's graphs (its graphs must not
  // replay concurrently with each other). A buffer grows (sized for max(bs, max_batch,
  // max_graph_batch) requests) when q_len or bs needs more, never during capture: then Error.
  void forward_decode(const TensorView& q, const TensorView& kv_cache, int64_t bs,
                      const TensorView& out, float scaling, float k_scale = 1.0f,
                      const std::optional<NewTokenKv>& new_kv = std::nullopt,
                      const std::optional<TensorView>& lse = std::nullopt,
                      Stream stream = nullptr);

  // Ragged prefill attention (mla_prefill) with this rank's H heads, writing out and lse:
  //   q [Σq, H, 192], k [Σk, H, 192], v [Σk, H, 128] (all FP8 or all BF16),
  //   cu_seqlens_q, cu_seqlens_k [B+1] int32, out [Σq, H, 128] BF16, lse [Σq, H] FP32.
  // causal is bottom-right aligned; softmax_scale multiplies q·k.
  void forward_extend_chunked(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                              bool causal, float softmax_scale, const TensorView& out,
                              const TensorView& lse, Stream stream = nullptr);
  // The same with v in `v_layout` (prefill.h): kFp8Transposed takes FP8 values
  // [H, 128, T] as pack_prefill_kv writes them in that layout, which the GPU kernel reads
  // without transposing them (the faster FP8 prefill).
  void forward_extend_chunked(const TensorView& q, const TensorView& k, const TensorView& v,
                              PrefillValueLayout v_layout, const TensorView& cu_seqlens_q,
                              const TensorView& cu_seqlens_k, bool causal, float softmax_scale,
                              const TensorView& out, const TensorView& lse, Stream stream = nullptr);

  // Adds the cached prefixes of the current extend batch to (out, lse), which hold the
  // attention of the new tokens to themselves (forward_extend_chunked, causal). For each loop of
  // extend_metadata()->chunks: gather_cache (× k_scale) of the loop's slots into scratch.latent,
  // expand() to k and v, mla_prefill (non-causal) of q against them into scratch.out/lse, and
  // merge_attn_states into (out, lse) in place.
  //   q   [Σq, H, 192] FP8 or BF16, Σq = the extend tokens (cu_extend_seq_lens)
  //   out [Σq, H, 128] BF16 and lse [Σq, H] FP32, read and written
  void attend_cached_prefix(const TensorView& q, const TensorView& kv_cache, float k_scale,
                            const PrefixExpander& expand, const PrefixScratch& scratch,
                            const TensorView& out, const TensorView& lse, float softmax_scale,
                            Stream stream = nullptr);

  // Bytes of workspace forward_decode needs for `batch` requests of `q_len` tokens on this
  // backend's device (the mla_decode bound, plus room for FP8 queries with an FP8 cache).
  size_t workspace_bytes(int64_t batch, int64_t q_len) const;
  // Current size in bytes of this backend's workspace for eager calls on `stream` (0 before the
  // stream's first forward_decode that needs one), and of its graphs' workspace.
  size_t workspace_capacity(Stream stream = nullptr) const;
  size_t graph_workspace_capacity() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace speedmla
