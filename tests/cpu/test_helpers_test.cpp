// The shared comparison helpers of tests/common: compare_rows localises an error to the rows of
// the leading dimension it is in, which the batch aggregate (compare) dilutes.
#include <gtest/gtest.h>

#include <stdexcept>

#include "common/util.h"

namespace speedmla::test {
namespace {

TEST(TestHelpers, CompareRowsSeesOnlyItsRows) {
  HostTensor expected(DType::kFloat32, {1000, 2, 4});
  for (int64_t i = 0; i < expected.numel(); ++i) set(expected, i, 1.0 + i % 7);
  HostTensor actual = expected;
  for (int64_t i = 0; i < 8; ++i) set(actual, 617 * 8 + i, 0.0);  // row 617 entirely wrong
  EXPECT_LT(compare(actual, expected).rel_l2, 0.05);                 // the aggregate hides it
  EXPECT_GT(compare_rows(actual, expected, 617, 618).rel_l2, 0.99);  // its own row does not
  EXPECT_EQ(compare_rows(actual, expected, 0, 617).max_abs, 0.0);
  EXPECT_EQ(compare_rows(actual, expected, 618, 1000).max_abs, 0.0);
  EXPECT_EQ(compare_rows(actual, expected, 5, 5).max_abs, 0.0);  // empty range
  EXPECT_THROW(compare_rows(actual, expected, 999, 1001), std::out_of_range);
  EXPECT_THROW(compare_rows(actual, expected, 3, 2), std::out_of_range);
}

}  // namespace
}  // namespace speedmla::test
