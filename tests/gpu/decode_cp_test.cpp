// Decode context parallelism on the GPU: one global request set split over cp_world simulated
// ranks on one device (each rank its own paged cache of every cp_world-th token, its local
// seq_lens, the global causal_seqs on the device). Every rank's partial is checked against the
// CPU reference of that rank, and the ranks' partials merged by the LSE against the CPU
// reference of the global cache (the single-rank result), request by request.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "common/decode_problem.h"
#include "common/dtype_gpu_test.h"
#include "common/util.h"

namespace speedmla::test {
namespace {

// One rank's mla_decode on the GPU, outputs poisoned first: every element must be written.
DecodeResult run_rank_on_gpu(const CpRankProblem& rank) {
  DeviceProblem dev(rank.local);
  const DeviceTensor causal(rank.causal_seqs);
  dev.out.fill_bytes(0xFF);
  dev.lse.fill_bytes(0xFF);
  dev.run(rank.local.spec, nullptr, DecodeContextParallel{causal.view(), rank.world, rank.rank});
  EXPECT_EQ(cudaDeviceSynchronize(), cudaSuccess) << rank.local.spec.name();
  return dev.download();
}

void check_split(const DecodeProblemSpec& spec, int world) {
  SCOPED_TRACE("cp_world " + std::to_string(world));
  const DecodeProblem global = make_decode_problem(spec);
  std::vector<DecodeResult> parts;
  for (int r = 0; r < world; ++r) {
    const CpRankProblem rank = make_cp_rank_problem(global, world, r);
    parts.push_back(run_rank_on_gpu(rank));
    expect_matches(parts.back(), run_reference(rank), rank.local.spec);
  }
  expect_matches(merge_partial_results(parts), run_reference(global), spec);
}

class DecodeContextParallelGpu : public DtypeGpuTest {
 protected:
  // Lengths multiples of nothing: shorter than every world and than q_len, a few blocks, and
  // random ones up to `longest`.
  DecodeProblemSpec spec(int64_t q_len, int64_t heads, int64_t page_size, int32_t longest) const {
    DecodeProblemSpec s;
    s.dtype = dtype();
    s.q_len = q_len;
    s.heads = heads;
    s.page_size = page_size;
    s.seed = seed() * 31 + static_cast<uint64_t>(q_len * 1000 + heads * 10 + page_size);
    s.seq_lens = {1, 3, 7, 130, 701};
    std::mt19937_64 rng(s.seed);
    for (int32_t len : random_lengths(rng, 3, 10, longest)) s.seq_lens.push_back(len);
    s.batch = static_cast<int64_t>(s.seq_lens.size());
    return s;
  }
};

TEST_P(DecodeContextParallelGpu, RanksMergedMatchTheSingleRankResult) {
  for (int64_t page_size : {64, 16})
    for (int64_t q_len : {1, 2, 3, 4})
      for (int world : {2, 4, 8}) check_split(spec(q_len, 16, page_size, 3000), world);
}

TEST_P(DecodeContextParallelGpu, ManyHeadsAndRowTiles) {
  for (int world : {2, 8}) check_split(spec(4, 128, 64, 2000), world);  // 512 rows: 8 row tiles
}

// One long request among short ones: the planner splits each rank's share over many parts, so
// pieces whose rows are all masked, partly masked or not at all meet in the combine.
TEST_P(DecodeContextParallelGpu, SplitKvLongRequest) {
  DecodeProblemSpec s = spec(2, 16, 64, 200);
  s.seq_lens.push_back(60001);
  s.batch = static_cast<int64_t>(s.seq_lens.size());
  for (int world : {2, 8}) check_split(s, world);
}

// Device values the host cannot check: any causal_seqs only moves each row's bound inside
// [0, seq_len] (decode.h), as the CPU reference does with the same values.
TEST_P(DecodeContextParallelGpu, CausalSeqsOutOfRangeStayInsideTheRequest) {
  const DecodeProblem global = make_decode_problem(spec(3, 16, 64, 900));
  CpRankProblem rank = make_cp_rank_problem(global, 4, 1);
  const int32_t values[] = {std::numeric_limits<int32_t>::min(), -7, 0, 1, std::numeric_limits<int32_t>::max()};
  for (int64_t b = 0; b < global.spec.batch; ++b) rank.causal_seqs.data<int32_t>()[b] = values[b % 5];
  expect_matches(run_rank_on_gpu(rank), run_reference(rank), rank.local.spec);
}

INSTANTIATE_TEST_SUITE_P(Types, DecodeContextParallelGpu, ::testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
