// Which decode kernel a request shape runs on (kernels/decode/sm90/config.h). The GPU tests pass
// whichever kernel computes a case, so a dispatch rule that silently stopped sending FP8
// requests of few rows to the narrow kernel would pass them all: this pins the rule.
#include <gtest/gtest.h>

#include "kernels/decode/sm90/config.h"

namespace dk = speedmla::kernels::decode_sm90;

TEST(DecodeDispatch, FewRowFp8RequestsOnTmaPagesRunTheNarrowKernel) {
  // A tensor-parallel rank of 128 heads at q_len 1-2, and a few smaller shapes.
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 16 * 1), 16);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 8 * 2), 16);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 1), 16);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 17), 32);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 16 * 2), 32);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 32 * 1), 32);
  EXPECT_EQ(dk::narrow_tile_rows(true, 32, 16), 16);   // the smallest TMA page
  EXPECT_EQ(dk::narrow_tile_rows(true, 128, 32), 32);
}

TEST(DecodeDispatch, EverythingElseRunsTheSixtyFourRowKernel) {
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 33), 0);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 64), 0);
  EXPECT_EQ(dk::narrow_tile_rows(true, 64, 128 * 4), 0);
  EXPECT_EQ(dk::narrow_tile_rows(true, 16, 16), 0);    // copied rows: pages below TMA's minimum
  EXPECT_EQ(dk::narrow_tile_rows(true, 1, 16), 0);
  EXPECT_EQ(dk::narrow_tile_rows(false, 64, 16), 0);   // BF16
  EXPECT_EQ(dk::narrow_tile_rows(false, 64, 32), 0);
}
