// mla_prefill: validation at the boundary, then dispatch (CPU: the reference).
#include "speedmla/prefill.h"

#include <cuda_runtime_api.h>

#include <cstdint>
#include <vector>

#include "api/check.h"
#include "kernels/check/value_checks.h"
#include "kernels/prefill/sm90/launch.h"
#include "reference/element.h"
#include "speedmla/check.h"
#include "speedmla/decode.h"
#include "speedmla/reference.h"

namespace speedmla {
namespace {

// cu_seqlens on the CPU: starts at 0, never decreases, ends within the packed rows.
void check_cu_seqlens_values(const detail::ArgChecker& check, const TensorView& cu_seqlens,
                             const char* name, int64_t total_rows, const char* rows_name) {
  int64_t previous = 0;
  for (int64_t b = 0; b < cu_seqlens.size(0); ++b) {
    const int64_t value = reference::load_index(cu_seqlens, reference::offset_of(cu_seqlens, b));
    if (b == 0) check.require(value == 0, name, "[0] must be 0, got ", value);
    check.require(value >= previous, name, " must be non-decreasing, got ", name, "[", b, "] = ",
                  value, " after ", name, "[", b - 1, "] = ", previous);
    previous = value;
  }
  check.require(previous <= total_rows, name, "[", cu_seqlens.size(0) - 1, "] must be <= ",
                rows_name, " = ", total_rows, ", got ", previous);
}

// What the SM90 kernel needs beyond the contract's checks, then the launch. cu_seqlens stay on
// the device: the kernel clamps every length it reads to the tensors.
void run_on_gpu(const detail::ArgChecker& check, const TensorView& q, const TensorView& k, const TensorView& v,
                PrefillValueLayout v_layout, const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                const TensorView& out,
                const std::optional<TensorView>& lse, bool causal, float softmax_scale, float output_scale,
                Stream stream) {
  check.require(softmax_scale > 0.f, "softmax_scale must be > 0 on the GPU, got ", softmax_scale);
  // TMA reads q, k and v: 16-byte aligned rows, non-negative strides in 16-byte multiples.
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    check.aligned(*t, name, 16);
    check.require(t->strides[0] >= 0 && t->strides[1] >= 0, name, " must have non-negative strides, got (",
                  t->strides[0], ", ", t->strides[1], ")");
  }
  check.aligned(out, "out", 4);  // BF16 pairs
  check.contiguous(cu_seqlens_q, "cu_seqlens_q");
  check.contiguous(cu_seqlens_k, "cu_seqlens_k");
  constexpr int64_t kMaxRows = int64_t{1} << 31;
  check.require(q.size(0) < kMaxRows, "q.shape[0] must be < 2^31 on the GPU, got ", q.size(0));
  check.require(k.size(0) < kMaxRows, "k.shape[0] must be < 2^31 on the GPU, got ", k.size(0));
  check.require(cu_seqlens_q.size(0) <= (int64_t{1} << 30), "cu_seqlens_q must have at most 2^30 entries, got ",
                cu_seqlens_q.size(0));
  detail::DeviceGuard guard(q.device, check.function());
  detail::require_sm90(check, q.device);
  if (device_checks_enabled()) {
    kernels::run_check_cu_seqlens({cu_seqlens_q.ptr<const int32_t>(), cu_seqlens_q.size(0), q.size(0)}, stream);
    kernels::run_check_cu_seqlens({cu_seqlens_k.ptr<const int32_t>(), cu_seqlens_k.size(0), k.size(0)}, stream);
    detail::check_cuda(cudaGetLastError(), check.function(), "the check mode's validation kernel launch");
  }
  const kernels::prefill_sm90::PrefillViews views{
      q, k, v, cu_seqlens_q, cu_seqlens_k, out, v_layout == PrefillValueLayout::kFp8Transposed,
      lse ? &*lse : nullptr, causal, softmax_scale, output_scale, device_sm_count(q.device.index)};
  const auto status = kernels::prefill_sm90::run_prefill(views, reinterpret_cast<cudaStream_t>(stream));
  check.require(status.tensor_map_error == 0, "could not describe ", status.tensor_map_name,
                " to the TMA unit (cuTensorMapEncodeTiled error ", status.tensor_map_error, ")");
  detail::check_cuda(status.cuda_error, check.function(), "prefill kernel launch");
}

// The CPU reference reads token-major values: transposed ones are copied back to that layout
// (FP8 bytes moved, not converted).
std::vector<uint8_t> token_major_values(const TensorView& v_t, int64_t total_k) {
  const int64_t heads = v_t.size(0);
  std::vector<uint8_t> values(static_cast<size_t>(total_k * heads * kPrefillVDim));
  const auto* base = static_cast<const uint8_t*>(v_t.data);
  for (int64_t t = 0; t < total_k; ++t) {
    const int64_t position = fp8_transposed_value_position(t);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t d = 0; d < kPrefillVDim; ++d)
        values[static_cast<size_t>((t * heads + h) * kPrefillVDim + d)] =
            base[h * v_t.strides[0] + d * v_t.strides[1] + position];
  }
  return values;
}

}  // namespace

void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale, Stream stream) {
  mla_prefill(q, k, v, PrefillValueLayout::kTokenMajor, cu_seqlens_q, cu_seqlens_k, out, lse, causal, softmax_scale,
              output_scale, stream);
}

