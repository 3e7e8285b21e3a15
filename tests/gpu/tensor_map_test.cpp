// sm90::make_tensor_map encodes tiled maps of every rank TMA supports, with each swizzle and L2
// promotion, and refuses ranks it does not; make_tensor_map_3d (the decode cache's map) encodes
// what it did before. The loads through such maps are tested by every decode test.
#include <cuda_runtime_api.h>
#include <gtest/gtest.h>

#include "common/util.h"
#include "kernels/sm90/tensor_map.h"

namespace speedmla::test {
namespace {

namespace sm90 = kernels::sm90;

TEST(TensorMapGpu, EveryRankSwizzleAndPromotion) {
  SPEEDMLA_REQUIRE_GPU();
  DeviceTensor buffer(DType::kUInt8, {int64_t{1} << 20});
  for (int rank = 1; rank <= sm90::kMaxTmaRank; ++rank)
    for (sm90::TmaSwizzle swizzle : {sm90::TmaSwizzle::kNone, sm90::TmaSwizzle::k32B, sm90::TmaSwizzle::k64B,
                                     sm90::TmaSwizzle::k128B})
      for (sm90::TmaL2Promotion l2 : {sm90::TmaL2Promotion::kNone, sm90::TmaL2Promotion::k64B,
                                      sm90::TmaL2Promotion::k128B, sm90::TmaL2Promotion::k256B}) {
        // BF16 rows of 64 elements (128 bytes), every further dimension of extent 4.
        sm90::TensorMapDesc desc;
        desc.rank = rank;
        desc.element = sm90::TmaElement::kBFloat16;
        desc.swizzle = swizzle;
        desc.l2_promotion = l2;
        const int span = swizzle == sm90::TmaSwizzle::kNone ? 128 : sm90::tma_swizzle_bytes(swizzle);
        desc.dims[0] = 64;
        desc.box[0] = static_cast<uint32_t>(span / sm90::tma_element_bytes(desc.element));
        uint64_t stride = 128;
        for (int d = 1; d < rank; ++d) {
          desc.dims[d] = 4;
          desc.box[d] = 2;
          desc.byte_strides[d - 1] = stride;
          stride *= 4;
        }
        CUtensorMap map;
        EXPECT_EQ(sm90::make_tensor_map(&map, buffer.view().data, desc), 0)
            << "rank " << rank << " swizzle " << static_cast<int>(swizzle) << " l2 " << static_cast<int>(l2);
      }
}

TEST(TensorMapGpu, RanksOutsideOneToFiveAreRefused) {
  SPEEDMLA_REQUIRE_GPU();
  DeviceTensor buffer(DType::kUInt8, {4096});
  CUtensorMap map;
  for (int rank : {0, 6}) {
    sm90::TensorMapDesc desc;
    desc.rank = rank;
    EXPECT_EQ(sm90::make_tensor_map(&map, buffer.view().data, desc), CUDA_ERROR_INVALID_VALUE) << rank;
  }
}

TEST(TensorMapGpu, ThreeDimensionalCacheMapAsBefore) {
  SPEEDMLA_REQUIRE_GPU();
  // The decode FP8 cache: [pages 4, tokens 64, 576], boxes of 64 features x 64 tokens, 64-byte swizzle.
  DeviceTensor cache(DType::kUInt8, {4 * 64 * 576});
  const uint64_t dims[3] = {576, 64, 4}, strides[2] = {576, 64 * 576};
  const uint32_t box[3] = {64, 64, 1};
  CUtensorMap map;
  EXPECT_EQ(sm90::make_tensor_map_3d(&map, cache.view().data, sm90::TmaElement::kUInt8, dims, strides, box,
                                     sm90::TmaSwizzle::k64B),
            0);
}

}  // namespace
}  // namespace speedmla::test
