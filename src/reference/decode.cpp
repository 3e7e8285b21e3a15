// Reference MLA decode / verify over the paged latent cache (speedmla/decode.h).
#include <algorithm>
#include <limits>
#include <vector>

#include "reference/attention.h"
#include "reference/element.h"
#include "reference/parallel.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla::reference {
namespace {

// Copies the first `seq_len` cache rows of one request, in token order, into `rows`
// (seq_len x 576 floats). Token k lives at row k % page_size of page block_table[k / page_size];
// a page id outside [0, num_pages) reads as a zero row, as on the GPU.
void gather_request_rows(const TensorView& kv_cache, const TensorView& block_table, int64_t b,
                         int64_t seq_len, std::vector<float>& rows) {
  const int64_t num_pages = kv_cache.size(0), page_size = kv_cache.size(1);
  rows.assign(static_cast<size_t>(seq_len * kCacheRowDim), 0.0f);
  parallel_for(seq_len, kCacheRowDim, [&](int64_t k) {
    const int64_t page = load_index(block_table, offset_of(block_table, b, k / page_size));
    if (page < 0 || page >= num_pages) return;
    load_row(kv_cache, offset_of(kv_cache, page, k % page_size), kCacheRowDim,
             rows.data() + k * kCacheRowDim);
  });
}

// Fills every output of request b with NaN: its seq_len cannot be honoured.
void poison_request(const TensorView& out, const std::optional<TensorView>& lse, int64_t b) {
  const int64_t q_len = out.size(1), num_heads = out.size(2);
  const std::vector<double> nan_row(kLatentDim, std::numeric_limits<double>::quiet_NaN());
  for (int64_t t = 0; t < q_len; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      store_row(out, offset_of(out, b, t, h), kLatentDim, nan_row.data());
      if (lse) store(*lse, offset_of(*lse, b, t, h), nan_row[0]);
    }
  }
}

// Keys query token t of a request sees (decode.h): the causal window aligned to the end of its
// seq_len keys, or with context parallelism this rank's share of the global window of
// causal_seq keys, clamped to [that plain window, seq_len]. In int64: no value overflows.
int64_t visible_keys(int64_t seq_len, int64_t q_len, int64_t t,
                     const std::optional<DecodeContextParallel>& context_parallel, int64_t causal_seq) {
  const int64_t plain = std::clamp<int64_t>(seq_len - (q_len - 1) + t, 0, seq_len);
  if (!context_parallel) return plain;
  const int64_t world = context_parallel->world;
  const int64_t global = causal_seq - context_parallel->rank - (q_len - 1) + t;
  const int64_t share = global <= 0 ? 0 : (global + world - 1) / world;
  return std::clamp(share, plain, seq_len);
}

}  // namespace

void mla_decode(const TensorView& q, const TensorView& kv_cache, const TensorView& block_table,
                const TensorView& seq_lens, const TensorView& out,
                const std::optional<TensorView>& lse, float softmax_scale, float output_scale,
                const std::optional<DecodeContextParallel>& context_parallel) {
  const int64_t batch = q.size(0), q_len = q.size(1), num_heads = q.size(2);
  const int64_t max_tokens = block_table.size(1) * kv_cache.size(1);
  const AttentionTensors io{q, out, lse};
  std::vector<float> rows;
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t seq_len = load_index(seq_lens, offset_of(seq_lens, b));
    if (seq_len < 0 || seq_len > max_tokens) {
      poison_request(out, lse, b);
      continue;
    }
    const int64_t causal_seq =
        context_parallel ? load_index(context_parallel->causal_seqs, offset_of(context_parallel->causal_seqs, b)) : 0;
    gather_request_rows(kv_cache, block_table, b, seq_len, rows);
    const KeyValueRows kv{rows.data(), kCacheRowDim, kCacheRowDim,
                          rows.data(), kCacheRowDim, kLatentDim};
    // One task per (query token, head), over the first visible_keys keys.
    parallel_for(q_len * num_heads, seq_len * (kCacheRowDim + kLatentDim), [&](int64_t row) {
      const int64_t t = row / num_heads, h = row % num_heads;
      const int64_t visible = visible_keys(seq_len, q_len, t, context_parallel, causal_seq);
      attend_row_at(io, kv, visible, softmax_scale, output_scale, b, t, h);
    });
  }
}

}  // namespace speedmla::reference
