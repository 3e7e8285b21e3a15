// Decode context parallelism on the CPU path of mla_decode: one global request set split over
// cp_world simulated ranks (each its own paged cache of every cp_world-th token), every rank's
// partial (out, lse) merged by the LSE, against the single-rank result of the global cache.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/decode_problem.h"
#include "common/op_testing.h"
#include "common/util.h"
#include "kernels/decode/sm90/params.h"
#include "speedmla/decode.h"

namespace speedmla::test {
namespace {

// Both sides come from the FP64 reference: the merged result differs from the global one only
// by the ranks' BF16 outputs (rounded, then merged and rounded again) and FP32 LSE, far below
// what one key too many or too few moves in these short requests.
constexpr double kOutRelL2 = 4e-3, kLseMaxAbs = 2e-5;

DecodeProblemSpec global_spec(DType dtype, int64_t q_len, uint64_t seed) {
  DecodeProblemSpec s;
  s.dtype = dtype;
  s.q_len = q_len;
  s.heads = 3;
  s.page_size = 16;  // the CPU takes any page size; local lengths cross pages at odd places
  s.seed = seed;
  // Lengths multiples of nothing, shorter than every world (1, 3), than q_len (1, 3 at q_len 4),
  // and longer than a few pages of every rank.
  s.seq_lens = {1, 3, 7, 45, 130, 301};
  std::mt19937_64 rng(seed);
  for (int32_t len : random_lengths(rng, 2, 2, 400)) s.seq_lens.push_back(len);
  s.batch = static_cast<int64_t>(s.seq_lens.size());
  return s;
}

// Every row: out rel. L2 and |Δlse| (both -inf where the global row sees no key).
void expect_rows_match(const DecodeResult& merged, const DecodeResult& global, const std::string& what) {
  const int64_t rows = global.lse.numel();
  int64_t wrong = 0;
  std::string first;
  for (int64_t row = 0; row < rows; ++row) {
    const ErrorStats o = compare(merged.out, global.out, row * kLatentDim, (row + 1) * kLatentDim);
    const ErrorStats l = compare(merged.lse, global.lse, row, row + 1);
    const bool ok = o.nonfinite == 0 && o.mismatched_inf == 0 && o.rel_l2 < kOutRelL2 && l.nonfinite == 0 &&
                    l.mismatched_inf == 0 && l.max_abs < kLseMaxAbs;
    if (!ok && ++wrong <= 3)
      first += "\n  row " + std::to_string(row) + ": out " + o.summary() + " | lse " + l.summary() + " (merged " +
               std::to_string(get(merged.lse, row)) + ", global " + std::to_string(get(global.lse, row)) + ")";
  }
  EXPECT_EQ(wrong, 0) << what << ": " << wrong << " of " << rows << " rows off" << first;
}

class DecodeContextParallelCpu : public testing::TestWithParam<DType> {};

TEST_P(DecodeContextParallelCpu, RanksMergedMatchTheSingleRankResult) {
  const uint64_t seed = test_seed();
  for (int64_t q_len : {1, 2, 3, 4}) {
    const DecodeProblem global = make_decode_problem(global_spec(GetParam(), q_len, seed + q_len));
    const DecodeResult expected = run_reference(global);
    for (int world : {2, 4, 8}) {
      std::vector<DecodeResult> parts;
      for (int rank = 0; rank < world; ++rank) parts.push_back(run_reference(make_cp_rank_problem(global, world, rank)));
      expect_rows_match(merge_partial_results(parts), expected,
                        global.spec.name() + " world " + std::to_string(world));
    }
  }
}

// world 1 with causal_seqs = seq_lens is the plain call, bit for bit.
TEST_P(DecodeContextParallelCpu, OneRankIsThePlainCall) {
  const DecodeProblem global = make_decode_problem(global_spec(GetParam(), 3, test_seed()));
  const CpRankProblem one = make_cp_rank_problem(global, 1, 0);
  const DecodeResult plain = run_reference(global), cp = run_reference(one);
  EXPECT_TRUE(bitwise_equal(cp.out, plain.out));
  EXPECT_TRUE(bitwise_equal(cp.lse, plain.lse));
}

// Values of causal_seqs inconsistent with seq_lens only move the bound between the local
// cache's plain causal window and all its keys (decode.h): a causal length <= 0 (INT32_MIN
// included, whose sums would overflow 32 bits) gives the plain call on the local cache;
// INT32_MAX every local key, as a causal length one past the last query's does.
TEST_P(DecodeContextParallelCpu, CausalSeqsOutOfRangeStayInsideTheRequest) {
  const DecodeProblem global = make_decode_problem(global_spec(GetParam(), 2, test_seed()));
  CpRankProblem rank = make_cp_rank_problem(global, 4, 3);
  const int64_t batch = global.spec.batch;
  auto run_with = [&](auto causal_of) {
    for (int64_t b = 0; b < batch; ++b) rank.causal_seqs.data<int32_t>()[b] = causal_of(b);
    return run_reference(rank);
  };
  const DecodeResult plain = run_reference(rank.local);
  for (int32_t nothing : {0, -5, std::numeric_limits<int32_t>::min()}) {
    SCOPED_TRACE(nothing);
    const DecodeResult r = run_with([&](int64_t) { return nothing; });
    EXPECT_TRUE(bitwise_equal(r.out, plain.out));
    EXPECT_TRUE(bitwise_equal(r.lse, plain.lse));
  }
  // Every local key: world * local length + q_len covers them for every row and rank.
  const DecodeResult all = run_with([&](int64_t b) { return 4 * rank.local.spec.seq_lens[b] + 4 + 2; });
  const DecodeResult huge = run_with([&](int64_t) { return std::numeric_limits<int32_t>::max(); });
  EXPECT_TRUE(bitwise_equal(huge.out, all.out));
  EXPECT_TRUE(bitwise_equal(huge.lse, all.lse));
  for (int64_t row = 0; row < all.lse.numel(); ++row) {  // a request with local keys: every row sees some
    const int64_t b = row / (2 * global.spec.heads);
    if (rank.local.spec.seq_lens[b] > 0) EXPECT_TRUE(std::isfinite(get(all.lse, row))) << row;
  }
}

// The GPU's bound divides by cp_world with a multiply-high, an add and a shift
// (kernels/decode/sm90/params.h): exact for every world and every dividend it can get, [0, 2^31).
TEST(DecodeContextParallelDivision, MagicDivisionIsExact) {
  std::mt19937_64 rng(test_seed());
  std::uniform_int_distribution<uint32_t> any(0, (uint32_t{1} << 31) - 1);
  int64_t wrong = 0;
  for (uint32_t d = 1; d <= static_cast<uint32_t>(kMaxDecodeContextParallelWorld); ++d) {
    const kernels::decode_sm90::DivisionMagic m = kernels::decode_sm90::division_magic(d);
    const uint32_t top = (uint32_t{1} << 31) - 1;
    const uint32_t k = top / d;
    for (uint32_t n : {uint32_t{0}, uint32_t{1}, d - 1, d, d + 1, 2 * d - 1, 2 * d, k * d - 1, k * d, top - 1, top,
                       any(rng), any(rng), any(rng) % (8 * d)}) {
      const uint64_t sum = ((uint64_t{n} * m.magic) >> 32) + n;  // the device's umulhi + add, in 64 bits
      const bool ok = sum < (uint64_t{1} << 32) && static_cast<uint32_t>(sum) >> m.shift == n / d;
      if (!ok && ++wrong <= 5) ADD_FAILURE() << n << " / " << d << ": magic " << m.magic << " shift " << m.shift;
    }
  }
  EXPECT_EQ(wrong, 0);
}

INSTANTIATE_TEST_SUITE_P(Types, DecodeContextParallelCpu, testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
