// Same inputs, same bits: decode (both dtypes, split-KV, q_len 1 and 3), prefill (both dtypes,
// causal and not) and merge run several times into freshly poisoned outputs must give
// bit-identical outputs and LSEs every time. A race, an uninitialised read or an order of
// floating-point additions that depends on timing (atomics) would show up as differing bits.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include <cstring>
#include <optional>
#include <random>
#include <string>

#include "common/decode_problem.h"
#include "common/op_testing.h"
#include "common/prefill_problem.h"
#include "common/util.h"
#include "speedmla/speedmla.h"

namespace speedmla::test {
namespace {

constexpr int kRuns = 5;

// Remembers the bytes of the first run's outputs and expects every later run's to equal them
// (exactly, NaN payloads included).
class SameBitsEveryRun {
 public:
  void check(const HostTensor& out, const HostTensor& lse, const std::string& what) {
    const std::string o = bytes_of(out), l = bytes_of(lse);
    if (runs_++ == 0) {
      out_ = o;
      lse_ = l;
      return;
    }
    EXPECT_TRUE(o == out_) << what << ": out of run " << runs_ - 1 << " differs from run 0";
    EXPECT_TRUE(l == lse_) << what << ": lse of run " << runs_ - 1 << " differs from run 0";
  }

 private:
  static std::string bytes_of(const HostTensor& t) {
    return std::string(static_cast<const char*>(t.view().data), t.nbytes());
  }
  int runs_ = 0;
  std::string out_, lse_;
};

class DeterminismGpu : public testing::TestWithParam<DType> {
 protected:
  void SetUp() override { SPEEDMLA_REQUIRE_GPU(); }
};

TEST_P(DeterminismGpu, DecodeWithSplitKv) {
  std::mt19937_64 rng = case_rng("determinism decode");
  for (const int64_t q_len : {1, 3}) {
    // Few long requests and 128 heads: the planner splits every request across parts, so the
    // combine kernel merges partial results (the order of those merges must not vary).
    DecodeProblemSpec s;
    s.dtype = GetParam();
    s.batch = 3;
    s.q_len = q_len;
    s.heads = 128;
    s.page_size = 64;
    s.seed = rng();
    s.seq_lens = {9000, 3001, 17};
    const DecodeProblem pb = make_decode_problem(s);
    DeviceProblem dev(pb);
    SameBitsEveryRun runs;
    for (int run = 0; run < kRuns; ++run) {
      dev.out.fill_bytes(0xFF);
      dev.lse.fill_bytes(0xFF);
      dev.workspace.fill_bytes(static_cast<uint8_t>(run * 37));  // the workspace needs no initialisation
      dev.run(s);
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      const DecodeResult r = dev.download();
      runs.check(r.out, r.lse, s.name());
    }
  }
}

TEST_P(DeterminismGpu, Prefill) {
  for (const bool causal : {true, false}) {
    PrefillProblemSpec spec{.name = causal ? "determinism causal" : "determinism non-causal", .dtype = GetParam(),
                            .heads = 16, .kv_heads = 16, .causal = causal};
    spec.requests = {{700, 700}, {1, 300}, {129, 1000}, {0, 3}, {64, 64}};
    const PrefillProblem pb = make_prefill_problem(spec);
    DevicePrefill dev(pb);
    SameBitsEveryRun runs;
    for (int run = 0; run < kRuns; ++run) {
      dev.run(spec);  // poisons out and lse first
      const PrefillResult r = dev.download();
      runs.check(r.out, r.lse, spec.label());
    }
  }
}

TEST(DeterminismGpuMerge, BothOutputDtypes) {
  SPEEDMLA_REQUIRE_GPU();
  for (const DType out_dtype : {DType::kBFloat16, DType::kFloat32}) {
    SCOPED_TRACE(dtype_name(out_dtype));
    std::mt19937_64 rng = case_rng(std::string("determinism merge ") + dtype_name(out_dtype));
    const int64_t tokens = 300, heads = 16, dim = 512;
    Mirror out_a(out_dtype, {tokens, heads, dim}), out_b(out_dtype, {tokens, heads, dim});
    Mirror lse_a(DType::kFloat32, {tokens, heads}), lse_b(DType::kFloat32, {tokens, heads});
    for (Mirror* m : {&out_a, &out_b}) fill_uniform(m->host, rng, -2.0, 2.0);
    for (Mirror* m : {&lse_a, &lse_b}) fill_uniform(m->host, rng, -30.0, 30.0);
    for (Mirror* m : {&out_a, &out_b, &lse_a, &lse_b}) m->upload();
    Mirror out(out_dtype, {tokens, heads, dim}), lse(DType::kFloat32, {tokens, heads});
    SameBitsEveryRun runs;
    for (int run = 0; run < kRuns; ++run) {
      out.poison();
      lse.poison();
      merge_attn_states(out_a.device_view(), lse_a.device_view(), out_b.device_view(), lse_b.device_view(),
                        out.device_view(), lse.device_view());
      ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
      runs.check(out.download(), lse.download(), std::string("merge into ") + dtype_name(out_dtype));
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Types, DeterminismGpu, testing::Values(DType::kFloat8E4M3, DType::kBFloat16),
                         DtypeParamName());

}  // namespace
}  // namespace speedmla::test
