// Seeded fuzz of every operation on CPU tensors (tests/common/fuzz.h): thousands of random
// argument sets, most broken in one or two ways; each must be refused with a speedmla::Error whose
// message names an argument, or give the bits of the same call on contiguous copies, and never
// touch memory outside its views (host storages end at inaccessible pages, so an overrun crashes
// the test). SPEEDMLA_TEST_SEED=n replays a run.
#include <gtest/gtest.h>

#include "common/fuzz_runner.h"

namespace speedmla::test::fuzz {
namespace {

class CpuFuzz : public testing::TestWithParam<Op> {};

TEST_P(CpuFuzz, RefusedOrCorrectNeverOutOfBounds) { run_fuzz(GetParam(), Target::kCpu, 700); }

INSTANTIATE_TEST_SUITE_P(AllOps, CpuFuzz, testing::ValuesIn(kAllOps),
                         [](const testing::TestParamInfo<Op>& info) { return std::string(op_name(info.param)); });

}  // namespace
}  // namespace speedmla::test::fuzz
