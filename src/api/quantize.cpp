// quantize_fp8 and pack_prefill_kv: validation, then the CPU reference or the GPU kernels.
// quantize_fp8's halves are also the library's own entry points (api/quantize_internal.h).
#include "speedmla/quantize.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <initializer_list>
#include <utility>

#include "api/check.h"
#include "api/quantize_internal.h"
#include "kernels/quantize/pack_prefill_kv.h"
#include "kernels/quantize/quantize_fp8.h"
#include "speedmla/decode.h"
#include "speedmla/prefill.h"
#include "speedmla/reference.h"

namespace speedmla {
namespace {

constexpr std::initializer_list<DType> kActivationDtypes = {DType::kBFloat16, DType::kFloat16,
                                                            DType::kFloat32};

// x and out (same shape, last dims contiguous) as rows of contiguous elements under at most
// kMaxDims - 1 outer dims: size-1 dims are dropped, the innermost dims that are contiguous in
// both tensors become the row, and outer dims that are contiguous with their inner neighbour in
// both tensors merge with it.
kernels::QuantizeFp8Params quantize_params(const TensorView& x, const TensorView& out,
                                           float scale_inv) {
  kernels::QuantizeFp8Params p{};
  p.x = x.data;
  p.x_dtype = x.dtype;
  p.out = out.data;
  p.scale_inv = scale_inv;
  p.row_length = 1;
  int d = x.ndim - 1;
  for (; d >= 0; --d) {  // the row: stride 1 for the last non-trivial dim, then row_length
    if (x.shape[d] == 1) continue;
    if (x.strides[d] != p.row_length || out.strides[d] != p.row_length) break;
    p.row_length *= x.shape[d];
  }
  // The last dim of size > 1 has stride 1 (validated), so at most kMaxDims - 1 dims remain.
  int n = 0;  // outer dims collected innermost first, reversed below
  for (; d >= 0; --d) {
    if (x.shape[d] == 1) continue;
    if (n > 0 && x.strides[d] == p.x_outer_strides[n - 1] * p.outer_shape[n - 1] &&
        out.strides[d] == p.out_outer_strides[n - 1] * p.outer_shape[n - 1]) {
      p.outer_shape[n - 1] *= x.shape[d];
      continue;
    }
    p.outer_shape[n] = x.shape[d];
    p.x_outer_strides[n] = x.strides[d];
    p.out_outer_strides[n] = out.strides[d];
    ++n;
  }
  std::reverse(p.outer_shape, p.outer_shape + n);
  std::reverse(p.x_outer_strides, p.x_outer_strides + n);
  std::reverse(p.out_outer_strides, p.out_outer_strides + n);
  p.num_outer_dims = n;
  p.num_rows = x.numel() == 0 ? 0 : 1;
  for (int i = 0; i < n; ++i) p.num_rows *= p.outer_shape[i];
  return p;
}

}  // namespace

namespace detail {

void validate_quantize_input(const ArgChecker& check, const TensorView& x, const char* name) {
  check.require(x.ndim >= 0 && x.ndim <= kMaxDims, name, " must have at most ", kMaxDims,
                " dimensions, got ", x.ndim);
  check.defined(x, name, x.ndim);
  check.dtype(x, name, kActivationDtypes);
  check.last_dim_contiguous(x, name);
}

void validate_quantize_output(const ArgChecker& check, const TensorView& x, const TensorView& out,
                              float scale_inv) {
  check.defined(out, "out", x.ndim);
  for (int d = 0; d < x.ndim; ++d) check.dim(out, "out", d, x.shape[d]);
  check.dtype(out, "out", {DType::kFloat8E4M3});
  check.last_dim_contiguous(out, "out");
  check.non_overlapping(out, "out");
  check.same_device(out, "out", x.device);
  check.disjoint(out, "out", x, "x");
  check.finite(scale_inv, "scale_inv");
}

void run_quantize_fp8_validated(const ArgChecker& check, const TensorView& x, const TensorView& out,
                                float scale_inv, Stream stream) {
  if (!x.is_cuda()) return reference::quantize_fp8(x, out, scale_inv);
  const DeviceGuard guard(x.device, check.function());
  kernels::run_quantize_fp8(quantize_params(x, out, scale_inv), stream);
  check_cuda(cudaGetLastError(), check.function(), "kernel launch");
}

}  // namespace detail

void quantize_fp8(const TensorView& x, const TensorView& out, float scale_inv, Stream stream) {
  const detail::ArgChecker check("quantize_fp8");
  detail::validate_quantize_input(check, x);
  detail::validate_quantize_output(check, x, out, scale_inv);
  detail::run_quantize_fp8_validated(check, x, out, scale_inv, stream);
}

void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, float k_scale_inv,
                     float v_scale_inv, Stream stream) {
  pack_prefill_kv(k_nope, k_rope, v, k_out, v_out, PrefillValueLayout::kTokenMajor, k_scale_inv, v_scale_inv, stream);
}

