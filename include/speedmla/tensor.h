// speedmla/tensor.h — a non-owning, strided view of a CPU or CUDA tensor.
//
// Every entry point of the library takes TensorViews. A view is a pointer plus dtype, device,
// shape and strides (in elements, as in PyTorch and DLPack), so any framework tensor can be
// handed over without a copy: build it from a DLPack DLTensor (from_dlpack) or by hand.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>

#include <dlpack/dlpack.h>

struct CUstream_st;

namespace speedmla {

// A CUDA stream (cudaStream_t). nullptr is the legacy default stream. Ignored for CPU tensors.
using Stream = CUstream_st*;

enum class DType : uint8_t {
  kFloat8E4M3,  // OCP e4m3fn: bias 7, max ±448, no infinities, NaN = 0x7F/0xFF
  kBFloat16,
  kFloat16,
  kFloat32,
  kInt32,
  kInt64,
  kUInt8,       // raw bytes (workspaces)
};
const char* dtype_name(DType dtype);
size_t dtype_size(DType dtype);  // bytes per element

enum class DeviceKind : uint8_t { kCPU, kCUDA };
struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int index = 0;  // CUDA ordinal; 0 for CPU
  bool operator==(const Device&) const = default;
};
std::string device_name(Device device);  // "cpu" or "cuda:N"

inline constexpr int kMaxDims = 6;

struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Device device{};
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};
  std::array<int64_t, kMaxDims> strides{};  // in elements, not bytes

  int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
  int64_t stride(int dim) const { return strides[dim < 0 ? dim + ndim : dim]; }
  int64_t numel() const;
  bool is_contiguous() const;  // row-major with no gaps (size-1 dims may have any stride; no elements: true)
  bool is_cuda() const { return device.kind == DeviceKind::kCUDA; }
  std::string shape_string() const;  // "[2, 3, 576]"

  // Typed access to the element at a multi-index; no bounds checks (the caller validated).
  template <typename T>
  T* ptr() const { return static_cast<T*>(data); }
};

// A contiguous row-major view of `data` with the given shape (at most kMaxDims dimensions;
// throws Error otherwise).
TensorView make_view(void* data, DType dtype, Device device, std::span<const int64_t> shape);
inline TensorView make_view(void* data, DType dtype, Device device, std::initializer_list<int64_t> shape) {
  return make_view(data, dtype, device, std::span<const int64_t>(shape.begin(), shape.size()));
}

// A view of a DLPack tensor (any DLPack version-1 DLTensor: PyTorch, JAX, CuPy, TVM FFI).
// byte_offset is folded into data; NULL strides mean contiguous. Accepted devices: kDLCPU,
// kDLCUDA (and kDLCUDAHost as CPU). Accepted dtypes: the DType list above, with FP8 e4m3fn as
// kDLFloat8_e4m3fn. Throws Error naming `name` for any other dtype, device or for ndim > kMaxDims.
TensorView from_dlpack(const DLTensor& tensor, const char* name = "tensor");

}  // namespace speedmla
