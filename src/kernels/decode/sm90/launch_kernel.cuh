// Launch of the main decode kernel for one element type; included by the .cu that instantiates
// it (nvcc gives kernel template stubs internal linkage).
#pragma once

#include <algorithm>

#include "kernels/decode/sm90/decode_kernel.cuh"
#include "kernels/decode/sm90/launch.h"
#include "kernels/sm90/dynamic_smem.h"
#include "kernels/sm90/tensor_map.h"

namespace speedmla::kernels::decode_sm90 {

// The cache [num_pages, page_size, 576] as the producer loads it: boxes of one chunk (kChunkDims
// features, one swizzle row: DecodeKernel checks it) by min(page_size, kBlockTokens) tokens of
// one page, written in the swizzle the kernel's wgmma reads (both from Traits). Returns the
// driver's status (0: success).
template <typename Traits>
int encode_kv_tensor_map(const DecodeLaunch& launch, CUtensorMap* kv_map) {
  constexpr auto esize = static_cast<uint64_t>(Traits::kElemBytes);
  sm90::TensorMapDesc desc;
  desc.rank = 3;
  desc.element = Traits::kTmaElement;
  desc.swizzle = Traits::kTmaSwizzle;
  desc.dims[0] = kRowDim;
  desc.dims[1] = static_cast<uint64_t>(launch.page_size);
  desc.dims[2] = static_cast<uint64_t>(launch.num_pages);
  desc.byte_strides[0] = kRowDim * esize;
  // One page: the driver wants a stride for the outer dimension all the same.
  desc.byte_strides[1] = static_cast<uint64_t>(launch.num_pages > 1 ? launch.kv_page_stride
                                                                     : int64_t{launch.page_size} * kRowDim) * esize;
  desc.box[0] = kChunkDims;
  desc.box[1] = static_cast<uint32_t>(std::min(launch.page_size, kBlockTokens));
  desc.box[2] = 1;
  return sm90::make_tensor_map(kv_map, launch.kv_cache, desc);
}

// The kernel's cache map (none for KvLoad::kCopiedRows, which reads the cache through
// DecodeParams), then its shared-memory opt-in on the current device (set once per device,
// sm90/dynamic_smem.h).
template <typename Traits, KvLoad kLoad>
DecodeLaunchStatus prepare_decode_kernel(const DecodeLaunch& launch, CUtensorMap* kv_map) {
  using Kernel = DecodeKernel<Traits, kLoad>;
  DecodeLaunchStatus status;
  if constexpr (kLoad == KvLoad::kTmaPages) status.tensor_map = encode_kv_tensor_map<Traits>(launch, kv_map);
  else *kv_map = CUtensorMap{};
  if (status.tensor_map == 0)
    status.cuda = sm90::ensure_dynamic_smem<decode_kernel<Traits, kLoad>>(Kernel::kSmemBytes);
  return status;
}

template <typename Traits, KvLoad kLoad>
cudaError_t launch_decode_kernel(const CUtensorMap& kv_map, const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(params.num_row_tiles, params.num_parts);
  return sm90::launch_dependent(decode_kernel<Traits, kLoad>, grid, dim3(kThreads),
                                DecodeKernel<Traits, kLoad>::kSmemBytes, stream, kv_map, params);
}

}  // namespace speedmla::kernels::decode_sm90
