#include "backend/workspace.h"

#include <cuda_runtime_api.h>

#include <algorithm>

#include "api/check.h"

namespace speedmla::detail {
namespace {

// Growing allocates, which must not happen while `stream` is being captured. A failed query
// counts as capturing: refusing to grow is the safe answer.
bool capturing(Device device, Stream stream) {
  if (device.kind != DeviceKind::kCUDA) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(static_cast<cudaStream_t>(stream), &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

TensorView GrowingBuffer::acquire(Device device, size_t bytes, size_t grow_to, Stream stream, const char* caller) {
  if (capacity() < bytes) {
    if (capturing(device, stream))
      fail(caller, ": the workspace holds ", capacity(), " bytes but this call needs ", bytes,
           "; it cannot grow during CUDA-graph capture. Run one step of this shape before capturing "
           "(on the capture stream, or with the graph's metadata), or configure a larger batch or "
           "num_draft_tokens");
    auto grown = std::make_unique<DeviceBuffer>(device, std::max(bytes, grow_to),
                                                DeviceBuffer::Fill::kUninitialized, caller);
    if (current_) retired_.push_back(std::move(current_));
    current_ = std::move(grown);
  }
  return current_ ? current_->view(DType::kUInt8, {static_cast<int64_t>(current_->size())})
                  : make_view(nullptr, DType::kUInt8, device, {0});
}

GrowingBuffer& BackendWorkspaces::of_stream(Stream stream) {
  for (auto& [key, buffer] : streams_)
    if (key == stream) return buffer;
  return streams_.emplace_back(stream, GrowingBuffer{}).second;
}

size_t BackendWorkspaces::stream_capacity(Stream stream) const {
  for (const auto& [key, buffer] : streams_)
    if (key == stream) return buffer.capacity();
  return 0;
}

}  // namespace speedmla::detail
