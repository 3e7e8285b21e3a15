// speedmla/chunked_prefill.h — the plan of a chunked prefill over cached prefixes.
//
// When extend (prefill) requests continue from a cached prefix, their new tokens attend to the
// prefix too. The prefix lives in the paged latent cache; it is gathered, up-projected to
// per-head K/V and attended in loops so that one loop never holds more than `capacity` prefix
// tokens, and each loop's partial result is merged into the running one by its log-sum-exp.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace speedmla {

// The default number of prefix tokens one loop gathers over all requests (as in TokenSpeed).
inline constexpr int64_t kDefaultChunkedPrefillCapacity = 8192 * 4;

// With n requests, every loop takes up to chunk_len = max(1, capacity / n) prefix tokens of
// each request: loop i covers prefix positions [i*chunk_len, min(prefix_len_b, (i+1)*chunk_len))
// of request b. A plan is host data only; the backend turns it into device slot lists.
struct ChunkedPrefillPlan {
  int64_t num_requests = 0;
  int64_t chunk_len = 0;  // prefix tokens per request per loop
  int64_t num_loops = 0;  // ceil(max prefix_len / chunk_len); 0 when no request has a prefix
  // [num_loops][num_requests + 1]: cumulative key counts of loop i (the cu_seqlens_k of its
  // mla_prefill call); request b owns keys [cu_seq_lens[i][b], cu_seq_lens[i][b + 1]).
  std::vector<std::vector<int32_t>> cu_seq_lens;
  std::vector<int32_t> max_chunk_len;  // [num_loops]: longest single-request chunk of loop i
  int64_t max_loop_tokens = 0;  // max over loops of cu_seq_lens[i][n]: rows a loop's scratch needs
  int64_t total_tokens = 0;     // sum of all prefix lengths (every prefix token is in one loop)

  // First prefix position loop `loop` covers, in every request.
  int64_t loop_begin(int64_t loop) const { return loop * chunk_len; }
};

// Plans the loops for the given prefix lengths (tokens, >= 0 each; may be empty).
// Throws Error if capacity < 1, a length is negative, or a loop would exceed 2^31 - 1 tokens.
ChunkedPrefillPlan plan_chunked_prefill(std::span<const int32_t> prefix_lens,
                                        int64_t capacity = kDefaultChunkedPrefillCapacity);

}  // namespace speedmla