void pack_prefill_kv(const TensorView& k_nope, const TensorView& k_rope, const TensorView& v,
                     const TensorView& k_out, const TensorView& v_out, PrefillValueLayout v_layout,
                     float k_scale_inv, float v_scale_inv, Stream stream) {
  constexpr int64_t kNopeDim = kPrefillQkDim - kRopeDim;
  const detail::ArgChecker check("pack_prefill_kv");
  const bool transposed = detail::values_transposed(check, v_layout);
  check.defined(k_nope, "k_nope", 3);
  const int64_t tokens = k_nope.size(0), heads = k_nope.size(1);
  // [T, H, width] of a dtype in `dtypes`, last dim contiguous, on k_nope's device.
  auto check_rows = [&](const TensorView& t, const char* name, int64_t width,
                        std::initializer_list<DType> dtypes) {
    check.defined(t, name, 3);
    check.dtype(t, name, dtypes);
    check.dim(t, name, 0, tokens);
    check.dim(t, name, 1, heads);
    check.dim(t, name, 2, width);
    check.last_dim_contiguous(t, name);
    check.same_device(t, name, k_nope.device);
  };
  check_rows(k_nope, "k_nope", kNopeDim, kActivationDtypes);
  check.require(k_rope.ndim == 2 || k_rope.ndim == 3, "k_rope must be [T, 64] or [T, 1, 64], got ",
                k_rope.ndim, " dimensions (shape ", detail::shape_of(k_rope), ")");
  check.defined(k_rope, "k_rope", k_rope.ndim);
  check.require(k_rope.dtype == k_nope.dtype, "k_rope must be ", dtype_name(k_nope.dtype),
                " like k_nope, got ", dtype_name(k_rope.dtype));
  check.dim(k_rope, "k_rope", 0, tokens);
  if (k_rope.ndim == 3) check.dim(k_rope, "k_rope", 1, 1);
  check.dim(k_rope, "k_rope", k_rope.ndim - 1, kRopeDim);
  check.last_dim_contiguous(k_rope, "k_rope");
  check.same_device(k_rope, "k_rope", k_nope.device);
  check_rows(v, "v", kPrefillVDim, kActivationDtypes);
  check_rows(k_out, "k_out", kPrefillQkDim, {DType::kFloat8E4M3, DType::kBFloat16});
  if (transposed) {
    check.require(k_out.dtype == DType::kFloat8E4M3, "k_out must be FP8 e4m3 with v_layout kFp8Transposed (an FP8 ",
                  "layout), got ", dtype_name(k_out.dtype));
    detail::check_transposed_values_shape(check, v_out, "v_out", heads, tokens, "T");
    check.dtype(v_out, "v_out", {DType::kFloat8E4M3});
    check.last_dim_contiguous(v_out, "v_out");
    check.same_device(v_out, "v_out", k_nope.device);
    if (v_out.is_cuda()) check.aligned(v_out, "v_out", 16);  // 16-byte stores of one group's positions
  } else {
    check_rows(v_out, "v_out", kPrefillVDim, {k_out.dtype});
  }
  for (const auto& [written, name] : {std::pair{k_out, "k_out"}, std::pair{v_out, "v_out"}}) {
    check.non_overlapping(written, name);
    check.disjoint(written, name, k_nope, "k_nope");
    check.disjoint(written, name, k_rope, "k_rope");
    check.disjoint(written, name, v, "v");
  }
  check.disjoint(k_out, "k_out", v_out, "v_out");
  check.finite(k_scale_inv, "k_scale_inv");
  check.finite(v_scale_inv, "v_scale_inv");

  if (!k_nope.is_cuda())
    return reference::pack_prefill_kv(k_nope, k_rope, v, k_out, v_out, v_layout, k_scale_inv, v_scale_inv);
  const detail::DeviceGuard guard(k_nope.device, check.function());
  kernels::run_pack_prefill_kv({.k_nope = k_nope.data,
                                .k_nope_dtype = k_nope.dtype,
                                .k_nope_stride_token = k_nope.stride(0),
                                .k_nope_stride_head = k_nope.stride(1),
                                .k_rope = k_rope.data,
                                .k_rope_dtype = k_rope.dtype,
                                .k_rope_stride_token = k_rope.stride(0),
                                .v = v.data,
                                .v_dtype = v.dtype,
                                .v_stride_token = v.stride(0),
                                .v_stride_head = v.stride(1),
                                .k_out = k_out.data,
                                .k_out_stride_token = k_out.stride(0),
                                .k_out_stride_head = k_out.stride(1),
                                .v_out = v_out.data,
                                // Transposed: [H, 128, P], the head and dim strides.
                                .v_out_stride_token = transposed ? 0 : v_out.stride(0),
                                .v_out_stride_head = transposed ? v_out.stride(0) : v_out.stride(1),
                                .v_out_transposed = transposed,
                                .v_out_stride_dim = transposed ? v_out.stride(1) : 0,
                                .out_dtype = k_out.dtype,
                                .num_tokens = tokens,
                                .num_heads = heads,
                                .k_scale_inv = k_scale_inv,
                                .v_scale_inv = v_scale_inv},
                               stream);
  detail::check_cuda(cudaGetLastError(), "pack_prefill_kv", "kernel launch");
}

}  // namespace speedmla
