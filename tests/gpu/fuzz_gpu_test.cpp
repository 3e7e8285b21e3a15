// The fuzz of tests/cpu/fuzz_test.cpp on CUDA tensors: each accepted call is compared with the
// CPU path on contiguous copies (bitwise for the conversions, within the attention and merge
// tests' bounds otherwise), its inputs and 256 poisoned bytes on either side of every device
// storage must stay untouched, and no CUDA error may follow. Device-side values the CPU refuses
// (prefill cu_seqlens) or gives no meaning (NaN/inf inside attention) are checked for safety
// only. Out-of-bounds reads inside the margins are what compute-sanitizer adds
// (scripts/gpu-check.sh --sanitize runs a short version of this test).
#include <gtest/gtest.h>

#include <cstdlib>

#include "common/fuzz_runner.h"

namespace speedmla::test::fuzz {
namespace {

// Cases per operation: SPEEDMLA_FUZZ_CASES (the sanitizer run takes fewer), else 400.
int gpu_cases() {
  const char* env = std::getenv("SPEEDMLA_FUZZ_CASES");
  return env && *env ? std::atoi(env) : 400;
}

class GpuFuzz : public testing::TestWithParam<Op> {};

TEST_P(GpuFuzz, RefusedOrCorrectNeverOutOfBounds) {
  SPEEDMLA_REQUIRE_GPU();
  run_fuzz(GetParam(), Target::kGpu, gpu_cases());
}

INSTANTIATE_TEST_SUITE_P(AllOps, GpuFuzz, testing::ValuesIn(kAllOps),
                         [](const testing::TestParamInfo<Op>& info) { return std::string(op_name(info.param)); });

}  // namespace
}  // namespace speedmla::test::fuzz