void mla_prefill(const TensorView& q, const TensorView& k, const TensorView& v, PrefillValueLayout v_layout,
                 const TensorView& cu_seqlens_q, const TensorView& cu_seqlens_k,
                 const TensorView& out, const std::optional<TensorView>& lse, bool causal,
                 float softmax_scale, float output_scale, Stream stream) {
  const detail::ArgChecker check("mla_prefill");
  const bool transposed = detail::values_transposed(check, v_layout);
  check.defined(q, "q", 3);
  check.defined(k, "k", 3);
  check.defined(v, "v", 3);
  check.defined(cu_seqlens_q, "cu_seqlens_q", 1);
  check.defined(cu_seqlens_k, "cu_seqlens_k", 1);
  check.defined(out, "out", 3);
  if (lse) check.defined(*lse, "lse", 2);

  check.dtype(q, "q", {DType::kFloat8E4M3, DType::kBFloat16});
  check.require(k.dtype == q.dtype, "k must have the dtype of q (", dtype_name(q.dtype), "), got ",
                dtype_name(k.dtype));
  check.require(v.dtype == q.dtype, "v must have the dtype of q (", dtype_name(q.dtype), "), got ",
                dtype_name(v.dtype));
  check.dtype(cu_seqlens_q, "cu_seqlens_q", {DType::kInt32});
  check.dtype(cu_seqlens_k, "cu_seqlens_k", {DType::kInt32});
  check.dtype(out, "out", {DType::kBFloat16});
  if (lse) check.dtype(*lse, "lse", {DType::kFloat32});

  const int64_t total_q = q.size(0), num_heads = q.size(1);
  const int64_t total_k = k.size(0), num_kv_heads = k.size(1);
  check.dim(q, "q", 2, kPrefillQkDim);
  check.dim(k, "k", 2, kPrefillQkDim);
  if (transposed) {
    check.require(q.dtype == DType::kFloat8E4M3, "q (and k, v) must be FP8 e4m3 with v_layout kFp8Transposed ",
                  "(an FP8 layout), got ", dtype_name(q.dtype));
    detail::check_transposed_values_shape(check, v, "v", num_kv_heads, total_k, "total_k");
  } else {
    check.dim(v, "v", 0, total_k);
    check.dim(v, "v", 1, num_kv_heads);
    check.dim(v, "v", 2, kPrefillVDim);
  }
  check.require(num_kv_heads >= 1, "k.shape[1] (H_kv) must be >= 1, got ", num_kv_heads);
  check.require(num_heads >= num_kv_heads && num_heads % num_kv_heads == 0,
                "q.shape[1] (H) must be a positive multiple of k.shape[1] (H_kv = ", num_kv_heads,
                "), got ", num_heads);
  check.dim(out, "out", 0, total_q);
  check.dim(out, "out", 1, num_heads);
  check.dim(out, "out", 2, kPrefillVDim);
  if (lse) {
    check.dim(*lse, "lse", 0, total_q);
    check.dim(*lse, "lse", 1, num_heads);
  }
  check.require(cu_seqlens_q.size(0) >= 1, "cu_seqlens_q must have B+1 >= 1 entries, got 0");
  check.dim(cu_seqlens_k, "cu_seqlens_k", 0, cu_seqlens_q.size(0));

  check.last_dim_contiguous(q, "q");
  check.last_dim_contiguous(k, "k");
  check.last_dim_contiguous(v, "v");
  check.last_dim_contiguous(out, "out");

  const Device device = q.device;
  check.same_device(k, "k", device);
  check.same_device(v, "v", device);
  check.same_device(cu_seqlens_q, "cu_seqlens_q", device);
  check.same_device(cu_seqlens_k, "cu_seqlens_k", device);
  check.same_device(out, "out", device);
  if (lse) check.same_device(*lse, "lse", device);

  // Outputs written while inputs are still being read, or rows written by two threads, would
  // give silently wrong results.
  check.non_overlapping(out, "out");
  if (lse) check.non_overlapping(*lse, "lse");
  for (const auto& [input, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"},
                                    {&cu_seqlens_q, "cu_seqlens_q"}, {&cu_seqlens_k, "cu_seqlens_k"}}) {
    check.disjoint(out, "out", *input, name);
    if (lse) check.disjoint(*lse, "lse", *input, name);
  }
  if (lse) check.disjoint(*lse, "lse", out, "out");
  check.finite(softmax_scale, "softmax_scale");
  check.finite(output_scale, "output_scale");

  if (device.kind == DeviceKind::kCUDA) {
    run_on_gpu(check, q, k, v, v_layout, cu_seqlens_q, cu_seqlens_k, out, lse, causal, softmax_scale, output_scale,
               stream);
    return;
  }

  check_cu_seqlens_values(check, cu_seqlens_q, "cu_seqlens_q", total_q, "q.shape[0]");
  check_cu_seqlens_values(check, cu_seqlens_k, "cu_seqlens_k", total_k, "k.shape[0]");
  if (transposed) {
    std::vector<uint8_t> values = token_major_values(v, total_k);
    const TensorView token_major = make_view(values.data(), v.dtype, v.device, {total_k, num_kv_heads, kPrefillVDim});
    reference::mla_prefill(q, k, token_major, cu_seqlens_q, cu_seqlens_k, out, lse, causal, softmax_scale,
                           output_scale);
    return;
  }
  reference::mla_prefill(q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, causal, softmax_scale,
                         output_scale);
}

}  // namespace speedmla
