#include "backend/device_buffer.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <new>

#include "api/check.h"

namespace speedmla::detail {

namespace {
constexpr std::align_val_t kHostAlignment{256};
}

DeviceBuffer::DeviceBuffer(Device device, size_t bytes, Fill fill, const char* caller)
    : device_(device), bytes_(bytes) {
  if (bytes == 0) return;
  if (device.kind == DeviceKind::kCPU) {
    data_ = ::operator new(bytes, kHostAlignment, std::nothrow);
    if (data_ == nullptr) fail(caller, ": cannot allocate ", bytes, " bytes of host memory");
    if (fill == Fill::kZero) std::memset(data_, 0, bytes);
    return;
  }
  DeviceGuard guard(device);
  const cudaError_t status = cudaMalloc(&data_, bytes);
  if (status != cudaSuccess) {
    cudaGetLastError();  // an out-of-memory error is not sticky; clear it for later calls
    fail(caller, ": cannot allocate ", bytes, " bytes on ", device_name(device), ": ",
         cudaGetErrorString(status));
  }
  if (fill == Fill::kZero) {
    // cudaMemset returns before the fill is done, and it runs on the legacy default stream, which
    // the caller's non-blocking streams do not wait for: a table built on such a stream right
    // after this could be wiped by the fill landing late. So the fill is waited for here.
    cudaError_t fill_status = cudaMemsetAsync(data_, 0, bytes, cudaStreamLegacy);
    if (fill_status == cudaSuccess) fill_status = cudaStreamSynchronize(cudaStreamLegacy);
    if (fill_status != cudaSuccess) {
      cudaFree(data_);  // the destructor does not run when the constructor throws
      data_ = nullptr;
      check_cuda(fill_status, caller, "the zero fill of a new buffer");
    }
  }
}

DeviceBuffer::~DeviceBuffer() {
  if (data_ == nullptr) return;
  if (device_.kind == DeviceKind::kCPU) {
    ::operator delete(data_, kHostAlignment);
  } else {
    // Errors are ignored: at process exit the CUDA runtime may already be gone.
    int current = -1;
    const bool switched = cudaGetDevice(&current) == cudaSuccess && current != device_.index &&
                          cudaSetDevice(device_.index) == cudaSuccess;
    cudaFree(data_);
    if (switched) cudaSetDevice(current);
  }
}

TensorView DeviceBuffer::view(DType dtype, std::initializer_list<int64_t> shape,
                              size_t byte_offset) const {
  return make_view(static_cast<char*>(data_) + byte_offset, dtype, device_, shape);
}

void DeviceBuffer::upload(size_t byte_offset, const void* host, size_t bytes, Stream stream,
                          const char* caller) const {
  if (bytes == 0) return;
  void* target = static_cast<char*>(data_) + byte_offset;
  if (device_.kind == DeviceKind::kCPU) {
    std::memcpy(target, host, bytes);
    return;
  }
  DeviceGuard guard(device_);
  check_cuda(cudaMemcpyAsync(target, host, bytes, cudaMemcpyHostToDevice, stream), caller,
             "cudaMemcpyAsync");
}

}  // namespace speedmla::detail
