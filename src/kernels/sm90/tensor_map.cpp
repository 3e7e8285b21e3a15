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

}  // namespace

int make_tensor_map_3d(CUtensorMap* map, const void* base, TmaElement element, const uint64_t dims[3],
                       const uint64_t byte_strides[2], const uint32_t box[3], TmaSwizzle swizzle) {
  const auto encode = encode_function();
  if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
  const cuuint32_t element_strides[3] = {1, 1, 1};
  return encode(map, element == TmaElement::kUInt8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                3, const_cast<void*>(base), dims, byte_strides, box, element_strides,
                CU_TENSOR_MAP_INTERLEAVE_NONE,
                swizzle == TmaSwizzle::k64B ? CU_TENSOR_MAP_SWIZZLE_64B : CU_TENSOR_MAP_SWIZZLE_128B,
                CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace speedmla::kernels::sm90
