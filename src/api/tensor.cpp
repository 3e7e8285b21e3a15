#include "speedmla/tensor.h"

#include <dlpack/dlpack.h>

#include <sstream>

#include "api/check.h"

namespace speedmla {

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3: return "float8_e4m3fn";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat16: return "float16";
    case DType::kFloat32: return "float32";
    case DType::kInt32: return "int32";
    case DType::kInt64: return "int64";
    case DType::kUInt8: return "uint8";
  }
  return "unknown";
}

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat8E4M3: case DType::kUInt8: return 1;
    case DType::kBFloat16: case DType::kFloat16: return 2;
    case DType::kFloat32: case DType::kInt32: return 4;
    case DType::kInt64: return 8;
  }
  return 0;
}

std::string device_name(Device device) {
  return device.kind == DeviceKind::kCPU ? "cpu" : "cuda:" + std::to_string(device.index);
}

int64_t TensorView::numel() const {
  int64_t n = 1;
  for (int d = 0; d < ndim; ++d) n *= shape[d];
  return n;
}

bool TensorView::is_contiguous() const {
  // A view without elements has no gaps whatever its strides (PyTorch gives an empty [H, 128, 0]
  // the strides (128, 1, 1)).
  if (numel() == 0) return true;
  int64_t expected = 1;
  for (int d = ndim - 1; d >= 0; --d) {
    if (shape[d] != 1 && strides[d] != expected) return false;
    expected *= shape[d];
  }
  return true;
}

std::string TensorView::shape_string() const {
  std::ostringstream os;
  os << '[';
  for (int d = 0; d < ndim; ++d) os << (d ? ", " : "") << shape[d];
  os << ']';
  return os.str();
}

TensorView make_view(void* data, DType dtype, Device device, std::span<const int64_t> shape) {
  if (shape.size() > static_cast<size_t>(kMaxDims))
    detail::fail("make_view: at most ", kMaxDims, " dimensions are supported, got ", shape.size());
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int d = 0;
  for (int64_t s : shape) t.shape[d++] = s;
  int64_t stride = 1;
  for (d = t.ndim - 1; d >= 0; --d) {
    t.strides[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

namespace {

DType dtype_from_dlpack(const DLDataType& dt, const char* name) {
  if (dt.lanes == 1) {
    if (dt.code == kDLFloat8_e4m3fn && dt.bits == 8) return DType::kFloat8E4M3;
    if (dt.code == kDLBfloat && dt.bits == 16) return DType::kBFloat16;
    if (dt.code == kDLFloat && dt.bits == 16) return DType::kFloat16;
    if (dt.code == kDLFloat && dt.bits == 32) return DType::kFloat32;
    if (dt.code == kDLInt && dt.bits == 32) return DType::kInt32;
    if (dt.code == kDLInt && dt.bits == 64) return DType::kInt64;
    if (dt.code == kDLUInt && dt.bits == 8) return DType::kUInt8;
  }
  detail::fail("from_dlpack: ", name, " has unsupported DLPack dtype (code ", int(dt.code),
               ", bits ", int(dt.bits), ", lanes ", dt.lanes,
               "); expected float8_e4m3fn, bfloat16, float16, float32, int32, int64 or uint8");
}

}  // namespace

TensorView from_dlpack(const DLTensor& tensor, const char* name) {
  TensorView t;
  if (tensor.ndim < 0 || tensor.ndim > kMaxDims)
    detail::fail("from_dlpack: ", name, " must have at most ", kMaxDims, " dimensions, got ",
                 tensor.ndim);
  switch (tensor.device.device_type) {
    case kDLCPU: case kDLCUDAHost: t.device = {DeviceKind::kCPU, 0}; break;
    case kDLCUDA: t.device = {DeviceKind::kCUDA, tensor.device.device_id}; break;
    default:
      detail::fail("from_dlpack: ", name, " must be on a CPU or CUDA device, got DLPack device type ",
                   int(tensor.device.device_type));
  }
  t.dtype = dtype_from_dlpack(tensor.dtype, name);
  t.data = static_cast<char*>(tensor.data) + tensor.byte_offset;
  t.ndim = tensor.ndim;
  int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.shape[d] = tensor.shape[d];
    t.strides[d] = tensor.strides ? tensor.strides[d] : stride;
    stride *= t.shape[d];
  }
  return t;
}

}  // namespace speedmla
