#include "kernels/sm90/tensor_map.h"

#include <cuda_runtime_api.h>
#include <cudaTypedefs.h>

namespace speedmla::kernels::sm90 {
namespace {

PFN_cuTensorMapEncodeTiled_v12000 encode_function() {
  static const PFN_cuTensorMapEncodeTiled_v12000 function = [] {
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult query{};
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &query) !=
            cudaSuccess ||
        query != cudaDriverEntryPointSuccess)
      fn = nullptr;
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(fn);
  }();
  return function;
}

CUtensorMapSwizzle driver_swizzle(TmaSwizzle swizzle) {
  switch (swizzle) {
    case TmaSwizzle::kNone: return CU_TENSOR_MAP_SWIZZLE_NONE;
    case TmaSwizzle::k32B: return CU_TENSOR_MAP_SWIZZLE_32B;
    case TmaSwizzle::k64B: return CU_TENSOR_MAP_SWIZZLE_64B;
    case TmaSwizzle::k128B: return CU_TENSOR_MAP_SWIZZLE_128B;
  }
  return CU_TENSOR_MAP_SWIZZLE_NONE;
}

CUtensorMapL2promotion driver_promotion(TmaL2Promotion promotion) {
  switch (promotion) {
    case TmaL2Promotion::kNone: return CU_TENSOR_MAP_L2_PROMOTION_NONE;
    case TmaL2Promotion::k64B: return CU_TENSOR_MAP_L2_PROMOTION_L2_64B;
    case TmaL2Promotion::k128B: return CU_TENSOR_MAP_L2_PROMOTION_L2_128B;
    case TmaL2Promotion::k256B: return CU_TENSOR_MAP_L2_PROMOTION_L2_256B;
  }
  return CU_TENSOR_MAP_L2_PROMOTION_NONE;
}

}  // namespace

int make_tensor_map(CUtensorMap* map, const void* base, const TensorMapDesc& desc) {
  if (desc.rank < 1 || desc.rank > kMaxTmaRank) return CUDA_ERROR_INVALID_VALUE;
  const auto encode = encode_function();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint32_t element_strides[kMaxTmaRank] = {1, 1, 1, 1, 1};
  return encode(map, desc.element == TmaElement::kUInt8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                static_cast<cuuint32_t>(desc.rank), const_cast<void*>(base), desc.dims, desc.byte_strides, desc.box,
                element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, driver_swizzle(desc.swizzle),
                driver_promotion(desc.l2_promotion), CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

int make_tensor_map_3d(CUtensorMap* map, const void* base, TmaElement element, const uint64_t dims[3],
                       const uint64_t byte_strides[2], const uint32_t box[3], TmaSwizzle swizzle) {
  TensorMapDesc desc;
  desc.rank = 3;
  for (int d = 0; d < 3; ++d) {
    desc.dims[d] = dims[d];
    desc.box[d] = box[d];
  }
  desc.byte_strides[0] = byte_strides[0];
  desc.byte_strides[1] = byte_strides[1];
  desc.element = element;
  desc.swizzle = swizzle;
  desc.l2_promotion = TmaL2Promotion::k256B;
  return make_tensor_map(map, base, desc);
}

}  // namespace speedmla::kernels::sm90
