// The launch of the prefill kernel for one element type; included by the .cu that instantiates
// it (nvcc gives kernel template stubs internal linkage).
#pragma once

#include <algorithm>

#include "kernels/prefill/sm90/launch.h"
#include "kernels/prefill/sm90/prefill_kernel.cuh"
#include "kernels/sm90/dynamic_smem.h"
#include "kernels/sm90/tensor_map.h"

namespace speedmla::kernels::prefill_sm90 {

// A descriptor over a ragged [rows, heads, dim] tensor with boxes of kChunkDims features x 1
// head x kTileRows rows: one chunk of a Q tile or a K/V block, swizzled as the kernel reads it.
// A dimension of extent 1 may carry any stride (frameworks give such dims arbitrary ones); the
// descriptor gets the packed one instead. An empty tensor is described by `fallback` instead:
// the kernel clamps every length to the tensor, so it never reads that descriptor.
template <typename Traits>
int encode_rows(CUtensorMap* map, const TensorView& t, const TensorView& fallback) {
  const TensorView& source = t.numel() > 0 ? t : fallback;
  const int64_t e = Traits::kElemBytes;
  const uint64_t dim = static_cast<uint64_t>(source.size(2)), heads = static_cast<uint64_t>(source.size(1)),
                 rows = static_cast<uint64_t>(source.size(0));
  const int64_t head_stride = heads > 1 ? source.strides[1] : source.size(2);
  const int64_t row_stride = rows > 1 ? source.strides[0] : static_cast<int64_t>(heads) * head_stride;
  const uint64_t dims[3] = {dim, heads, rows};
  const uint64_t strides[2] = {static_cast<uint64_t>(head_stride * e), static_cast<uint64_t>(row_stride * e)};
  const uint32_t box[3] = {kChunkDims, 1, kTileRows};
  return sm90::make_tensor_map_3d(map, source.data, Traits::kFp8 ? sm90::TmaElement::kUInt8 : sm90::TmaElement::kBFloat16,
                                  dims, strides, box, Traits::kTmaSwizzle);
}

// A descriptor over transposed values [H_kv, 128, T16] (PrefillValueLayout::kFp8Transposed)
// with boxes of 64 token positions x 128 value dims x 1 head: one chunk of a value block, 128
// rows of 64 bytes, SWIZZLE_64B as the kernel's P·V reads it. Empty values: `fallback`, never read.
inline int encode_transposed_values(CUtensorMap* map, const TensorView& v, const TensorView& fallback) {
  if (v.numel() == 0) return encode_rows<PrefillFp8Traits>(map, fallback, fallback);
  const uint64_t dims[3] = {static_cast<uint64_t>(v.size(2)), static_cast<uint64_t>(v.size(1)),
                            static_cast<uint64_t>(v.size(0))};
  const int64_t head_stride = v.size(0) > 1 ? v.strides[0] : v.size(1) * v.strides[1];
  const uint64_t strides[2] = {static_cast<uint64_t>(v.strides[1]), static_cast<uint64_t>(head_stride)};
  const uint32_t box[3] = {64, static_cast<uint32_t>(kVDim), 1};
  return sm90::make_tensor_map_3d(map, v.data, sm90::TmaElement::kUInt8, dims, strides, box, sm90::TmaSwizzle::k64B);
}

template <typename Traits>
PrefillLaunchStatus launch_prefill_kernel(const PrefillViews& views, const PrefillParams& params, cudaStream_t stream) {
  PrefillLaunchStatus status;
  CUtensorMap q_map, k_map, v_map;
  for (const auto& [map, tensor, name] : {std::tuple{&q_map, &views.q, "q"}, std::tuple{&k_map, &views.k, "k"},
                                         std::tuple{&v_map, &views.v, "v"}}) {
    status.tensor_map_error = Traits::kValuesTransposed && map == &v_map
                                  ? encode_transposed_values(map, *tensor, views.q)
                                  : encode_rows<Traits>(map, *tensor, views.q);
    if (status.tensor_map_error != 0) {
      status.tensor_map_name = name;
      return status;
    }
  }
  constexpr int smem_bytes = PrefillKernel<Traits>::kSmemBytes;
  status.cuda_error = sm90::ensure_dynamic_smem<prefill_kernel<Traits>>(smem_bytes);
  if (status.cuda_error != cudaSuccess) return status;
  // One CTA per SM (the shared memory allows no more), persistent over the work items.
  const auto grid = static_cast<unsigned>(std::min<int64_t>(params.total_items, views.num_sms));
  prefill_kernel<Traits><<<grid, kThreads, smem_bytes, stream>>>(q_map, k_map, v_map, params);
  status.cuda_error = cudaGetLastError();
  return status;
}

}  // namespace speedmla::kernels::prefill_sm90
