#include "speedmla/chunked_prefill.h"

#include <algorithm>
#include <limits>

#include "api/check.h"

namespace speedmla {

ChunkedPrefillPlan plan_chunked_prefill(std::span<const int32_t> prefix_lens, int64_t capacity) {
  const detail::ArgChecker c("plan_chunked_prefill");
  c.require(capacity >= 1, "capacity must be >= 1 token, got ", capacity);
  ChunkedPrefillPlan plan;
  plan.num_requests = static_cast<int64_t>(prefix_lens.size());
  plan.chunk_len = std::max<int64_t>(1, capacity / std::max<int64_t>(1, plan.num_requests));
  int64_t longest = 0;
  for (size_t b = 0; b < prefix_lens.size(); ++b) {
    c.require(prefix_lens[b] >= 0, "prefix_lens[", b, "] must be >= 0, got ", prefix_lens[b]);
    longest = std::max<int64_t>(longest, prefix_lens[b]);
    plan.total_tokens += prefix_lens[b];
  }
  plan.num_loops = (longest + plan.chunk_len - 1) / plan.chunk_len;
  plan.cu_seq_lens.assign(plan.num_loops, std::vector<int32_t>(prefix_lens.size() + 1, 0));
  plan.max_chunk_len.assign(plan.num_loops, 0);
  for (int64_t loop = 0; loop < plan.num_loops; ++loop) {
    const int64_t begin = plan.loop_begin(loop);
    int64_t tokens = 0;
    for (size_t b = 0; b < prefix_lens.size(); ++b) {
      const int64_t len = std::clamp<int64_t>(prefix_lens[b] - begin, 0, plan.chunk_len);
      tokens += len;
      c.require(tokens <= std::numeric_limits<int32_t>::max(), "loop ", loop, " would hold ",
                tokens, " tokens, more than int32 cu_seqlens can count");
      plan.cu_seq_lens[loop][b + 1] = static_cast<int32_t>(tokens);
      plan.max_chunk_len[loop] = std::max(plan.max_chunk_len[loop], static_cast<int32_t>(len));
    }
    plan.max_loop_tokens = std::max(plan.max_loop_tokens, tokens);
  }
  return plan;
}

}  // namespace speedmla
