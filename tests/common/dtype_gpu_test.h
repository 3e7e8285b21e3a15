// The fixture of the GPU suites parameterised by the attention dtype (FP8 e4m3, BF16).
#pragma once

#include <gtest/gtest.h>

#include <cstdint>

#include "common/util.h"

namespace speedmla::test {

// Skipped without a GPU. seed() is the run's test_seed() (printed; SPEEDMLA_TEST_SEED replays a
// run): every case of a test derives its data from it and its own shape.
class DtypeGpuTest : public ::testing::TestWithParam<DType> {
 protected:
  void SetUp() override {
    SPEEDMLA_REQUIRE_GPU();
    seed_ = test_seed();
  }
  DType dtype() const { return GetParam(); }
  uint64_t seed() const { return seed_; }

 private:
  uint64_t seed_ = 0;
};

}  // namespace speedmla::test
