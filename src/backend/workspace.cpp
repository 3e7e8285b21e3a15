// The per-device workspace registry behind speedmla/workspace.h.
#include "speedmla/workspace.h"

#include <cuda_runtime_api.h>

#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

#include "api/check.h"
#include "backend/device_buffer.h"

namespace speedmla {

namespace {

struct DeviceWorkspace {
  std::unique_ptr<detail::DeviceBuffer> current;
  // Replaced buffers: CUDA graphs captured while they were current still point at them.
  std::vector<std::unique_ptr<detail::DeviceBuffer>> retired;
};

struct Registry {
  std::mutex mutex;
  std::map<std::pair<DeviceKind, int>, DeviceWorkspace> workspaces;
};

Registry& registry() {
  static Registry instance;
  return instance;
}

// Growing allocates, which must not happen while `stream` is being captured. A failed query
// counts as capturing: refusing to grow is the safe answer.
bool capturing(Device device, Stream stream) {
  if (device.kind != DeviceKind::kCUDA) return false;
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

}  // namespace

TensorView acquire_workspace(Device device, size_t bytes, Stream stream, const char* caller) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  DeviceWorkspace& ws = r.workspaces[{device.kind, device.index}];
  const size_t capacity = ws.current ? ws.current->size() : 0;
  if (capacity < bytes) {
    if (capturing(device, stream))
      detail::fail(caller, ": the workspace of ", device_name(device), " holds ", capacity,
                   " bytes but this call needs ", bytes,
                   "; it cannot grow during CUDA-graph capture. Run one step of this shape "
                   "before capturing, or configure a larger batch or num_draft_tokens");
    auto grown = std::make_unique<detail::DeviceBuffer>(
        device, bytes, detail::DeviceBuffer::Fill::kUninitialized, caller);
    if (ws.current) ws.retired.push_back(std::move(ws.current));
    ws.current = std::move(grown);
  }
  const auto size = static_cast<int64_t>(ws.current ? ws.current->size() : 0);
  return ws.current ? ws.current->view(DType::kUInt8, {size})
                    : make_view(nullptr, DType::kUInt8, device, {0});
}

size_t workspace_capacity(Device device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  const auto it = r.workspaces.find({device.kind, device.index});
  return it != r.workspaces.end() && it->second.current ? it->second.current->size() : 0;
}

}  // namespace speedmla
