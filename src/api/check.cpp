#include "api/check.h"

#include <cuda_runtime_api.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <utility>

namespace speedmla::detail {

void ArgChecker::defined(const TensorView& t, const char* name, int ndim) const {
  require(t.ndim == ndim, name, " must have ", ndim, " dimensions, got ", t.ndim, " (shape ",
          shape_of(t), ")");
  for (int d = 0; d < t.ndim; ++d)
    require(t.shape[d] >= 0, name, ".shape[", d, "] must be >= 0, got ", t.shape[d]);
  // Element counts and offsets are int64 everywhere: a view whose count or reach does not fit
  // (a corrupted shape or stride) would wrap around instead of failing.
  int64_t count = 1, reach = 0;
  for (int d = 0; d < t.ndim && count > 0; ++d) {
    int64_t step = 0;
    const int64_t stride = t.strides[d] >= 0 ? t.strides[d] : t.strides[d] == INT64_MIN ? INT64_MAX : -t.strides[d];
    require(t.shape[d] == 0 || (!__builtin_mul_overflow(count, t.shape[d], &count) && count < (int64_t{1} << 60) &&
                                !__builtin_mul_overflow(t.shape[d] - 1, stride, &step) &&
                                !__builtin_add_overflow(reach, step, &reach) && reach < (int64_t{1} << 60)),
            name, " has more than 2^60 elements or offsets (shape ", shape_of(t), ")");
  }
  require(t.data != nullptr || t.numel() == 0, name, " has a null data pointer");
  // Every framework aligns elements to their size; a pointer that is not is a mistake (a byte
  // offset applied to a typed tensor), and reading through it is undefined on the host.
  require(t.numel() == 0 || reinterpret_cast<uintptr_t>(t.data) % dtype_size(t.dtype) == 0, name,
          " data must be aligned to its element size (", dtype_size(t.dtype), " bytes)");
}

void ArgChecker::dtype(const TensorView& t, const char* name,
                       std::initializer_list<DType> allowed) const {
  if (std::find(allowed.begin(), allowed.end(), t.dtype) != allowed.end()) return;
  std::string list;
  for (DType d : allowed) list += std::string(list.empty() ? "" : " or ") + dtype_name(d);
  fail(name, " must be ", list, ", got ", dtype_name(t.dtype));
}

void ArgChecker::dim(const TensorView& t, const char* name, int d, int64_t value) const {
  require(t.shape[d] == value, name, ".shape[", d, "] must be ", value, ", got ", t.shape[d],
          " (shape ", shape_of(t), ")");
}

void ArgChecker::last_dim_contiguous(const TensorView& t, const char* name) const {
  require(t.ndim == 0 || t.shape[t.ndim - 1] <= 1 || t.strides[t.ndim - 1] == 1, name,
          " must be contiguous in its last dimension, got stride ", t.strides[t.ndim - 1]);
}

void ArgChecker::contiguous(const TensorView& t, const char* name) const {
  require(t.is_contiguous(), name, " must be contiguous, got shape ", shape_of(t));
}

void ArgChecker::aligned(const TensorView& t, const char* name, int64_t bytes) const {
  require(reinterpret_cast<uintptr_t>(t.data) % bytes == 0, name, " data must be ", bytes,
          "-byte aligned");
  const int64_t esize = static_cast<int64_t>(dtype_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d)
    require(t.shape[d] <= 1 || (t.strides[d] * esize) % bytes == 0, name, ".stride(", d,
            ") must be a multiple of ", bytes, " bytes, got ", t.strides[d] * esize, " bytes");
}

void ArgChecker::same_device(const TensorView& t, const char* name, Device device) const {
  require(t.device == device, name, " must be on ", device_of(device), ", got ",
          device_of(t.device));
}

void ArgChecker::non_overlapping(const TensorView& t, const char* name) const {
  if (t.numel() == 0) return;  // nothing is written (an empty dim may come with any strides)
  std::array<std::pair<int64_t, int64_t>, kMaxDims> dims{};  // (|stride|, size), dims > 1, sorted
  int n = 0;
  for (int d = 0; d < t.ndim; ++d) {
    if (t.shape[d] <= 1) continue;
    const std::pair<int64_t, int64_t> dim{std::abs(t.strides[d]), t.shape[d]};
    int i = n++;
    for (; i > 0 && dims[i - 1] > dim; --i) dims[i] = dims[i - 1];
    dims[i] = dim;
  }
  int64_t span = 0;  // largest offset the smaller dims reach
  for (int i = 0; i < n; ++i) {
    require(dims[i].first > span, name, " is written, so no two of its elements may share an ",
            "address; its stride ", dims[i].first, " does not clear the ", span + 1,
            " elements spanned by its smaller dims (shape ", shape_of(t), ")");
    span += dims[i].first * (dims[i].second - 1);
  }
}

void ArgChecker::disjoint(const TensorView& t, const char* name, const TensorView& other,
                          const char* other_name) const {
  require(!overlaps(t, other), name, " must not overlap ", other_name);
}

void ArgChecker::finite(float value, const char* name) const {
  require(std::isfinite(value), name, " must be finite, got ", value);
}

std::ostream& operator<<(std::ostream& os, ShapeOf shape) { return os << shape.t.shape_string(); }
std::ostream& operator<<(std::ostream& os, DeviceOf device) { return os << device_name(device.device); }
std::ostream& operator<<(std::ostream& os, CallArguments arguments) {
  const char* separator = "";
  for (const int64_t v : arguments.values) os << std::exchange(separator, ", ") << v;
  return os;
}

ByteRange byte_range(const TensorView& t) {
  if (t.numel() == 0) return {};
  const int64_t esize = static_cast<int64_t>(dtype_size(t.dtype));
  int64_t lo = 0, hi = 0;
  for (int d = 0; d < t.ndim; ++d) {
    const int64_t span = (t.shape[d] - 1) * t.strides[d];
    (span < 0 ? lo : hi) += span;
  }
  const auto base = reinterpret_cast<uintptr_t>(t.data);
  return {base + lo * esize, base + (hi + 1) * esize};
}

bool overlaps(const TensorView& a, const TensorView& b) {
  if (!(a.device == b.device)) return false;
  const ByteRange ra = byte_range(a), rb = byte_range(b);
  return ra.begin < rb.end && rb.begin < ra.end;
}

bool same_view(const TensorView& a, const TensorView& b) {
  return a.data == b.data && a.dtype == b.dtype && a.device == b.device && a.ndim == b.ndim &&
         std::equal(a.shape.begin(), a.shape.begin() + a.ndim, b.shape.begin()) &&
         std::equal(a.strides.begin(), a.strides.begin() + a.ndim, b.strides.begin());
}

DeviceGuard::DeviceGuard(Device device, const char* function) {
  if (device.kind != DeviceKind::kCUDA) return;
  int current = 0;
  check_cuda(cudaGetDevice(&current), function, "cudaGetDevice");
  if (current != device.index) {
    check_cuda(cudaSetDevice(device.index), function, "cudaSetDevice");
    previous_ = current;
  }
}

DeviceGuard::~DeviceGuard() {
  if (previous_ >= 0) cudaSetDevice(previous_);
}

void check_cuda(int status, const char* function, const char* what) {
  if (status == cudaSuccess) return;
  const auto err = static_cast<cudaError_t>(status);
  fail(function, ": CUDA error in ", what, ": ", cudaGetErrorName(err), " (",
       cudaGetErrorString(err), ")");
}

bool values_transposed(const ArgChecker& check, PrefillValueLayout v_layout) {
  const bool transposed = v_layout == PrefillValueLayout::kFp8Transposed;
  check.require(transposed || v_layout == PrefillValueLayout::kTokenMajor, "v_layout must be kTokenMajor or ",
                "kFp8Transposed, got ", static_cast<int>(v_layout));
  return transposed;
}

void check_transposed_values_shape(const ArgChecker& check, const TensorView& t, const char* name, int64_t heads,
                                   int64_t tokens, const char* tokens_name) {
  check.defined(t, name, 3);
  check.dim(t, name, 0, heads);
  check.dim(t, name, 1, kPrefillVDim);
  check.require(t.size(2) >= tokens && t.size(2) % kFp8TransposedGroupTokens == 0, name,
                ".shape[2] (kFp8Transposed: token positions) must be a multiple of ", kFp8TransposedGroupTokens,
                " and >= ", tokens_name, " = ", tokens, ", got ", t.size(2));
}

void require_sm90(const ArgChecker& check, Device device) {
  if (device.kind != DeviceKind::kCUDA) return;
  constexpr int kMaxDevices = 64;
  // 10 * major + minor + 1 per device; 0 while unknown. Two threads may both query a device the
  // first time; they store the same value.
  static std::array<std::atomic<int>, kMaxDevices> capability{};
  check.require(device.index >= 0 && device.index < kMaxDevices, "CUDA device index must be in [0, ",
                kMaxDevices, "), got ", device.index);
  int cached = capability[device.index].load(std::memory_order_relaxed);
  if (cached == 0) {
    int major = 0, minor = 0;
    check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device.index), check.function(),
               "cudaDeviceGetAttribute(ComputeCapabilityMajor)");
    check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device.index), check.function(),
               "cudaDeviceGetAttribute(ComputeCapabilityMinor)");
    cached = 10 * major + minor + 1;
    capability[device.index].store(cached, std::memory_order_relaxed);
  }
  const int cc = cached - 1;
  check.require(cc == 90, device_of(device), " has compute capability ", cc / 10, ".", cc % 10,
                "; the GPU kernels of this operation are built for sm_90a and need compute capability 9.0 "
                "(H100/H200)");
}

}  // namespace speedmla::detail
