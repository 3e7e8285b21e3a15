// merge_attn_states: validation, then the CPU reference or the GPU kernel.
#include "speedmla/merge.h"

#include <cuda_runtime_api.h>

#include "api/check.h"
#include "kernels/merge/merge_attn_states.h"
#include "speedmla/reference.h"

namespace speedmla {

void merge_attn_states(const TensorView& out_a, const TensorView& lse_a, const TensorView& out_b,
                       const TensorView& lse_b, const TensorView& out,
                       const std::optional<TensorView>& lse, Stream stream) {
  const detail::ArgChecker check("merge_attn_states");
  check.defined(out_a, "out_a", 3);
  const int64_t tokens = out_a.size(0), heads = out_a.size(1), head_dim = out_a.size(2);
  auto check_out = [&](const TensorView& t, const char* name) {
    check.defined(t, name, 3);
    check.dtype(t, name, {DType::kBFloat16, DType::kFloat32});
    check.dim(t, name, 0, tokens);
    check.dim(t, name, 1, heads);
    check.dim(t, name, 2, head_dim);
    check.last_dim_contiguous(t, name);
    check.same_device(t, name, out_a.device);
  };
  auto check_lse = [&](const TensorView& t, const char* name) {
    check.defined(t, name, 2);
    check.dtype(t, name, {DType::kFloat32});
    check.dim(t, name, 0, tokens);
    check.dim(t, name, 1, heads);
    check.same_device(t, name, out_a.device);
  };
  check_out(out_a, "out_a");
  check_lse(lse_a, "lse_a");
  check_out(out_b, "out_b");
  check_lse(lse_b, "lse_b");
  check_out(out, "out");
  check.non_overlapping(out, "out");
  // In place means exactly the same view; any other overlap with an input would race.
  check.require(detail::same_view(out, out_a) || !detail::overlaps(out, out_a),
                "out must be out_a itself (in place) or not overlap it");
  check.disjoint(out, "out", out_b, "out_b");
  check.disjoint(out, "out", lse_a, "lse_a");
  check.disjoint(out, "out", lse_b, "lse_b");
  if (lse) {
    check_lse(*lse, "lse");
    check.non_overlapping(*lse, "lse");
    check.require(detail::same_view(*lse, lse_a) || !detail::overlaps(*lse, lse_a),
                  "lse must be lse_a itself (in place) or not overlap it");
    check.disjoint(*lse, "lse", lse_b, "lse_b");
    check.disjoint(*lse, "lse", out_a, "out_a");
    check.disjoint(*lse, "lse", out_b, "out_b");
    check.disjoint(*lse, "lse", out, "out");
  }

  if (!out_a.is_cuda()) return reference::merge_attn_states(out_a, lse_a, out_b, lse_b, out, lse);
  const detail::DeviceGuard guard(out_a.device, check.function());
  kernels::run_merge_attn_states({.out_a = out_a.data,
                                  .out_a_dtype = out_a.dtype,
                                  .out_a_stride_token = out_a.stride(0),
                                  .out_a_stride_head = out_a.stride(1),
                                  .lse_a = lse_a.ptr<const float>(),
                                  .lse_a_stride_token = lse_a.stride(0),
                                  .lse_a_stride_head = lse_a.stride(1),
                                  .out_b = out_b.data,
                                  .out_b_dtype = out_b.dtype,
                                  .out_b_stride_token = out_b.stride(0),
                                  .out_b_stride_head = out_b.stride(1),
                                  .lse_b = lse_b.ptr<const float>(),
                                  .lse_b_stride_token = lse_b.stride(0),
                                  .lse_b_stride_head = lse_b.stride(1),
                                  .out = out.data,
                                  .out_dtype = out.dtype,
                                  .out_stride_token = out.stride(0),
                                  .out_stride_head = out.stride(1),
                                  .lse = lse ? lse->ptr<float>() : nullptr,
                                  .lse_stride_token = lse ? lse->stride(0) : 0,
                                  .lse_stride_head = lse ? lse->stride(1) : 0,
                                  .num_tokens = tokens,
                                  .num_heads = heads,
                                  .head_dim = head_dim},
                                 stream);
  detail::check_cuda(cudaGetLastError(), "merge_attn_states", "kernel launch");
}

}  // namespace speedmla
