// A random mla_decode problem on the host, shaped like a serving batch: pages shuffled across
// a pool, page 0 the null page, block tables padded with it, and every slot no request may read
// (the null page, tails of last pages, padding, gaps of strided page views) filled with NaN.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "common/util.h"

namespace speedmla::test {

struct DecodeProblemSpec {
  DType dtype = DType::kBFloat16;
  int64_t batch = 1, q_len = 1, heads = 16, page_size = 64;
  std::vector<int32_t> seq_lens;   // one per request
  int64_t page_stride_pad = 0;     // extra elements between pages (strided page view)
  int64_t table_pad_pages = 3;     // padding columns of the block table (point at page 0)
  int64_t spare_pages = 2;         // unused pages in the pool (hold NaN)
  float softmax_scale = 0.0416667f;  // 1/sqrt(576)
  float output_scale = 1.f;
  uint64_t seed = 1;
  std::string name() const;
};

struct DecodeProblem {
  DecodeProblemSpec spec;
  HostTensor q, cache_storage, block_table, seq_lens;
  TensorView kv_cache;  // view of cache_storage: [num_pages, page_size, 576], page stride may be padded
  int64_t num_pages = 0;
};

DecodeProblem make_decode_problem(const DecodeProblemSpec& spec);

// The outputs of one decode problem, on the host.
struct DecodeResult {
  HostTensor out, lse;  // [B, q_len, H, 512] BF16, [B, q_len, H] FP32
};

// The CPU reference of the problem (the public mla_decode on its host tensors).
DecodeResult run_reference(const DecodeProblem& pb);

// Decode context parallelism simulated on one device (speedmla/decode.h,
// DecodeContextParallel): rank `rank` of `world` holds global tokens rank, rank + world, ... of
// every request of a global problem in a paged cache of its own (shuffled, padded and poisoned
// as make_decode_problem lays one out); its seq_lens are the local lengths, its q is the global
// problem's and causal_seqs holds the global seq_lens.
struct CpRankProblem {
  DecodeProblem local;
  HostTensor causal_seqs;  // [B] int32
  int world = 1, rank = 0;
};

CpRankProblem make_cp_rank_problem(const DecodeProblem& global, int world, int rank);

// The CPU reference of one rank's partial result (mla_decode with the rank's context_parallel).
DecodeResult run_reference(const CpRankProblem& rank);

// Merges partial results over disjoint key sets by their LSE in FP64 (contract §4.3 over N
// parts: a part of lse -inf is left out, a row empty in every part gets out 0 and lse -inf);
// out rounded once to BF16 as speedmla.cp.merge_partials returns it.
DecodeResult merge_partial_results(const std::vector<DecodeResult>& parts);

// The problem's tensors on the current device (the cache keeps its strided layout), with
// outputs and a workspace sized for it.
struct DeviceProblem {
  DeviceTensor q, cache_storage, block_table, seq_lens, out, lse, workspace;
  TensorView kv_cache;

  explicit DeviceProblem(const DecodeProblem& pb);
  // Another problem of the same shapes into the same buffers (a captured graph's next replay).
  void upload(const DecodeProblem& pb);
  // mla_decode into out and lse (context_parallel's causal_seqs on the device).
  void run(const DecodeProblemSpec& s, Stream stream = nullptr,
           const std::optional<DecodeContextParallel>& context_parallel = std::nullopt);
  DecodeResult download() const { return {out.to_host(), lse.to_host()}; }
};

// Compares a GPU result with the reference request by request (every request's output rel. L2
// and every row's LSE against decode_bounds: one wrong request among thousands barely moves an
// aggregate), prints "[ decode ] ..." and the error-budget line, and adds one gtest failure
// naming the first few requests off.
void expect_matches(const DecodeResult& gpu, const DecodeResult& ref, const DecodeProblemSpec& spec);

// Draws `batch` lengths in [lo, hi] (inclusive), log-uniformly so both ends show up.
std::vector<int32_t> random_lengths(std::mt19937_64& rng, int64_t batch, int32_t lo, int32_t hi);

}  // namespace speedmla::test
